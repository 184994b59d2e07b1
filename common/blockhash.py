"""vLLM's prefix-cache block hashes, recomputed from token ids; pure, no I/O.

vLLM (spec §4) splits a request's tokens into full blocks of ``block_size`` tokens and
chains them::

    H[i] = sha256(serialize((H[i-1] or NONE_HASH, tuple(block_i_tokens), extra_keys_i)))

where ``serialize`` is ``cbor2.dumps(obj, canonical=True)`` for ``sha256_cbor`` and
``pickle.dumps(obj, protocol=HIGHEST_PROTOCOL)`` for ``sha256``, and
``NONE_HASH = sha256(serialize(PYTHONHASHSEED string))``. KV events carry the last 8 bytes of
each digest as an unsigned big-endian integer; the chain always uses all 32 bytes.

The CBOR path does not call cbor2: this runs on every API request. Where the C library
``common/_cbor_blocks`` is built (:mod:`common.blockhash_native`), one C call encodes every
block's preimage and hashes the chain with the libcrypto SHA-256 that hashlib uses; otherwise
:mod:`common.blockhash_cbor` encodes 8,192 ids at a time with numpy and this module joins and
hashes each block. Both produce cbor2's bytes (the tests keep cbor2 as the reference and run
on every path). The pickle path (``sha256``, vLLM's default) calls ``pickle.dumps`` exactly
as vLLM does, so it is only about as fast as vLLM.

Decisions (vLLM behaviour the index must mirror, or input we refuse):

- Only full blocks are hashed; the trailing partial block is still validated.
- A token id is anything ``operator.index`` accepts (int, bool as 0/1, numpy ints; not 1.0)
  with ``0 <= id < 2**64``; vLLM >= 0.34 keeps ids as int32, so there ``id < 2**31``.
  Anything else raises ValueError: vLLM would reject the request, so it has no cached blocks.
- extra keys (§4.4; spec vllm-extra-keys.md): :mod:`common.blockhash_extra` builds each
  block's LoRA, multimodal, salt and lookahead keys per release from a
  :class:`~common.blockhash_extra.HashInputs`. The C chain stays the path for every request:
  when blocks have keys of their own (items, lookahead) it takes each block's encoded keys
  (:func:`~common.blockhash_extra.block_tails`; a library too old for that leaves them to
  the Python chain, which splices each block's keys in). LoRA on 0.10.2-0.11.0
  (keyed by the server-assigned ``lora_int_id``) raises ValueError naming the release.
- PYTHONHASHSEED unset: vLLM < 0.29 draws a random NONE_HASH per process (ConfigError
  here); >= 0.29 uses the seed "vllm-none-hash". "" is a real seed: the empty string.
"""

from __future__ import annotations

import functools
import hashlib
import pickle
from collections.abc import Iterator, Sequence
from typing import cast

import numpy as np

from common import blockhash_cbor as cbor
from common import blockhash_extra as extras
from common import blockhash_native as native
from common.blockhash_extra import ExtraKeys as ExtraKeys
from common.blockhash_extra import HashInputs as HashInputs
from common.blockhash_extra import MmItem as MmItem
from common.blockhash_extra import tags_extra_keys as tags_extra_keys
from common.blockhash_settings import ALGOS as ALGOS
from common.blockhash_settings import DEFAULT_NONE_HASH_SEED as DEFAULT_NONE_HASH_SEED
from common.blockhash_settings import MIN_VLLM_VERSION as MIN_VLLM_VERSION
from common.blockhash_settings import HashSettings as HashSettings
from common.blockhash_settings import effective_seed as effective_seed
from common.blockhash_settings import none_hash as none_hash
from common.blockhash_settings import parse_vllm_version as parse_vllm_version
from common.blockhash_settings import seed_none_hash as seed_none_hash

_INT32_TOKENS_SINCE = (0, 34, 0)
_BIG_U64 = np.dtype(">u8")
_CHUNK_TOKENS = 8192  # ids encoded at a time (measured: 4k-16k are best)


def to_event_int(digest: bytes) -> int:
    """The integer a KV event carries for a block digest: its last 8 bytes, big-endian."""
    return int.from_bytes(digest[-8:], "big")


def chain_digests(
    algo: str,
    parent: bytes,
    token_ids: Sequence[int],
    block_size: int,
    extra_keys: Sequence[ExtraKeys],
) -> list[bytes]:
    """Digests of ``len(extra_keys)`` consecutive full blocks chained from ``parent``, each
    block with its own extra keys (as an event states them); for checking event hashes.
    Raises ValueError on a token id vLLM could not hash or too few tokens."""
    _check_block_size(block_size)
    if len(token_ids) < len(extra_keys) * block_size:
        raise ValueError("fewer tokens than blocks to hash")
    digests: list[bytes] = []
    for i, extra in enumerate(extra_keys):
        block = token_ids[i * block_size : (i + 1) * block_size]
        if algo == "sha256":
            ids = tuple(cbor.plain_ids(block, 1 << 64))
            preimage = pickle.dumps((parent, ids, extra), protocol=pickle.HIGHEST_PROTOCOL)
        else:
            ids_u64, _ = cbor.id_array(block, 1 << 64)
            body = cbor.encode_blocks_per_id(ids_u64, block_size)[0]
            preimage = b"".join(
                (cbor.PREIMAGE_HEAD, parent, cbor.head(4, block_size), body, cbor.encode(extra))
            )
        parent = hashlib.sha256(preimage).digest()
        digests.append(parent)
    return digests


class BlockHasher:
    """Block digests of token-id prompts for one deployment's HashSettings.

    Every method takes the request's ``cache_salt`` and either ``lora_name``/``lora_path``
    or ``inputs``, a :class:`~common.blockhash_extra.HashInputs` (LoRA, multimodal items,
    lookahead); ValueError on anything vLLM could not hash or we cannot reproduce."""

    def __init__(self, settings: HashSettings) -> None:
        self.settings = settings
        self._none_hash = none_hash(settings)
        self._token_limit = 1 << (31 if settings.vllm_version >= _INT32_TOKENS_SINCE else 64)

    def digests(
        self,
        token_ids: Sequence[int],
        block_size: int,
        cache_salt: str | None = None,
        lora_name: str | None = None,
        lora_path: str | None = None,
        *,
        inputs: HashInputs | None = None,
    ) -> list[bytes]:
        """The 32-byte digest of every hashed block, in order."""
        blob = self._digest_blob(
            token_ids, block_size, cache_salt, _inputs(lora_name, lora_path, inputs)
        )
        return [blob[i : i + 32] for i in range(0, len(blob), 32)]

    def event_ints(
        self,
        token_ids: Sequence[int],
        block_size: int,
        cache_salt: str | None = None,
        lora_name: str | None = None,
        lora_path: str | None = None,
        *,
        inputs: HashInputs | None = None,
    ) -> list[int]:
        """The block hashes as KV events carry them (uint64 of each digest's last 8 bytes)."""
        return _event_ints(
            self._digest_blob(
                token_ids, block_size, cache_salt, _inputs(lora_name, lora_path, inputs)
            )
        )

    def member_keys(
        self,
        token_ids: Sequence[int],
        block_size: int,
        cache_salt: str | None = None,
        lora_name: str | None = None,
        lora_path: str | None = None,
        *,
        inputs: HashInputs | None = None,
    ) -> list[bytes]:
        """The event ints as ASCII decimal bytes, the form stored in Redis sets."""
        blob = self._digest_blob(
            token_ids, block_size, cache_salt, _inputs(lora_name, lora_path, inputs)
        )
        if native.ENCODER is not None:
            return native.ENCODER.member_keys(blob)
        ints = _event_ints(blob)
        # One formatting call and one split: ~30 % faster than b"%d" % value per value.
        return ((b"%d " * len(ints)) % tuple(ints)).split()

    def preimages(
        self,
        token_ids: Sequence[int],
        block_size: int,
        cache_salt: str | None = None,
        lora_name: str | None = None,
        lora_path: str | None = None,
        *,
        inputs: HashInputs | None = None,
    ) -> list[bytes]:
        """The bytes that are hashed for every hashed block (the serialized parent, tokens
        and extra keys), built by the same loop as the Python chain; for tests and debugging."""
        hash_inputs = _inputs(lora_name, lora_path, inputs)
        _check_block_size(block_size)
        return self._chain(token_ids, block_size, cache_salt, hash_inputs, True)[1]

    def _digest_blob(
        self,
        token_ids: Sequence[int],
        block_size: int,
        cache_salt: str | None,
        inputs: HashInputs,
    ) -> bytes:
        """Every hashed block's digest, back to back: from one C call when it is there (no
        per-block objects for a plain or LoRA-only prompt; each block's encoded keys when
        they differ), else joined from :meth:`_chain`."""
        _check_block_size(block_size)
        encoder = native.ENCODER
        if encoder is None or encoder.sha is None or self.settings.algo != "sha256_cbor":
            return b"".join(self._chain(token_ids, block_size, cache_salt, inputs, False)[0])
        # every id is validated, those of the partial block too
        words = cbor.id_words(token_ids, self._token_limit)
        if cache_salt is None and inputs is extras.PLAIN:  # the common case: no extra keys
            return encoder.chain(words, block_size, cbor.NULL, cbor.NULL, self._none_hash)
        keys = self._plan(cast(Sequence[int], words), block_size, cache_salt, inputs)
        if keys.uniform:
            first, rest = cbor.encode(keys.first), cbor.encode(keys.rest)
            return encoder.chain(words, block_size, first, rest, self._none_hash)
        if not encoder.block_tails:  # a library built from an older _cbor_blocks.c
            return b"".join(self._chain(token_ids, block_size, cache_salt, inputs, False)[0])
        ids = _u64(words)[: keys.blocks * block_size]  # lookahead: the last may be left out
        return encoder.chain(ids, block_size, b"", b"", self._none_hash, extras.block_tails(keys))

    def _plan(
        self,
        ids: Sequence[int],
        block_size: int,
        cache_salt: str | None,
        inputs: HashInputs,
    ) -> extras.ExtraPlan:
        """Every block's extra keys; ``ids`` validated already."""
        if cache_salt is None and inputs is extras.PLAIN:  # the common case, first
            return extras.ExtraPlan(len(ids) // block_size, None, None, {})
        return extras.plan(self.settings.vllm_version, ids, block_size, cache_salt, inputs)

    def _chain(
        self,
        token_ids: Sequence[int],
        block_size: int,
        cache_salt: str | None,
        inputs: HashInputs,
        keep: bool,
    ) -> tuple[list[bytes], list[bytes]]:
        """(digests, preimages if ``keep`` else []) of every hashed block."""
        if self.settings.algo == "sha256":
            ids = cbor.plain_ids(token_ids, self._token_limit)
            keys = self._plan(ids, block_size, cache_salt, inputs)
            return self._pickle_chain(ids, block_size, keys, keep)
        if inputs.lookahead:  # the lookahead keys hold token ids: validate them first
            ids = cbor.plain_ids(token_ids, self._token_limit)
            keys = self._plan(ids, block_size, cache_salt, inputs)
        else:
            keys = self._plan(token_ids, block_size, cache_salt, inputs)
        return self._cbor_chain(token_ids, block_size, keys, keep)

    def _cbor_chain(
        self, token_ids: Sequence[int], block_size: int, keys: extras.ExtraPlan, keep: bool
    ) -> tuple[list[bytes], list[bytes]]:
        """sha256_cbor digests (and preimages if ``keep``) where the C chain is not used
        (:meth:`_digest_blob`): the C encoder with hashlib per block, else numpy with, per
        block, one slice, one join and one sha256 (``docs/design.md``, "Block hashing")."""
        encoder = native.ENCODER
        full = keys.blocks * block_size
        first_tail, tail = cbor.encode(keys.first), cbor.encode(keys.rest)
        tails = None if keys.uniform else extras.block_tails(keys)
        if encoder is not None and tails is None:
            return self._native_chain(encoder, token_ids, full, block_size, first_tail, tail, keep)
        sha256, join, head = hashlib.sha256, b"".join, cbor.PREIMAGE_HEAD
        array_head = _array_head(block_size)
        parent, index = self._none_hash, 0
        digests: list[bytes] = []
        preimages: list[bytes] = []
        append = digests.append
        for ids, largest in _id_chunks(token_ids, full, block_size, self._token_limit):
            per_id = largest >= cbor.ITEM_IDS_BELOW
            encode = cbor.encode_blocks_per_id if per_id else cbor.encode_blocks
            encoded, ends = encode(ids, block_size)
            start = 0
            for end in ends:
                if tails is not None:
                    block_tail = tails[index]
                else:
                    block_tail = first_tail if index == 0 else tail
                preimage = join((head, parent, array_head, encoded[start:end], block_tail))
                parent, start, index = sha256(preimage).digest(), end, index + 1
                append(parent)
                if keep:
                    preimages.append(preimage)
        return digests, preimages

    def _native_chain(
        self,
        encoder: native.Encoder,
        token_ids: Sequence[int],
        full: int,
        block_size: int,
        first_tail: bytes,
        tail: bytes,
        keep: bool,
    ) -> tuple[list[bytes], list[bytes]]:
        """:meth:`_cbor_chain` with the C encoder: it lays out every block's whole preimage,
        so per block Python only copies the parent digest in and hashes a memoryview."""
        sha256, at = hashlib.sha256, native.PARENT_AT
        parent, block_tail = self._none_hash, first_tail
        digests: list[bytes] = []
        preimages: list[bytes] = []
        append = digests.append
        for ids, _ in _id_chunks(token_ids, full, block_size, self._token_limit):
            buffer, ends = encoder.preimages(ids, block_size, block_tail, tail)
            block_tail = tail
            view, start = memoryview(buffer), 0
            for end in ends:
                view[start + at : start + at + 32] = parent
                parent = sha256(view[start:end]).digest()
                append(parent)
                if keep:
                    preimages.append(bytes(view[start:end]))
                start = end
        return digests, preimages

    def _pickle_chain(
        self, ids: list[int], block_size: int, keys: extras.ExtraPlan, keep: bool
    ) -> tuple[list[bytes], list[bytes]]:
        """vLLM's ``sha256`` algo: pickle.dumps of the same tuple, exactly as vLLM calls it."""
        parent = self._none_hash
        digests: list[bytes] = []
        preimages: list[bytes] = []
        for index in range(keys.blocks):
            start = index * block_size
            block = (parent, tuple(ids[start : start + block_size]), keys.keys(index))
            preimage = pickle.dumps(block, protocol=pickle.HIGHEST_PROTOCOL)
            parent = hashlib.sha256(preimage).digest()
            digests.append(parent)
            if keep:
                preimages.append(preimage)
        return digests, preimages


def _inputs(lora_name: str | None, lora_path: str | None, inputs: HashInputs | None) -> HashInputs:
    """One HashInputs from the LoRA arguments or ``inputs`` (not both)."""
    if inputs is None:
        if lora_name is None and lora_path is None:
            return extras.PLAIN
        return HashInputs(lora_name=lora_name, lora_path=lora_path)
    if lora_name is not None or lora_path is not None:
        raise ValueError("give the LoRA in inputs or as lora_name/lora_path, not both")
    return extras.PLAIN if inputs.plain else inputs


def _u64(words: native.IdWords) -> cbor.U64:
    if isinstance(words, np.ndarray):
        return words
    return np.frombuffer(words, np.uint64) if len(words) else np.zeros(0, np.uint64)


@functools.lru_cache(maxsize=64)
def _array_head(block_size: int) -> bytes:
    return cbor.head(4, block_size)


def _id_chunks(
    token_ids: Sequence[int], full: int, block_size: int, limit: int
) -> Iterator[tuple[cbor.U64, int]]:
    """The ids of the full blocks as uint64 arrays (:func:`cbor.id_array`), a whole number of
    blocks at a time: each chunk's arrays stay in the CPU cache, and memory stays bounded
    however long the prompt. Every id is validated, those of the partial block too."""
    step = max(block_size, _CHUNK_TOKENS - _CHUNK_TOKENS % block_size)
    if len(token_ids) <= step:  # one conversion, the partial block included
        ids, largest = cbor.id_array(token_ids, limit)
        if full:
            yield ids[:full], largest
        return
    cbor.id_array(token_ids[full:], limit)  # the partial block: checked, not hashed
    for chunk in range(0, full, step):
        yield cbor.id_array(token_ids[chunk : min(chunk + step, full)], limit)


def _event_ints(blob: bytes) -> list[int]:
    """uint64 of the last 8 bytes of every 32-byte digest in ``blob``, big-endian (the form
    KV events carry)."""
    if not blob:
        return []
    return np.frombuffer(blob, _BIG_U64)[3::4].tolist()  # type: ignore[no-any-return]


def _check_block_size(block_size: int) -> None:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size must be a positive integer, not {block_size!r}")
