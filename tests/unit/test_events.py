"""common.events against vLLM's own payloads (golden file) and the per-version field tables."""

from __future__ import annotations

from typing import Any

import msgpack
import msgspec
import pytest

from common.errors import DecodeError
from common.event_types import REMOVED_FIELDS, STORED_FIELDS
from common.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    decode_batch,
    encode_batch,
    hash_to_int,
)
from tests.unit.vllm_golden import (
    VERSIONS,
    GoldenPayload,
    expected_event,
    golden,
    golden_payloads,
    zmq_payloads,
    zmq_replay_payloads,
)

GOLDEN = golden_payloads()


@pytest.mark.parametrize("case", GOLDEN, ids=[c.id for c in GOLDEN])
def test_golden_payload_decodes_to_the_stated_events(case: GoldenPayload) -> None:
    batch = decode_batch(case.payload)
    assert batch.events == [expected_event(e) for e in case.events]
    assert batch.skipped == []
    assert batch.ts == msgpack.unpackb(case.payload)[0]
    assert batch.data_parallel_rank == case.rank
    assert batch.form == ("map" if case.version == "0.28.0" else "array")


@pytest.mark.parametrize("case", GOLDEN, ids=[c.id for c in GOLDEN])
def test_encode_batch_reproduces_the_golden_payload(case: GoldenPayload) -> None:
    ts = msgpack.unpackb(case.payload)[0]
    events = [expected_event(e) for e in case.events]
    ours = encode_batch(
        events, ts=ts + 1, data_parallel_rank=case.rank, vllm_version=VERSIONS[case.version]
    )
    theirs_plain = msgpack.unpackb(case.payload, strict_map_key=False)
    ours_plain = msgpack.unpackb(ours, strict_map_key=False)
    assert ours_plain[1:] == theirs_plain[1:]
    for mine, vllms in zip(ours_plain[1], theirs_plain[1], strict=True):
        if isinstance(vllms, dict):  # key order: "type" first, then declaration order
            assert list(mine) == list(vllms)
    same_ts = encode_batch(
        events, ts=ts, data_parallel_rank=case.rank, vllm_version=VERSIONS[case.version]
    )
    assert same_ts == case.payload  # msgspec's choices reproduced byte for byte


def test_bytes_mode_hashes_map_to_the_int_mode_hashes() -> None:
    for version in VERSIONS:
        v = golden()["versions"][version]
        for ints, digests in zip(
            v["events_int_hashes"]["steps"], v["events_bytes_hashes"]["steps"], strict=True
        ):
            a = decode_batch(bytes.fromhex(ints["payload_hex"])).events
            b = decode_batch(bytes.fromhex(digests["payload_hex"])).events
            for x, y in zip(a, b, strict=True):
                if isinstance(x, BlockStored | BlockRemoved):
                    assert isinstance(y, BlockStored | BlockRemoved)
                    assert x.block_hashes == [hash_to_int(h) for h in y.block_hashes]
                    assert all(isinstance(h, bytes) and len(h) == 32 for h in y.block_hashes)


@pytest.mark.parametrize(
    "name,seq,payload,plain", zmq_payloads(), ids=[f"{n}-{s}" for n, s, _, _ in zmq_payloads()]
)
def test_zmq_capture_live_frames(name: str, seq: int, payload: bytes, plain: list[Any]) -> None:
    batch = decode_batch(payload)
    assert (batch.ts, batch.data_parallel_rank) == (plain[0], plain[2])
    assert batch.data_parallel_rank == (1 if name == "topic_empty_dp1" else 0)
    assert [type(e).__name__ for e in batch.events] == [e["type"] for e in plain[1]]
    for event, raw in zip(batch.events, plain[1], strict=True):
        assert {k: getattr(event, k) for k in raw if k != "type"} == {
            k: v for k, v in raw.items() if k != "type"
        }


def test_zmq_capture_replayed_payloads_equal_the_live_ones() -> None:
    live = {(name, seq): payload for name, seq, payload, _ in zmq_payloads()}
    replayed = zmq_replay_payloads()
    assert len(replayed) == 9
    for name, seq, payload in replayed:
        assert decode_batch(payload) == decode_batch(live[name, seq])


def test_dataclasses_declare_the_wire_field_order() -> None:
    assert [f.name for f in msgspec.structs.fields(BlockStored)] == [n for n, _, _ in STORED_FIELDS]
    assert [f.name for f in msgspec.structs.fields(BlockRemoved)] == [
        n for n, _, _ in REMOVED_FIELDS
    ]


# -- per-version layout ---------------------------------------------------------------

FULL_STORED = BlockStored(
    block_hashes=[2**64 - 1, 7],
    parent_block_hash=2**63,
    token_ids=[1, 2, 3, 4],
    block_size=2,
    lora_id=3,
    medium="GPU",
    lora_name="sql-lora",
    extra_keys=[["sql-lora", "salt"], None],
    group_idx=1,
    kv_cache_spec_kind="sliding_window",
    kv_cache_spec_sliding_window=128,
    locality="LOCAL",
    ownership="owner",
    session_id="sess-1",
    lookahead_token_ids=[[5, 6]],
)
FULL_REMOVED = BlockRemoved(
    block_hashes=[9], medium="CPU", group_idx=2, locality="REMOTE", ownership="shared"
)
# Spec §2.3: number of declared fields (BlockStored, BlockRemoved) per release.
FIELD_COUNTS = {
    (0, 10, 2): (6, 2),
    (0, 14, 0): (7, 2),
    (0, 17, 0): (8, 2),
    (0, 20, 0): (9, 3),
    (0, 22, 0): (11, 3),
    (0, 23, 0): (11, 3),
    (0, 24, 0): (11, 3),
    (0, 26, 0): (12, 4),
    (0, 29, 0): (13, 5),
    (0, 30, 0): (14, 5),
    (0, 33, 0): (15, 5),
    (0, 34, 0): (15, 5),
}


def _truncated(event: Event, n_fields: int) -> Event:
    """``event`` with the fields a release does not declare reset to None."""
    names = [f.name for f in msgspec.structs.fields(event)][n_fields:]
    reset: Any = msgspec.structs.replace
    return reset(event, **dict.fromkeys(names))  # type: ignore[no-any-return]


@pytest.mark.parametrize("version", FIELD_COUNTS, ids=[".".join(map(str, v)) for v in FIELD_COUNTS])
def test_each_release_field_set_round_trips(version: tuple[int, int, int]) -> None:
    n_stored, n_removed = FIELD_COUNTS[version]
    events: list[Event] = [FULL_STORED, FULL_REMOVED, AllBlocksCleared()]
    payload = encode_batch(events, ts=1.5, data_parallel_rank=3, vllm_version=version)
    raw = msgpack.unpackb(payload, strict_map_key=False)
    assert len(raw) == 3 and raw[0] == 1.5 and raw[2] == 3
    stored, removed, cleared = raw[1]
    if version < (0, 24, 0):
        assert (len(stored), len(removed), cleared) == (
            1 + n_stored,
            1 + n_removed,
            ["AllBlocksCleared"],
        )
    else:  # every field is set, so every declared key is written
        names = [f.name for f in msgspec.structs.fields(BlockStored)]
        assert list(stored) == ["type", *names[:n_stored]]
        assert len(removed) == 1 + n_removed and cleared == {"type": "AllBlocksCleared"}
    batch = decode_batch(payload)
    assert batch.form == ("array" if version < (0, 24, 0) else "map")
    assert batch.events == [
        _truncated(FULL_STORED, n_stored),
        _truncated(FULL_REMOVED, n_removed),
        AllBlocksCleared(),
    ]


@pytest.mark.parametrize("version", [(0, 24, 0), (0, 30, 0), (0, 33, 0), (0, 34, 0)])
def test_map_form_omits_none_defaults_and_sizes_the_header_like_msgspec(
    version: tuple[int, int, int],
) -> None:
    sparse = BlockStored([1], None, [1, 2], 2, kv_cache_spec_kind="full_attention", group_idx=0)
    payload = encode_batch([sparse], ts=0.0, data_parallel_rank=0, vllm_version=version)
    (event,) = msgpack.unpackb(payload)[1]
    assert list(event) == [
        "type",
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "group_idx",
        "kv_cache_spec_kind",
    ]
    assert event["parent_block_hash"] is None and event["medium"] is None
    header = payload[11:14]  # after 93, cb + 8 bytes of ts, 91
    assert header == (b"\xde\x00\x0a" if version >= (0, 33, 0) else b"\x8a\xa4t")
    assert decode_batch(payload).events == [sparse]


def test_array_form_writes_nil_for_every_unset_field() -> None:
    payload = encode_batch(
        [BlockRemoved([1])], ts=0.0, data_parallel_rank=None, vllm_version=(0, 23, 0)
    )
    assert msgpack.unpackb(payload) == [0.0, [["BlockRemoved", [1], None, None]], None]


# -- hashes -------------------------------------------------------------------------------

UINT_EDGES = [
    0,
    1,
    127,
    128,
    255,
    256,
    65535,
    65536,
    2**32 - 1,
    2**32,
    2**63 - 1,
    2**63,
    2**64 - 2,
    2**64 - 1,
]


@pytest.mark.parametrize("version", [(0, 23, 0), (0, 28, 0)])
def test_hashes_at_every_msgpack_uint_width(version: tuple[int, int, int]) -> None:
    events: list[Event] = [BlockStored([h], h, [h], 16) for h in UINT_EDGES]
    events.append(BlockRemoved(list(UINT_EDGES)))
    batch = decode_batch(encode_batch(events, ts=0.0, data_parallel_rank=0, vllm_version=version))
    assert batch.events == events and batch.skipped == []
    assert [hash_to_int(e.block_hashes[0]) for e in batch.events[:-1]] == UINT_EDGES  # type: ignore[union-attr]


def test_non_shortest_and_signed_encodings_of_hashes_are_accepted() -> None:
    one_as_u64 = b"\xcf" + (1).to_bytes(8, "big")
    max_i64 = b"\xd3" + (2**63 - 1).to_bytes(8, "big")
    event = b"\x92\xacBlockRemoved\x92" + one_as_u64 + max_i64
    payload = b"\x93\xcb" + (b"\x00" * 8) + b"\x91" + event + b"\x00"
    assert decode_batch(payload).events == [BlockRemoved([1, 2**63 - 1])]


def test_hash_to_int() -> None:
    digest = bytes(range(32))
    assert hash_to_int(digest) == int.from_bytes(bytes(range(24, 32)), "big")
    assert hash_to_int(2**64 - 1) == 2**64 - 1
    assert hash_to_int(0) == 0
    for bad in (-1, 2**64, True):
        with pytest.raises(DecodeError):
            hash_to_int(bad)
