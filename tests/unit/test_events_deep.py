"""The KV-event decoder's route for payloads nested deeper than msgspec's recursion limit
(``common.events._decode_deep``; vLLM never sends one, a fuzzer or a broken peer may), found
unpinned by mutation testing (issue 33): the whole batch comes back as on the fast route —
timestamp, rank, events, skipped events with reason and detail, form — whether the deep
nesting is met while decoding the whole batch or after a bad event sent it event by event.
"""

from __future__ import annotations

import msgpack
import pytest

from common.errors import NotABatchError
from common.event_types import AllBlocksCleared, BlockStored, SkippedEvent
from common.events import decode_batch

DEEP = b"\x91" * 1000 + b"\x01"  # [[[...[1]...]]]: deeper than Python's recursion limit


def _deep_stored_map() -> bytes:
    """A map-form BlockStored whose extra_keys nest DEEP."""
    return (
        b"\x85\xa4type\xabBlockStored"
        + msgpack.packb("block_hashes")
        + b"\x91\x07"
        + msgpack.packb("token_ids")
        + b"\x92\x01\x02"
        + msgpack.packb("block_size")
        + b"\x02"
        + msgpack.packb("extra_keys")
        + b"\x91"
        + DEEP
    )


def _batch(
    events: list[bytes], ts: bytes = b"\xcb?\xf8\x00\x00\x00\x00\x00\x00", rank: int = 3
) -> bytes:
    """``[ts, [events...], rank]`` with ``ts`` 1.5 (a msgpack float64)."""
    return b"\x93" + ts + bytes([0x90 + len(events)]) + b"".join(events) + msgpack.packb(rank)


def test_a_deep_batch_decodes_whole() -> None:
    batch = decode_batch(_batch([_deep_stored_map(), msgpack.packb(["AllBlocksCleared"])]))
    assert (batch.ts, batch.data_parallel_rank, batch.form, batch.skipped) == (1.5, 3, "map", [])
    stored, cleared = batch.events
    assert isinstance(stored, BlockStored) and stored.extra_keys is not None
    assert (stored.block_hashes, stored.token_ids, stored.block_size) == ([7], [1, 2], 2)
    assert cleared == AllBlocksCleared()


@pytest.mark.parametrize(
    ("bad", "reason", "detail", "form"),
    [
        (msgpack.packb(5), "not_an_event", "event is int 5, not an array or map", "map"),
        (
            msgpack.packb(["BlockMoved", [1]]),
            "unknown_type",
            "unknown event type str 'BlockMoved'",
            "array",
        ),
        (
            msgpack.packb("x" * 24),
            "not_an_event",
            "event is str 'xxxxxxxxxxxxxxxxxxxxxxxx', not an array or map",
            "map",
        ),
        (
            msgpack.packb("x" * 25),
            "not_an_event",
            "event is str of length 25, not an array or map",
            "map",
        ),
        (msgpack.packb(["BlockStored", 1, None, [1], 16]), "malformed", "BlockStored: ", "array"),
    ],
)
def test_a_bad_event_beside_a_deep_one_is_skipped_and_named(
    bad: bytes, reason: str, detail: str, form: str
) -> None:
    """The bad event sends the batch event by event, where the deep one is then met."""
    batch = decode_batch(_batch([bad, _deep_stored_map()], rank=0))
    assert (batch.ts, batch.data_parallel_rank, batch.form) == (1.5, 0, form)
    (stored,) = batch.events
    assert isinstance(stored, BlockStored) and stored.block_hashes == [7]
    (skipped,) = batch.skipped
    assert isinstance(skipped, SkippedEvent) and (skipped.index, skipped.reason) == (0, reason)
    assert skipped.detail.startswith(detail), skipped.detail


def test_a_bad_event_nested_too_deep_to_show_is_skipped_and_named() -> None:
    """The second event is an array whose first element (the tag) nests DEEP: it is skipped
    and named, not a RecursionError out of the decoder (it was, until issue 33)."""
    batch = decode_batch(_batch([msgpack.packb(5), b"\x91" + DEEP]))
    assert (batch.events, batch.form) == ([], "array")
    assert [(s.index, s.reason) for s in batch.skipped] == [
        (0, "not_an_event"),
        (1, "unknown_type"),
    ]
    assert batch.skipped[1].detail == "unknown event type list nested too deep to show"


def test_a_batch_of_no_array_and_no_map_is_empty_in_form() -> None:
    batch = decode_batch(_batch([msgpack.packb(5), msgpack.packb("x")]))
    assert (batch.events, batch.form) == ([], "empty")


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        # deep events, then a rank that is no int: refused once msgpack has read it all
        (b"\x93\xcb?\xf8" + b"\x00" * 6 + b"\x91" + DEEP + msgpack.packb("r"), "not a batch: "),
        # deeper than msgpack's own stack (1,024 levels)
        (b"\x93\xcb?\xf8" + b"\x00" * 6 + b"\x91" + b"\x91" * 3000 + b"\x01\x00", "not msgpack: "),
    ],
)
def test_a_deep_payload_that_is_no_batch_is_refused_as_such(payload: bytes, message: str) -> None:
    with pytest.raises(NotABatchError) as err:
        decode_batch(payload)
    assert err.value.reason == "not_a_batch" and str(err.value).startswith(message), err.value
