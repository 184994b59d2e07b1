"""The KV-event structs' own checks (``common.event_types``), found unpinned by mutation
testing (issue 33): a block hash sent as bytes must be 16n bytes long (vLLM's sha256 digests,
or several concatenated), in ``block_hashes`` of both event types and in
``parent_block_hash``; ``extra_keys`` holds arrays and scalars only. Checked when an event is
built and when a batch is decoded (the event is then skipped as malformed, with the reason)."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest

from common.event_types import BlockRemoved, BlockStored
from common.events import decode_batch

D16, D32, D5, D17 = b"a" * 16, b"b" * 32, b"c" * 5, b"e" * 17


@pytest.mark.parametrize("hashes", [[D5], [1, D5], [D16, D5], [b"d" * 17]])
def test_a_block_hash_of_other_than_16n_bytes_is_refused(hashes: list[Any]) -> None:
    bad = next(h for h in hashes if isinstance(h, bytes) and len(h) % 16)
    message = f"a block hash of {len(bad)} bytes: expected 16n"
    with pytest.raises(ValueError, match=message):
        BlockStored(hashes, None, [1], 1)
    with pytest.raises(ValueError, match=message):
        BlockRemoved(hashes)


@pytest.mark.parametrize("hashes", [[D16], [D32], [1, D16, 2**63], [7]])
def test_ints_and_16n_byte_hashes_are_accepted(hashes: list[Any]) -> None:
    assert BlockStored(hashes, D16, [1], 1).block_hashes == hashes
    assert BlockRemoved(hashes).block_hashes == hashes


def test_the_parent_hash_is_checked_too() -> None:
    with pytest.raises(ValueError, match="a block hash of 5 bytes: expected 16n"):
        BlockStored([1], D5, [1], 1)
    assert BlockStored([1], D32, [1], 1).parent_block_hash == D32
    assert BlockStored([1], 5, [1], 1).parent_block_hash == 5


def test_extra_keys_hold_arrays_and_scalars_only() -> None:
    ok = [[1, ["lora", [2, [3.5]]]], None, []]
    assert BlockStored([1, 2, 3], None, [1], 1, extra_keys=ok).extra_keys == ok
    with pytest.raises(ValueError, match="extra_keys holds dict: expected arrays"):
        BlockStored([1], None, [1], 1, extra_keys=[[1, [{"a": 1}]]])


@pytest.mark.parametrize(
    "event",
    [
        ["BlockStored", [D17], None, [1], 1],
        ["BlockStored", [1], D17, [1], 1],
        ["BlockRemoved", [1, D17]],
    ],
)
def test_a_decoded_event_with_a_bad_digest_is_skipped_as_malformed(
    event: list[Any],
) -> None:
    good = ["BlockRemoved", [D16]]
    batch = decode_batch(msgpack.packb([1.0, [good, event, good], 0]))
    assert batch.events == [BlockRemoved([D16]), BlockRemoved([D16])]
    (skipped,) = batch.skipped
    assert (skipped.index, skipped.reason) == (1, "malformed")
    assert skipped.detail.endswith("a block hash of 17 bytes: expected 16n"), skipped.detail
