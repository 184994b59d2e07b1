"""Token ids and extra keys to the bytes vLLM hashes, for :mod:`common.blockhash`; pure.

vLLM serializes a block as ``cbor2.dumps((parent, tuple(tokens), extra_keys),
canonical=True)``. For these shapes (bytes, unsigned ints, str, tuples, None) canonical CBOR
only means shortest-form heads and definite-length arrays, so this hand-rolled encoder
produces cbor2's bytes (the tests compare them) at a fraction of the cost.

Token ids are encoded a chunk of blocks at a time with numpy, with no per-id Python step
and no look-up table: every id becomes one uint64 whose big-endian bytes *end* with its
CBOR encoding (the head byte ``0x18``/``0x19``/``0x1a`` OR-ed in just above the id's 1, 2 or
4 bytes; an id < 24 is its own head), and one ``np.compress`` with a byte mask keeps those
last 1, 2, 3 or 5 bytes of each. The caller slices the result per block. Ids >= 2**32
(possible only before vLLM 0.34, and in no real vocabulary) and prompts shorter than
``NUMPY_FROM`` ids (where numpy's cost per call outweighs its cost per id) take a plain
per-id path.

Token ids are validated here too: an id is anything ``operator.index`` accepts (int, bool,
numpy ints; not 1.0) with ``0 <= id < limit``; anything else raises ValueError.
"""

from __future__ import annotations

import operator
from array import array
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

PREIMAGE_HEAD = b"\x83\x58\x20"  # array(3), then bytes(32): the parent digest
NULL = b"\xf6"
U64 = npt.NDArray[np.uint64]


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


def _mask_word(width: int) -> int:
    """The uint64 whose in-memory bytes are 0 but for ``width`` trailing 1s."""
    return int(np.frombuffer(bytes(8 - width) + b"\x01" * width, np.uint64)[0])


# By an id's encoding's length (1 for ids < 24, 2 for < 2**8, 3 for < 2**16, 5 for < 2**32):
# the head bits OR-ed into the id and the mask word selecting its encoding.
_HEAD_BITS = np.array([0, 0, 0x18 << 8, 0x19 << 16, 0, 0x1A << 32], np.uint64)
_MASKS = np.array([0] + [_mask_word(length) for length in range(1, 6)], np.uint64)
# ids >= each edge: 0 gives the head byte, 24 and 256 one byte more, 2**16 two more
_LENGTH_EDGES = np.array([0, 24, 1 << 8, 1 << 16, 1 << 16], np.uint64)
ITEM_IDS_BELOW = 1 << 32  # encode_blocks' ids; larger ones need 9 bytes
NUMPY_FROM = 64  # fewer ids are encoded one by one (measured: numpy wins from ~50 ids)


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


def id_array(tokens: Sequence[int], limit: int) -> tuple[U64, int]:
    """The ids as a uint64 array and the largest id (0 if none); ValueError (naming the first
    bad id) if one is not a token id below ``limit``."""
    if isinstance(tokens, array) and tokens.typecode == "Q":  # converted by the API already
        ids = np.frombuffer(tokens, np.uint64) if len(tokens) else np.zeros(0, np.uint64)
        largest = int(ids.max()) if len(ids) else 0
        if largest < limit:
            return ids, largest
    elif isinstance(tokens, np.ndarray) and tokens.dtype.kind in "iu" and tokens.ndim == 1:
        if len(tokens) == 0:
            return np.zeros(0, np.uint64), 0
        if int(tokens.min()) >= 0 and (largest := int(tokens.max())) < limit:
            return tokens.astype(np.uint64), largest
    else:
        try:
            buffer = array("Q", tokens)  # C-speed: ints >= 0 only
            ids = np.frombuffer(buffer, np.uint64)
            # (a short prompt's max is faster in Python than numpy's call overhead)
            largest = max(buffer, default=0) if len(ids) < NUMPY_FROM else int(ids.max())
            if largest < limit:
                return ids, largest
        except (TypeError, OverflowError):
            pass
    ids = np.array(plain_ids(tokens, limit), np.uint64)
    return ids, int(ids.max()) if len(ids) else 0


def id_words(tokens: Sequence[int], limit: int) -> array[int] | U64:
    """All the ids as one machine array for the C chain (``array("Q")``; a uint64 numpy
    array when given numpy ids); ValueError (naming the first bad id) if one is not a token
    id below ``limit``. An ``array("Q")`` (the API's, already converted) is used as is."""
    if isinstance(tokens, np.ndarray):
        return id_array(tokens, limit)[0]
    if isinstance(tokens, array) and tokens.typecode == "Q":
        words = tokens
    else:
        try:
            words = array("Q", tokens)  # C-speed: ints >= 0 only
        except (TypeError, OverflowError):
            words = array("Q", plain_ids(tokens, limit))  # raises, naming the bad id
    if limit < 1 << 64 and words and int(np.frombuffer(words, np.uint64).max()) >= limit:
        plain_ids(tokens, limit)  # raises, naming the first bad id
    return words


def encode_blocks(ids: U64, block_size: int) -> tuple[bytes, list[int]]:
    """The CBOR encodings of ``ids`` (all < ``ITEM_IDS_BELOW``; a whole number of blocks)
    back to back, and the end offset of every block's encodings in them."""
    if len(ids) < NUMPY_FROM:
        return encode_blocks_per_id(ids, block_size)
    length = np.searchsorted(_LENGTH_EDGES, ids, side="right")  # of each id's encoding
    items = _HEAD_BITS.take(length)
    items |= ids
    items.byteswap(inplace=True)  # big-endian in memory: each encoding is the item's last bytes
    data = items.view(np.uint8).compress(_MASKS.take(length).view(np.bool_))
    ends = length.cumsum()[block_size - 1 :: block_size]
    return data.tobytes(), ends.tolist()


_UINT8 = [bytes((i,)) for i in range(24)] + [bytes((0x18, i)) for i in range(24, 256)]


def _uint(value: int) -> bytes:
    """Canonical CBOR of an unsigned int (``head(0, value)``, faster)."""
    if value < 256:
        return _UINT8[value]
    if value < 1 << 16:
        return b"\x19" + value.to_bytes(2, "big")
    if value < 1 << 32:
        return b"\x1a" + value.to_bytes(4, "big")
    return b"\x1b" + value.to_bytes(8, "big")


def encode_uints(values: Sequence[int]) -> list[bytes]:
    """Canonical CBOR of each unsigned int in ``values``."""
    return list(map(_uint, values))


def encode_blocks_per_id(ids: U64, block_size: int) -> tuple[bytes, list[int]]:
    """:func:`encode_blocks` one id at a time, for ids of any size (up to 2**64 - 1) and for
    short prompts, where numpy's cost per call outweighs its cost per id."""
    encoded = list(map(_uint, ids.tolist()))
    ends, end = [], 0
    for start in range(0, len(ids), block_size):
        end += sum(map(len, encoded[start : start + block_size]))
        ends.append(end)
    return b"".join(encoded), ends
