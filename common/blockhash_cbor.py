"""Token ids and extra keys to the bytes vLLM hashes, for :mod:`common.blockhash`; pure.

vLLM serializes a block as ``cbor2.dumps((parent, tuple(tokens), extra_keys),
canonical=True)``. For these shapes (bytes, unsigned ints, str, tuples, None) canonical CBOR
only means shortest-form heads and definite-length arrays, so this hand-rolled encoder
produces cbor2's bytes (the tests compare them) at a fraction of the cost: every id's
encoding is looked up in one C call (``operator.itemgetter`` over a table of ids < 2**18,
built on first use) instead of being encoded per call.

Token ids are validated here too: an id is anything ``operator.index`` accepts (int, bool,
numpy ints; not 1.0) with ``0 <= id < limit``; anything else raises ValueError.
"""

from __future__ import annotations

import functools
import operator
import struct
from array import array
from collections.abc import Sequence

TABLE_SIZE = 1 << 18  # every vocabulary up to 262,144 ids (Llama 3, Qwen 2.5, Gemma 3)
PREIMAGE_HEAD = b"\x83\x58\x20"  # array(3), then bytes(32): the parent digest
NULL = b"\xf6"


def head(major: int, value: int) -> bytes:
    """A canonical (shortest-form) CBOR head for major type ``major`` and argument value."""
    if value < 24:
        return bytes((major << 5 | value,))
    for info, width in ((24, 1), (25, 2), (26, 4), (27, 8)):
        if value < 1 << (8 * width):
            return bytes((major << 5 | info,)) + value.to_bytes(width, "big")
    raise ValueError(f"{value} does not fit in a CBOR head")


def encode(obj: object) -> bytes:
    """Canonical CBOR of the non-token shapes vLLM hashes: str, tuple, None, and (in extra
    keys taken from events) int, bytes and bool."""
    if obj is None:
        return NULL
    if isinstance(obj, bool):
        return b"\xf5" if obj else b"\xf4"
    if isinstance(obj, int):
        return head(0, obj) if obj >= 0 else head(1, -1 - obj)
    if isinstance(obj, bytes):
        return head(2, len(obj)) + obj
    if isinstance(obj, str):
        data = obj.encode("utf-8")  # a lone surrogate raises ValueError, as in cbor2
        return head(3, len(data)) + data
    if isinstance(obj, tuple):
        return head(4, len(obj)) + b"".join(map(encode, obj))
    raise ValueError(f"cannot hash {type(obj).__name__} extra key {obj!r}")


@functools.cache
def _token_table() -> list[bytes]:
    """CBOR unsigned-int encodings of ids 0..TABLE_SIZE-1 (~20 ms and ~16 MB, once)."""
    pack2, pack4 = struct.Struct(">BH").pack, struct.Struct(">BI").pack
    return (
        [bytes((i,)) for i in range(24)]
        + [bytes((0x18, i)) for i in range(24, 256)]
        + [pack2(0x19, i) for i in range(256, 1 << 16)]
        + [pack4(0x1A, i) for i in range(1 << 16, TABLE_SIZE)]
    )


def checked_id(value: object, limit: int) -> int:
    """``value`` as a plain int, or ValueError if it is not a token id below ``limit``."""
    try:
        token = int(operator.index(value))  # type: ignore[arg-type]
    except TypeError:
        raise ValueError(f"token id {value!r} is not an integer") from None
    if not 0 <= token < limit:
        bits = limit.bit_length() - 1
        raise ValueError(f"token id {token} is out of range: need 0 <= id < 2**{bits}")
    return token


def plain_ids(tokens: Sequence[int], limit: int) -> list[int]:
    """The ids as plain ints (pickle, unlike CBOR, tells True or numpy ints from int)."""
    try:
        ids = array("Q", tokens).tolist()  # C-speed: ints >= 0 only
        if not ids or max(ids) < limit:
            return ids
    except (TypeError, OverflowError):
        pass
    return [checked_id(value, limit) for value in tokens]


def encode_ids(tokens: Sequence[int], limit: int) -> Sequence[bytes]:
    """The CBOR encoding of every id, in order; ``limit`` bounds the ids (2**64 or 2**31)."""
    if len(tokens) == 0:  # not "not tokens": a numpy array has no truth value
        return ()
    try:
        # A C-speed check that every id is an int >= 0: a negative id would silently wrap
        # around the table. Non-ints and ids past the table fall through to the slow path.
        array("Q", tokens)
        encoded = operator.itemgetter(*tokens)(_token_table())
        return (encoded,) if len(tokens) == 1 else encoded
    except (TypeError, OverflowError, IndexError):
        pass
    table = _token_table()
    return [table[t] if t < TABLE_SIZE else head(0, t) for t in plain_ids(tokens, limit)]
