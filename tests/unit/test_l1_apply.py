"""Pure rules of the L1 ingester: events → tier ops, medium/group policy, sequence logic."""

from __future__ import annotations

import pytest

from common.errors import DecodeError
from common.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    SkippedEvent,
    decode_batch,
    encode_batch,
)
from services.l1_ingest.apply import (
    Cursor,
    GroupSettings,
    Plan,
    Verdict,
    classify,
    plan_ops,
    plan_run,
    tier_for_medium,
)
from services.l1_ingest.replay import END_SEQ, parse_reply
from services.l1_ingest.stream import rank_endpoint
from services.l1_ingest.rank_conn import parse_live


def stored(hashes: list[int], medium: str | None = "GPU", **kw: object) -> BlockStored:
    tokens = kw.pop("token_ids", list(range(4 * len(hashes))))
    return BlockStored(hashes, None, tokens, kw.pop("block_size", 4), medium=medium, **kw)  # type: ignore[arg-type]


def writes(plan: Plan) -> list[tuple[object, ...]]:
    """The plan's hash writes (descriptors left out); group 0 written as (op, tier, hashes)."""
    return [
        (op, tier, vals) if g == 0 else (op, tier, g, vals)
        for op, tier, g, vals in plan.ops.ops
        if op not in ("D", "H", "A")
    ]


def batch(*events: object, skipped: list[SkippedEvent] | None = None) -> EventBatch:
    return EventBatch(1.0, list(events), 0, skipped or [], "map")  # type: ignore[arg-type]


def test_ops_follow_event_order_and_merge_runs() -> None:
    plan = plan_ops(
        batch(
            stored([1, 2]),
            stored([3]),
            BlockRemoved([1], medium="GPU"),
            AllBlocksCleared(),
            stored([4]),
        )
    )
    assert writes(plan) == [
        ("S", "l1", [1, 2, 3]),
        ("R", "l1", [1]),
        ("C", "l1", []),
        ("S", "l1", [4]),
    ]
    assert plan.outcomes[("BlockStored", "l1")] == 3
    assert plan.hash_updates["l1"] == 5


def test_duplicate_store_is_two_ops_not_a_set() -> None:
    plan = plan_ops(batch(stored([7]), stored([7]), BlockRemoved([7])))
    assert writes(plan) == [("S", "l1", [7, 7]), ("R", "l1", [7])]


@pytest.mark.parametrize(
    ("medium", "tier"),
    [
        ("GPU", "l1"),
        (None, "l1"),
        ("gpu", "l1"),
        ("CPU", "l2"),
        ("cpu", "l2"),
        ("STORAGE", "l2"),
        ("LMCACHE_DISK", "l2"),
    ],
)
def test_medium_policy(medium: str | None, tier: str) -> None:
    assert tier_for_medium(medium) == tier
    plan = plan_ops(batch(stored([5], medium=medium), BlockRemoved([6], medium=medium)))
    assert writes(plan) == [("S", tier, [5]), ("R", tier, [6])]
    assert sum(plan.other_media.values()) == (0 if tier == "l1" else 2)


@pytest.mark.parametrize(
    ("group", "kind"),
    [
        (None, None),
        (0, None),
        (0, "full_attention"),
        (0, "mla_attention"),
        (1, "full_attention"),
        (0, "sliding_window"),
        (0, "mamba"),
        (3, "sink_full_attention"),
        (None, "chunked_local_attention"),
        (2, None),
        (5, "unknown"),
    ],
)
def test_every_group_is_indexed_in_its_own_set(group: int | None, kind: str | None) -> None:
    plan = plan_ops(
        batch(
            stored(
                [9],
                group_idx=group,
                kv_cache_spec_kind=kind,
                kv_cache_spec_sliding_window=64 if kind == "sliding_window" else None,
            )
        )
    )
    g = group or 0
    assert writes(plan) == ([("S", "l1", [9])] if g == 0 else [("S", "l1", g, [9])])
    assert plan.ops.ops[0] == ("D", "", g, [kind or "-", 4, 64 if kind == "sliding_window" else ""])
    assert plan.outcomes[("BlockStored", "l1")] == 1


def test_removes_go_to_their_group_and_negative_groups_are_skipped() -> None:
    plan = plan_ops(
        batch(
            BlockRemoved([9], medium="GPU", group_idx=1),
            BlockRemoved([8], medium="GPU", group_idx=-1),
        )
    )
    assert writes(plan) == [("R", "l1", 1, [9])]
    assert plan.outcomes[("BlockRemoved", "l1")] == 1
    assert plan.outcomes[("BlockRemoved", "skipped:bad_group")] == 1


def test_sparse_stores_are_applied_and_described_once_per_batch() -> None:
    """A sliding-window group's store lists only the kept blocks (or none) over its whole
    token span; each group's descriptor goes once per batch, the settings once after them."""
    swa = {
        "group_idx": 0,
        "kv_cache_spec_kind": "sliding_window",
        "kv_cache_spec_sliding_window": 64,
    }
    plan = plan_ops(
        batch(
            stored([], token_ids=list(range(12)), **swa),
            stored([3, 4], token_ids=list(range(16)), **swa),
            stored([1, 2, 3, 4], group_idx=2, kv_cache_spec_kind="full_attention"),
        ),
        GroupSettings(16, 0, 2),
    )
    assert writes(plan) == [("S", "l1", [3, 4]), ("S", "l1", 2, [1, 2, 3, 4])]
    assert [op for op in plan.ops.ops if op[0] in ("D", "H")] == [
        ("D", "", 0, ["sliding_window", 4, 64]),
        ("D", "", 2, ["full_attention", 4, ""]),
        ("H", "", 0, [16, 0, 2]),
    ]
    assert plan.outcomes[("BlockStored", "l1")] == 3


def lookahead_ops(plan: Plan) -> list[tuple[object, ...]]:
    return [op for op in plan.ops.ops if op[0] == "A"]


def test_the_lookahead_is_learned_from_gpu_stores_once_per_batch() -> None:
    """L = len(lookahead_token_ids[0]) of the batch's last GPU store that shows one; a store
    without the field says L = 0 (vLLM < 0.33 or no EAGLE/MTP); other media and batches
    without a GPU store say nothing (a connector may leave the field out)."""
    two = stored([1, 2], lookahead_token_ids=[[5, 6], [7, 8]])
    assert lookahead_ops(plan_ops(batch(two))) == [("A", "", 0, [2])]
    assert lookahead_ops(plan_ops(batch(stored([1])))) == [("A", "", 0, [0])]
    one = stored([3], lookahead_token_ids=[[9]])
    assert lookahead_ops(plan_ops(batch(two, one))) == [("A", "", 0, [1])]
    cpu = stored([4], medium="CPU", lookahead_token_ids=None)
    assert lookahead_ops(plan_ops(batch(two, cpu))) == [("A", "", 0, [2])]
    assert lookahead_ops(plan_ops(batch(cpu, BlockRemoved([1], medium="GPU")))) == []
    empty = stored([], token_ids=[], lookahead_token_ids=[])
    assert lookahead_ops(plan_ops(batch(empty))) == []
    placeholder = stored([5], token_ids=[], block_size=0, lookahead_token_ids=None)
    assert lookahead_ops(plan_ops(batch(placeholder))) == []
    assert writes(plan_ops(batch(two, stored([9])))) == [("S", "l1", [1, 2, 9])]


def test_placeholder_stores_are_not_indexed_but_real_ones_after_them_are() -> None:
    plan = plan_ops(batch(stored([1], medium="CPU", token_ids=[], block_size=0), stored([2])))
    assert writes(plan) == [("S", "l1", [2])]
    assert plan.outcomes[("BlockStored", "placeholder")] == 1


def test_bytes_hashes_are_keyed_by_their_last_8_bytes() -> None:
    digest = bytes(range(32))
    plan = plan_ops(batch(stored([digest])))
    assert writes(plan) == [("S", "l1", [int.from_bytes(digest[-8:], "big")])]


def test_skipped_events_are_counted_and_do_not_stop_the_rest() -> None:
    # A real payload with an unknown event between two good ones (both encodings).
    for version in ((0, 23, 0), (0, 28, 0)):
        good = encode_batch(
            [stored([1]), stored([2])], ts=1.0, data_parallel_rank=0, vllm_version=version
        )
        decoded = decode_batch(good.replace(b"BlockStored", b"BlockStorex", 1))
        plan = plan_ops(decoded)
        assert writes(plan) == [("S", "l1", [2])]
        assert plan.outcomes[("unknown", "skipped:unknown_type")] == 1


def test_classify_sequences() -> None:
    assert classify(Cursor(None), 57) == Verdict.APPLY  # joining: start wherever the stream is
    c = Cursor(applied=10)
    assert classify(c, 11) == Verdict.APPLY
    assert classify(c, 13) == Verdict.GAP
    assert classify(c, 3) == Verdict.RESTART  # nothing this session covered seq 3: vLLM restarted
    c.covered_from, c.live_max = 5, None
    assert classify(c, 7) == Verdict.DUPLICATE  # applied by this session's replay
    c.live_max = 8
    assert classify(c, 8) == Verdict.RESTART  # the live stream itself went backwards
    assert classify(c, 9) == Verdict.DUPLICATE


def test_restart_expects_zero_and_resets_once() -> None:
    c = Cursor(applied=40, live_max=40, covered_from=1)
    c.mark_restart()
    assert c.expected() == 0 and c.reset_pending and c.live_max is None
    assert classify(c, 0) == Verdict.APPLY and classify(c, 3) == Verdict.GAP
    c.mark_applied(0)
    assert not c.reset_pending and c.covered_from == 0


def test_plan_run_orders_drops_duplicates_and_flags_gaps() -> None:
    steps, dropped = plan_run(4, [(9, b"l"), (5, b"a"), (3, b"x"), (6, b"b"), (6, b"b2")])
    assert [(s.seq, s.gap_before) for s in steps] == [(5, False), (6, False), (9, True)]
    assert dropped == 2
    steps, _ = plan_run(None, [(12, b"a"), (13, b"b")])
    assert [(s.seq, s.gap_before) for s in steps] == [(12, False), (13, False)]
    steps, _ = plan_run(4, [(8, b"a")])  # replay started later than asked for
    assert steps[0].gap_before


def test_frame_parsing() -> None:
    assert parse_live([b"kv-events", (5).to_bytes(8, "big"), b"p"]) == (5, b"p")
    assert parse_live([b"kv-events", b"\x00" * 7, b"p"]) is None
    assert parse_live([b"p"]) is None
    seq = (2).to_bytes(8, "big")
    end = END_SEQ.to_bytes(8, "big")
    assert parse_reply([b"", b"kv-events", seq, b"p"]) == (2, b"p")  # vLLM >= 0.26
    assert parse_reply([b"", seq, b"p"]) == (2, b"p")  # vLLM < 0.26
    assert parse_reply([b"", b"", end, b""]) is None
    assert parse_reply([b"", end, b""]) is None
    with pytest.raises(DecodeError):
        parse_reply([b"x", seq, b"p"])


def test_rank_endpoints() -> None:
    assert rank_endpoint("tcp://10.0.0.5:5557", 0) == "tcp://10.0.0.5:5557"
    assert rank_endpoint("tcp://10.0.0.5:5557", 1) == "tcp://10.0.0.5:5558"
    assert rank_endpoint("inproc://kv", 2) == "inproc://kv_dp2"
    assert rank_endpoint("inproc://kv", 0) == "inproc://kv"  # rank 0 is the endpoint itself
    assert rank_endpoint("", 1) == ""


# -- boundaries found by the mutation pass (docs/testing.md) ------------------------------


def test_classify_boundaries() -> None:
    cursor = Cursor(applied=5, covered_from=3)
    assert classify(cursor, 6) == Verdict.APPLY
    assert classify(cursor, 7) == Verdict.GAP, "one missing batch is a gap"
    assert classify(cursor, 5) == Verdict.DUPLICATE, "the last applied one again"
    assert classify(cursor, 3) == Verdict.DUPLICATE, "the first this session applied"
    assert classify(cursor, 2) == Verdict.RESTART, "below what this session applied"
    assert classify(Cursor(applied=5, live_max=9, covered_from=3), 5) == Verdict.RESTART
    assert classify(Cursor(), 0) == Verdict.APPLY and classify(Cursor(), 1000) == Verdict.APPLY


def test_cursor_bookkeeping() -> None:
    cursor = Cursor()
    assert cursor.expected() is None
    cursor.mark_restart()
    assert (cursor.applied, cursor.reset_pending, cursor.expected()) == (-1, True, 0)
    cursor.mark_applied(0)
    assert (cursor.applied, cursor.reset_pending, cursor.covered_from) == (0, False, 0)
    cursor.mark_applied(4)
    assert (cursor.applied, cursor.covered_from, cursor.expected()) == (4, 0, 5)


def test_plan_run_orders_by_sequence_and_keeps_the_first_copy() -> None:
    steps, dropped = plan_run(None, [(3, b"c"), (1, b"z"), (1, b"a"), (2, b"b")])
    assert [(s.seq, s.payload, s.gap_before) for s in steps] == [
        (1, b"z", False),
        (2, b"b", False),
        (3, b"c", False),
    ]
    assert dropped == 1
    steps, dropped = plan_run(4, [(9, b"a"), (4, b"x"), (6, b"b")])
    assert [(s.seq, s.payload, s.gap_before) for s in steps] == [(6, b"b", True), (9, b"a", True)]
    assert dropped == 1


def test_outcome_labels_and_media_counts() -> None:
    from common.events import SkippedEvent
    from services.l1_ingest.apply import medium_label

    assert [medium_label(m) for m in ("cpu", "CPU", "Disk", None, "", "NVME", "GPU")] == [
        "CPU",
        "CPU",
        "DISK",
        "other",
        "other",
        "other",
        "GPU",
    ]
    skips = [SkippedEvent(1, "malformed", "x"), SkippedEvent(2, "malformed", "y")]
    plan = plan_ops(
        batch(
            AllBlocksCleared(),
            BlockRemoved([1], medium="GPU"),
            stored([2], medium="cpu"),
            stored([3], medium="nvme"),
            BlockRemoved([4], medium="weird"),
            skipped=skips,
        )
    )
    assert plan.outcomes == {
        ("AllBlocksCleared", "l1"): 1,
        ("BlockRemoved", "l1"): 1,
        ("BlockStored", "l2"): 2,
        ("BlockRemoved", "l2"): 1,
        ("unknown", "skipped:malformed"): 2,
    }
    assert plan.other_media == {"CPU": 1, "other": 2}


def test_only_an_event_without_tokens_and_block_size_is_a_placeholder() -> None:
    plan = plan_ops(
        batch(
            stored([1], token_ids=[], block_size=0),
            stored([2], token_ids=[], block_size=4),
            stored([3], token_ids=[1, 2, 3, 4], block_size=0),
        )
    )
    assert plan.outcomes == {("BlockStored", "placeholder"): 1, ("BlockStored", "l1"): 2}
    assert writes(plan) == [("S", "l1", [2, 3])]
