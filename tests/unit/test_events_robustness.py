"""common.events on hostile input: tolerated variations, skipped events, garbage, fuzzing.

The contract: decode_batch returns a batch whose dataclasses hold exactly the declared types,
or raises NotABatchError; no other exception ever escapes.
"""

from __future__ import annotations

import contextlib
import copy
import random
from typing import Any

import msgpack
import msgspec
import pytest

from common.errors import DecodeError, NotABatchError
from common.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    decode_batch,
    encode_batch,
    hash_to_int,
)
from tests.unit.vllm_golden import golden_payloads, zmq_payloads

SEEDS = [c.payload for c in golden_payloads()] + [p for _, _, p, _ in zmq_payloads()]
MIXED = next(c.payload for c in golden_payloads() if c.label == "mixed_batch")


def _batch(*events: Any, rank: Any = 0, extra: tuple[Any, ...] = ()) -> bytes:
    return bytes(msgpack.packb([1.0, list(events), rank, *extra]))


GOOD_MAP = {"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU"}
GOOD_ARRAY = ["BlockStored", [2], 1, [5, 6], 2, None, "GPU"]
GOOD = [BlockRemoved([1], "GPU"), BlockStored([2], 1, [5, 6], 2, None, "GPU")]


def test_tolerated_variations() -> None:
    unknown_keys: dict[Any, Any] = {**GOOD_MAP, "remaining_copy_counts": [1], 7: "int key"}
    trailing = [*GOOD_ARRAY, None, None, None, None, None, None, None, None, None, "future", 1]
    batch = decode_batch(_batch(unknown_keys, trailing, extra=(b"p" * 16, "heartbeat")))
    assert batch.events == GOOD and batch.skipped == [] and batch.data_parallel_rank == 0
    minimal = decode_batch(
        bytes(
            msgpack.packb(
                [
                    3,
                    [
                        ["BlockStored", [1], None, [], 0],
                        ["BlockRemoved", [b"\x01" * 16]],
                        {
                            "type": "BlockStored",
                            "block_hashes": [],
                            "token_ids": [],
                            "block_size": 0,
                        },
                    ],
                ]
            )
        )
    )
    assert minimal.ts == 3.0 and isinstance(minimal.ts, float)
    assert minimal.data_parallel_rank is None and minimal.form == "array"
    assert minimal.events == [
        BlockStored([1], None, [], 0),
        BlockRemoved([b"\x01" * 16]),
        BlockStored([], None, [], 0),
    ]
    for payload in (bytearray(MIXED), memoryview(MIXED)):
        assert len(decode_batch(payload).events) == 3  # type: ignore[arg-type]
    assert decode_batch(_batch()).form == "empty"
    assert decode_batch(_batch(["AllBlocksCleared", 1, 2])).events == [AllBlocksCleared()]


def test_map16_headers_and_deep_extra_keys_are_accepted() -> None:
    fields = {"block_hashes": [1], "token_ids": [1], "block_size": 1}
    event = b"\xde\x00\x04" + msgpack.packb("type") + msgpack.packb("BlockStored")
    event += b"".join(msgpack.packb(k) + msgpack.packb(v) for k, v in fields.items())
    payload = b"\x93\xcb" + b"\x00" * 8 + b"\xdc\x00\x01" + event + b"\xc0"
    assert decode_batch(payload).events == [BlockStored([1], None, [1], 1)]
    deep = b"\x91" * 1000 + b"\x01"  # deeper than Python's recursion limit
    event = (
        b"\x85\xa4type\xabBlockStored"
        + msgpack.packb("block_hashes")
        + b"\x91\x01"
        + msgpack.packb("token_ids")
        + b"\x90"
        + msgpack.packb("block_size")
        + b"\x00"
        + msgpack.packb("extra_keys")
        + b"\x91"
        + deep
    )
    (stored,) = decode_batch(b"\x92\xcb" + b"\x00" * 8 + b"\x91" + event).events
    assert isinstance(stored, BlockStored) and stored.extra_keys is not None


MALFORMED = [
    (5, "not_an_event"),
    ("BlockStored", "not_an_event"),
    (None, "not_an_event"),
    (b"\x00", "not_an_event"),
    ([], "unknown_type"),
    ([1, [1]], "unknown_type"),
    (["BlockMoved", [1]], "unknown_type"),
    ({"block_hashes": [1]}, "unknown_type"),
    ({"type": ["BlockStored"]}, "unknown_type"),
    ({"type": "blockstored"}, "unknown_type"),
    (["BlockStored", 1, None, [1], 16], "malformed"),
    (["BlockStored", [1], None, [1, "x"], 16], "malformed"),
    (["BlockStored", [1], None, [True], 16], "malformed"),
    (["BlockStored", [1], None, (1, 2), 16.0], "malformed"),
    (["BlockStored", [-1], None, [1], 16], "malformed"),
    (["BlockStored", [1.0], None, [1], 16], "malformed"),
    (["BlockStored", [b"short"], None, [1], 16], "malformed"),
    (["BlockStored", [b""], None, [1], 16], "malformed"),
    (["BlockStored", [1], "abc", [1], 16], "malformed"),
    (["BlockStored", [1], -5, [1], 16], "malformed"),
    (["BlockStored", [1], None, [1], -1], "malformed"),
    (["BlockStored", [1], None, [1], True], "malformed"),
    (["BlockStored", [1], None, [1], None], "malformed"),
    (["BlockStored", [1], None, [1], 16, "1"], "malformed"),
    (["BlockStored", [1], None, [1], 16, None, 5], "malformed"),
    (["BlockStored", [1], None, [1], 16, None, None, None, "x"], "malformed"),
    (["BlockStored", [1], None, [1], 16, None, None, None, [5]], "malformed"),
    (["BlockStored", [1], None, [1], 16, None, None, None, [[{"a": 1}]]], "malformed"),
    (["BlockStored", [1], None, [1], 16, None, None, None, None, 1.5], "malformed"),
    (["BlockStored", [1], None, [1], 16, None, None, None, None, None, None, False], "malformed"),
    (
        {
            "type": "BlockStored",
            "block_hashes": [1],
            "token_ids": [1],
            "block_size": 1,
            "lookahead_token_ids": [[1, "a"]],
        },
        "malformed",
    ),
    (
        {
            "type": "BlockStored",
            "block_hashes": [1],
            "token_ids": [1],
            "block_size": 1,
            "session_id": 7,
        },
        "malformed",
    ),
    (
        {
            "type": "BlockStored",
            "block_hashes": [1, 2],
            "token_ids": [1, 2],
            "block_size": 1,
            "lookahead_token_ids": [[3], [4, 5]],
        },
        "malformed",
    ),
    (["BlockStored", [1, 2], None, [1, 2], 1, *[None] * 10, [[3, 4], [5]]], "malformed"),
    (["BlockStored", [1], None, [1], 1, *[None] * 10, [3]], "malformed"),
    (["BlockStored", [1], None, [1], 1, *[None] * 10, [list(range(65))]], "malformed"),
    (["BlockStored", [1], None, [1], 1, *[None] * 10, [[-1.5]]], "malformed"),
    ({"type": "BlockStored", "block_hashes": [1], "token_ids": [1]}, "malformed"),
    (
        {
            "type": "BlockStored",
            "block_hashes": [1],
            "token_ids": msgpack.Timestamp(1, 0),
            "block_size": 1,
        },
        "malformed",
    ),
    (["BlockStored", [1], None, [1]], "malformed"),
    (["BlockRemoved"], "malformed"),
    ({"type": "BlockRemoved"}, "malformed"),
    ({"type": "BlockRemoved", "block_hashes": [msgpack.ExtType(1, b"x")]}, "malformed"),
    (  # msgpack's ExtType is a tuple: the slow path must not take it for an array
        {
            "type": "BlockStored",
            "block_hashes": [1],
            "token_ids": [1],
            "block_size": 1,
            "extra_keys": [None, msgpack.ExtType(3, b"x")],
        },
        "malformed",
    ),
    ({"type": "BlockRemoved", "block_hashes": [1], "group_idx": "0"}, "malformed"),
    ({"type": "BlockRemoved", "block_hashes": [1], "ownership": b"me"}, "malformed"),
]


@pytest.mark.parametrize("bad,reason", MALFORMED, ids=[str(i) for i in range(len(MALFORMED))])
def test_a_bad_event_is_skipped_and_its_neighbours_kept(bad: Any, reason: str) -> None:
    batch = decode_batch(_batch(GOOD_MAP, bad, GOOD_ARRAY))
    assert batch.events == GOOD
    assert [(s.index, s.reason) for s in batch.skipped] == [(1, reason)]
    assert 0 < len(batch.skipped[0].detail) < 200


GARBAGE = [
    b"",
    b"\xc1",
    msgpack.packb(5),
    msgpack.packb([]),
    msgpack.packb([1.0]),
    msgpack.packb({"ts": 1.0, "events": []}),
    msgpack.packb("text"),
    msgpack.packb(None),
    msgpack.packb(["1.0", [], 0]),
    msgpack.packb([True, [], 0]),
    msgpack.packb([None, [], 0]),
    msgpack.packb([1.0, {}, 0]),
    msgpack.packb([1.0, "events", 0]),
    msgpack.packb([1.0, None]),
    msgpack.packb([1.0, [], "0"]),
    msgpack.packb([1.0, [], -1]),
    msgpack.packb([1.0, [], True]),
    msgpack.packb([1.0, [], 0.0]),
    msgpack.packb([msgpack.Timestamp(0, 0), [], 0]),
    b"\x93\xcb" + b"\x00" * 8 + b"\x91\x81\xa4type\xa2\xff\xfe\x00",  # invalid UTF-8
    b"\x91" * 5000,  # nested too deep for msgpack
    b"\xdd\xff\xff\xff\xff",  # array32 header claiming 4G elements
    MIXED + b"\x00",  # trailing bytes after the batch
]


@pytest.mark.parametrize("payload", GARBAGE, ids=[str(i) for i in range(len(GARBAGE))])
def test_garbage_is_not_a_batch(payload: bytes) -> None:
    with pytest.raises(NotABatchError) as info:
        decode_batch(payload)
    assert info.value.reason == "not_a_batch"


def test_every_truncation_of_a_real_payload_is_not_a_batch() -> None:
    for seed in (MIXED, SEEDS[-1]):
        for end in range(len(seed)):
            with pytest.raises(NotABatchError):
                decode_batch(seed[:end])


def test_non_bytes_payload_is_not_a_batch() -> None:
    with pytest.raises(NotABatchError):
        decode_batch("93")  # type: ignore[arg-type]


def _assert_trustworthy(batch: EventBatch, payload: bytes) -> None:
    """Everything downstream relies on: exact types, consistent counts and indexes."""
    # Counted as the decoder reads them: what msgspec ignores (an unknown key, a trailing
    # element) it skips unread, so invalid UTF-8 there does not sink the batch.
    raw_events = msgspec.msgpack.decode(
        msgspec.msgpack.decode(payload, type=list[msgspec.Raw])[1], type=list[msgspec.Raw]
    )
    assert len(batch.events) + len(batch.skipped) == len(raw_events)
    assert type(batch.ts) is float and batch.form in ("array", "map", "empty")
    assert batch.data_parallel_rank is None or type(batch.data_parallel_rank) is int
    assert [s.index for s in batch.skipped] == sorted({s.index for s in batch.skipped})
    assert {s.reason for s in batch.skipped} <= {"not_an_event", "unknown_type", "malformed"}
    for e in batch.events:
        if isinstance(e, BlockStored | BlockRemoved):
            assert all(type(hash_to_int(h)) is int for h in e.block_hashes)
            assert e.medium is None or type(e.medium) is str
            assert e.group_idx is None or type(e.group_idx) is int
        if isinstance(e, BlockStored):
            assert e.parent_block_hash is None or hash_to_int(e.parent_block_hash) >= 0
            assert all(type(t) is int for t in e.token_ids)
            assert type(e.block_size) is int and e.block_size >= 0
            assert e.lora_id is None or type(e.lora_id) is int
            assert e.extra_keys is None or all(k is None or type(k) is list for k in e.extra_keys)
            strs = (e.lora_name, e.kv_cache_spec_kind, e.locality, e.session_id)
            assert all(s is None or type(s) is str for s in strs)
            look = e.lookahead_token_ids
            assert look is None or all(type(t) is int for ts in look for t in ts)


POOL: list[Any] = [
    None,
    -1,
    0,
    1,
    2**64 - 1,
    -(2**63),
    1.5,
    True,
    "x",
    "",
    b"",
    b"\x00" * 32,
    b"\x00" * 5,
    [],
    [1],
    [1, "a"],
    [[1]],
    [None],
    {},
    {"type": "BlockStored"},
    msgpack.ExtType(3, b"x"),
    msgpack.Timestamp(0, 0),
]


def _pick(rng: random.Random) -> Any:
    return copy.deepcopy(rng.choice(POOL))  # the mutator edits containers in place


def _mutate_structure(rng: random.Random, raw: list[Any]) -> None:
    """Replace, add or delete one value at a random depth of the decoded batch."""
    target: Any = raw
    for _ in range(rng.randrange(5)):  # random walk down into containers
        children = list(target.values() if isinstance(target, dict) else target)
        children = [c for c in children if isinstance(c, list | dict) and c]
        if not children:
            break
        target = rng.choice(children)
    if isinstance(target, dict):
        key = rng.choice([*target, "extra", "type"])
        if rng.random() < 0.2:
            target.pop(key, None)
        else:
            target[key] = _pick(rng)
    else:
        i = rng.randrange(len(target) + 1)
        if i == len(target):
            target.append(_pick(rng))
        elif rng.random() < 0.2:
            del target[i]
        else:
            target[i] = _pick(rng)


def _mutate_bytes(rng: random.Random, data: bytearray) -> bytes:
    op, i = rng.randrange(5), rng.randrange(len(data))
    if op == 0:
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] = rng.randrange(256)
    elif op == 1:
        del data[i:]
    elif op == 2:
        del data[i : i + rng.randint(1, 8)]
    elif op == 3:
        data[i:i] = rng.randbytes(rng.randint(1, 8))
    else:
        other = rng.choice(SEEDS)
        data[i:] = other[rng.randrange(len(other)) :]
    return bytes(data)


def test_fuzz_only_decode_errors_escape() -> None:
    rng = random.Random(20261202)
    outcomes = {"ok": 0, "skips": 0, "not_a_batch": 0}
    for round_ in range(20000):
        if round_ % 2:
            payload = _mutate_bytes(rng, bytearray(rng.choice(SEEDS)))
        else:
            raw = msgpack.unpackb(rng.choice(SEEDS), strict_map_key=False)
            for _ in range(rng.randint(1, 3)):
                _mutate_structure(rng, raw)
            payload = msgpack.packb(raw)
        _count_decoded(payload, outcomes)
    assert min(outcomes.values()) > 1000, outcomes  # every path was exercised


def _count_decoded(payload: bytes, outcomes: dict[str, int]) -> None:
    """Decode ``payload``; check a decoded batch is trustworthy; count the outcome."""
    try:
        batch = decode_batch(payload)
    except DecodeError:
        outcomes["not_a_batch"] += 1
        return
    _assert_trustworthy(batch, payload)
    outcomes["skips" if batch.skipped else "ok"] += 1


def test_random_bytes_never_raise_anything_but_decode_error() -> None:
    """Random bytes (almost) never decode; decoding payloads are checked by
    test_random_batches_that_decode_are_trustworthy and the fuzz test above."""
    rng = random.Random(7)
    for _ in range(2000):
        payload = rng.randbytes(rng.randint(0, 64))
        with contextlib.suppress(DecodeError):
            _assert_trustworthy(decode_batch(payload), payload)


TEMPLATES: list[Any] = [
    GOOD_MAP,
    GOOD_ARRAY,
    ["AllBlocksCleared"],
    {"type": "AllBlocksCleared"},
    {
        "type": "BlockStored",
        "block_hashes": [b"\x01" * 32],
        "token_ids": [1],
        "block_size": 1,
        "parent_block_hash": None,
        "lora_id": None,
    },
]


def _random_event(rng: random.Random) -> Any:
    """A valid event (templates and the real payloads' events), often with one field
    replaced, added or dropped."""
    event = copy.deepcopy(rng.choice(TEMPLATES + SEED_EVENTS))
    if rng.random() < 0.6:
        _mutate_structure(rng, [event])
    return event


SEED_EVENTS: list[Any] = [e for p in SEEDS for e in msgpack.unpackb(p, strict_map_key=False)[1]]


def test_random_batches_that_decode_are_trustworthy() -> None:
    """Batch-shaped random payloads: most decode (with or without skipped events), and every
    one that decodes holds exactly the declared types."""
    rng = random.Random(11)
    outcomes = {"ok": 0, "skips": 0, "not_a_batch": 0}
    for _ in range(3000):
        batch_raw: list[Any] = [
            rng.choice([1.5, 0, 2**40, 1.0]),
            [_random_event(rng) for _ in range(rng.randrange(6))],
        ]
        if rng.random() < 0.8:
            batch_raw.append(rng.choice([0, 1, 7, None]))
        payload = bytes(msgpack.packb(batch_raw))
        _count_decoded(payload, outcomes)
    assert outcomes["ok"] > 500 and outcomes["skips"] > 500, outcomes


def test_encoded_batches_always_decode() -> None:
    extra_keys: list[Any] = [[b"digest", 3, ["m", 0]]]
    stored = BlockStored([b"\xaa" * 32], b"\xbb" * 64, [1], 1, extra_keys=extra_keys)
    for version in ((0, 10, 2), (0, 23, 0), (0, 24, 0), (0, 34, 0)):
        payload = encode_batch([stored] * 20, ts=0.0, data_parallel_rank=1, vllm_version=version)
        assert decode_batch(payload).events[-1].block_hashes == [b"\xaa" * 32]  # type: ignore[union-attr]


def test_unhashable_map_key_only_costs_its_own_event() -> None:
    """A map key that is itself an array or map must not sink the whole batch."""
    import msgpack

    from common.events import AllBlocksCleared, BlockRemoved, decode_batch

    good = {"type": "BlockRemoved", "block_hashes": [7], "medium": "GPU"}
    weird_key = {"type": "AllBlocksCleared", (1, 2): 3}  # an extra key we cannot name
    only_weird = {(1,): "BlockStored"}
    payload = msgpack.packb([1.5, [good, weird_key, only_weird, good], 0])
    batch = decode_batch(payload)
    assert batch.events == [BlockRemoved([7], "GPU"), AllBlocksCleared(), BlockRemoved([7], "GPU")]
    assert [s.index for s in batch.skipped] == [2]


def test_block_removed_array_with_every_field_and_future_fields() -> None:
    fields = [[5], "GPU", 0, "full_attention", "sess-1"]
    expected = BlockRemoved(*fields)  # type: ignore[arg-type]
    for trailing in ([], [None], ["future", 7, None]):
        batch = decode_batch(_batch(["BlockRemoved", *fields, *trailing]))
        assert batch.events == [expected] and batch.skipped == [], trailing


@pytest.mark.parametrize("form", ["array", "map"])
def test_lookahead_token_ids_decode_in_both_forms(form: str) -> None:
    """vLLM >= 0.33 appends ``lookahead_token_ids`` (the 15th field); one list per hash."""
    fields: dict[str, Any] = {
        "block_hashes": [1, 2],
        "parent_block_hash": None,
        "token_ids": [1, 2, 3, 4],
        "block_size": 2,
        "lookahead_token_ids": [[7, 8], [9, 10]],
    }
    if form == "map":
        event: Any = {"type": "BlockStored", **fields}
    else:
        event = ["BlockStored", [1, 2], None, [1, 2, 3, 4], 2, *[None] * 10, [[7, 8], [9, 10]]]
    batch = decode_batch(_batch(event))
    assert batch.skipped == [] and batch.form == form
    (stored,) = batch.events
    assert isinstance(stored, BlockStored) and stored.lookahead_token_ids == [[7, 8], [9, 10]]
    empty = decode_batch(_batch({"type": "BlockStored", **fields, "lookahead_token_ids": []}))
    assert empty.skipped == [] and empty.events[0].lookahead_token_ids == []  # type: ignore[union-attr]
