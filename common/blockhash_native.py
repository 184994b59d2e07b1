"""The C block chain of vLLM's ``sha256_cbor`` (``common/_cbor_blocks.c``), loaded with ctypes.

The library is plain C (no Python API), built by ``pip install`` as an optional extension:
it needs a C compiler, not Python's headers. :data:`ENCODER` is None when it was not built
(no compiler at install time, or a checkout used without installing); :mod:`common.blockhash`
then encodes with numpy (:mod:`common.blockhash_cbor`), bit for bit the same and slower
(docs/design.md, "Block hashing"). :func:`status` says which one a process uses; the API logs
it at start-up.

:class:`Encoder` wraps the library's three functions: :meth:`Encoder.chain` encodes and
hashes a prompt's whole chain in one call, with the SHA-256 functions of the libcrypto
hashlib uses (found by :func:`_openssl_sha256`, checked against hashlib at load; without
them :attr:`Encoder.sha` is None and only the preimages come from C, hashed by hashlib in
:meth:`BlockHasher._native_chain`); :meth:`Encoder.member_keys` writes the decimal Redis
members. The preimage layout is described once, in the C file's header.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import itertools
import os
import struct
from array import array
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

LIBRARY = "common._cbor_blocks"
DISABLE_ENV = "CACHE_INDEXER_NO_NATIVE_HASH"
"""Set (to anything but "" or "0") to use the numpy encoder even where the library is built."""
PARENT_AT = 3  # the parent digest's offset in a preimage: after 0x83 0x58 0x20
_HEAD_MAX = 3 + 32 + 9 + 8  # prefix, parent, the longest array head; 8: C's slack
_SHA_CTX_BYTES = 256  # >= sizeof(SHA256_CTX), 112 bytes in OpenSSL 1.1 and 3.x
_ARGS = struct.Struct("=17Q")  # struct chain_args of _cbor_blocks.c, in native byte order
IdWords = array | npt.NDArray[np.uint64]  # type: ignore[type-arg]


def _block_cap(block_size: int, first_tail: bytes, tail: bytes) -> int:
    """Bytes one block's preimage can take: the head, the longer tail, 9 per id at most."""
    return _HEAD_MAX + max(len(first_tail), len(tail)) + 9 * block_size


class Encoder:
    """``ci_block_preimages`` and, when hashlib's libcrypto exports SHA256_Init/Update/Final,
    ``ci_block_chain`` of one loaded library."""

    def __init__(self, path: str) -> None:
        self.path = path
        lib = ctypes.CDLL(path)
        size, ptr, text = ctypes.c_size_t, ctypes.c_void_p, ctypes.c_char_p
        func = lib.ci_block_preimages
        func.argtypes = [ptr, size, size, text, size, text, size, ptr, size, ptr]
        func.restype = size
        self._preimages = func
        self._chain = lib.ci_block_chain  # one argument, a ctypes buffer: no argtypes needed
        self._chain.restype = ctypes.c_int
        self._keys = lib.ci_decimal_keys
        self._keys.argtypes = [text, size, ptr]
        self._keys.restype = size
        abi = getattr(lib, "ci_abi_version", None)
        self.block_tails = abi is not None and abi() >= 2
        """Whether :meth:`chain` takes every block's own tail (a library built from an older
        ``_cbor_blocks.c`` would ignore them: then the caller must not pass any)."""
        self.sha: tuple[int, int, int] | None = None
        self.sha_source = ""
        found = _openssl_sha256()
        if found is not None:
            self.sha, self.sha_source = found
            if not self._chain_agrees():
                self.sha, self.sha_source = None, f"{self.sha_source} disagreed with hashlib"
            elif self.block_tails and not self._tails_agree():
                self.block_tails = False

    def chain(
        self,
        ids: IdWords,
        block_size: int,
        first_tail: bytes,
        tail: bytes,
        parent: bytes,
        tails: Sequence[bytes] | None = None,
    ) -> bytes:
        """The 32-byte digests of every full block of ``ids``, back to back, chained from
        ``parent``, in one C call (only when :attr:`sha` is set). ``ids`` is an
        ``array("Q")`` or a C-contiguous native uint64 numpy array. Block 0 ends with
        ``first_tail`` and every other with ``tail``, or block ``i`` with ``tails[i]`` when
        given (one per block; only where :attr:`block_tails`)."""
        if self.sha is None:
            raise RuntimeError("no SHA-256 functions for the C chain")
        blocks = len(ids) // block_size
        if not blocks:
            return b""
        if not isinstance(ids, array):
            ids = np.ascontiguousarray(ids, np.uint64)  # kept in ``ids`` until the call ends
        address = ids.buffer_info()[0] if isinstance(ids, array) else ids.ctypes.data
        own, ends = b"", array("Q")
        if tails is not None:
            if not self.block_tails or len(tails) != blocks:
                raise RuntimeError("per-block tails need ABI 2 and one tail per block")
            own = b"".join(tails)
            ends = array("Q", itertools.accumulate(map(len, tails)))
            first_tail = max(tails, key=len)  # only sizes the scratch block
        work, at_ends, at_digests = self._work(address, blocks, block_size, first_tail, tail, own)
        base = ctypes.addressof(work)
        header = parent + first_tail + tail + own
        struct.pack_into(f"{len(header)}s", work, _ARGS.size, header)
        if own:
            ctypes.memmove(base + at_ends, ends.buffer_info()[0], 8 * blocks)
        if self._chain(work) != 0:
            raise RuntimeError("the C block chain failed (SHA-256 call or buffer size)")
        return ctypes.string_at(base + at_digests, 32 * blocks)

    def _work(
        self, address: int, blocks: int, block_size: int, first_tail: bytes, tail: bytes, own: bytes
    ) -> tuple[ctypes.Array[ctypes.c_char], int, int]:
        """The C call's one buffer, its packed arguments written: the arguments, the parent,
        the tails, each block's tail end, the digests, the SHA-256 context, the block being
        hashed (fields 8-byte aligned); with the offsets of the tail ends and the digests."""
        assert self.sha is not None
        cap = _block_cap(block_size, first_tail, tail)
        at_tails = _ARGS.size + 32
        at_own = at_tails + len(first_tail) + len(tail)
        at_ends = at_own + len(own) + 7 & ~7
        at_digests = at_ends + (8 * blocks if own else 0)
        at_ctx = at_digests + 32 * blocks
        at_scratch = at_ctx + _SHA_CTX_BYTES
        work = ctypes.create_string_buffer(at_scratch + cap)
        base = ctypes.addressof(work)
        _ARGS.pack_into(
            work,
            0,
            address,
            blocks,
            block_size,
            base + at_tails,
            len(first_tail),
            base + at_tails + len(first_tail),
            len(tail),
            base + _ARGS.size,
            base + at_digests,
            base + at_scratch,
            cap,
            base + at_ctx,
            *self.sha,
            base + at_own if own else 0,
            base + at_ends if own else 0,
        )
        return work, at_ends, at_digests

    def member_keys(self, digests: bytes) -> list[bytes]:
        """The Redis member of every 32-byte digest in ``digests``: the uint64 of its last 8
        bytes, big-endian, in ASCII decimal (what :meth:`BlockHasher.member_keys` returns)."""
        count = len(digests) // 32
        if not count:
            return []
        out = ctypes.create_string_buffer(21 * count)
        written = self._keys(digests, count, ctypes.addressof(out))
        return ctypes.string_at(ctypes.addressof(out), written).split()

    def _chain_agrees(self) -> bool:
        """The C chain against preimages hashed by hashlib, on ids of every CBOR width."""
        ids = np.array(
            [0, 23, 24, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**64 - 1] * 3 + [151_935] * 2,
            np.uint64,
        )
        parent = hashlib.sha256(b"self-test").digest()
        for block_size, first, rest in ((4, b"\xf6", b"\xf6"), (1, b"\x81\x61a", b"\xf6")):
            try:
                got = self.chain(ids, block_size, first, rest, parent)
            except RuntimeError:
                return False
            buffer, ends = self.preimages(ids, block_size, first, rest)
            want, start, link = b"", 0, parent
            for end in ends:
                buffer[start + PARENT_AT : start + PARENT_AT + 32] = link
                link = hashlib.sha256(buffer[start:end]).digest()
                want, start = want + link, end
            if got != want:
                return False
        return True

    def _tails_agree(self) -> bool:
        """The chain with every block's own tail against hashlib, block by block."""
        ids = np.arange(1000, 1032, dtype=np.uint64)
        tails = [b"\xf6", b"\x81\x61a", b"\x82\xf6\x05", b"\x81\x25"] * 2
        link = hashlib.sha256(b"self-test").digest()
        try:
            got = self.chain(ids, 4, b"", b"", link, tails)
        except RuntimeError:
            return False
        want = b""
        for b, tail in enumerate(tails):
            buffer, ends = self.preimages(ids[4 * b : 4 * b + 4], 4, tail, tail)
            buffer[PARENT_AT : PARENT_AT + 32] = link
            link = hashlib.sha256(buffer[: ends[0]]).digest()
            want += link
        return got == want

    def preimages(
        self, ids: npt.NDArray[np.uint64], block_size: int, first_tail: bytes, tail: bytes
    ) -> tuple[bytearray, list[int]]:
        """Every block's preimage, parents zeroed, in one buffer, and each block's end offset.
        ``ids`` is a C-contiguous native uint64 array of a whole number of blocks (any value:
        the C code writes 9-byte ints too); ``first_tail`` ends block 0, ``tail`` the rest."""
        blocks = len(ids) // block_size
        if not blocks:
            return bytearray(), []
        ids = np.ascontiguousarray(ids, np.uint64)
        cap = blocks * _block_cap(block_size, first_tail, tail)
        out = bytearray(cap)
        ends = array("Q", bytes(8 * blocks))
        buffer = (ctypes.c_char * cap).from_buffer(out)
        written = self._preimages(
            ids.ctypes.data,
            blocks,
            block_size,
            first_tail,
            len(first_tail),
            tail,
            len(tail),
            ctypes.addressof(buffer),
            cap,
            ends.buffer_info()[0],
        )
        del buffer  # releases the export, so ``out`` may be resized
        if written == 0:  # cannot happen: cap is the worst case
            raise RuntimeError("the C block encoder ran out of room")
        return out, ends.tolist()


def _openssl_sha256() -> tuple[tuple[int, int, int], str] | None:
    """Addresses of SHA256_Init/Update/Final in the libcrypto hashlib is linked against (the
    same build: same code, same CPU dispatch), and its path; None if not found."""
    try:
        import _hashlib  # noqa: F401  (maps libcrypto into the process)

        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            paths = {line.split(None, 5)[-1].strip() for line in maps if "libcrypto" in line}
    except (ImportError, OSError):
        return None
    for path in sorted(p for p in paths if p.startswith("/")):
        try:
            lib = ctypes.CDLL(path)
            funcs = (lib.SHA256_Init, lib.SHA256_Update, lib.SHA256_Final)
        except (OSError, AttributeError):
            continue
        addresses = tuple(ctypes.cast(f, ctypes.c_void_p).value or 0 for f in funcs)
        if all(addresses):
            return (addresses[0], addresses[1], addresses[2]), path
    return None


def _load() -> Encoder | None:
    if os.environ.get(DISABLE_ENV, "") not in ("", "0"):
        return None
    spec = importlib.util.find_spec(LIBRARY)
    if spec is None or not spec.origin:
        return None
    try:
        return Encoder(spec.origin)
    except (OSError, AttributeError):  # unloadable, or not our library
        return None


ENCODER: Encoder | None = _load()


def status() -> str:
    """One line for logs: which CBOR encoder this process hashes with."""
    if ENCODER is not None and ENCODER.sha is not None:
        return (
            f"block hashing: C encoder and chain ({ENCODER.path}, SHA-256 of {ENCODER.sha_source})"
        )
    if ENCODER is not None:
        why = ENCODER.sha_source or "no libcrypto with SHA256_Init found"
        return f"block hashing: C encoder, SHA-256 by hashlib per block ({ENCODER.path}; {why})"
    if os.environ.get(DISABLE_ENV, "") not in ("", "0"):
        return f"block hashing: numpy encoder ({DISABLE_ENV} is set)"
    return (
        "block hashing: numpy encoder (the C encoder common/_cbor_blocks was not built: "
        "install with a C compiler present, e.g. `pip install -e .`)"
    )
