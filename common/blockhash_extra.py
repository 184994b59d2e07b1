"""The extra keys vLLM hashes with each block: LoRA, multimodal items, cache_salt and the
speculative-decoding lookahead tokens (spec vllm-extra-keys.md §2 and §5); pure, no I/O.

For block ``i`` = tokens ``[s, e)`` (``s = i*B``, ``e = s+B``) the extra keys are, in this
order: the LoRA key (every block), one key per multimodal item overlapping the block (in
offset order), the salt (block 0 only, when truthy). Per release:

====================  ==================  ========================  ==============================
key                   0.11.1 - 0.18       0.19 - 0.30               >= 0.31
====================  ==================  ========================  ==============================
LoRA                  ``name``            ``name``                  ``("lora", name, path)``
multimodal item       ``identifier``      ``(identifier, off-s)``   ``("mm", identifier, off-s)``
salt                  ``salt``            ``salt``                  ``("cache_salt", salt)``
====================  ==================  ========================  ==============================

The relative offset ``offset - s`` is negative in every block after an item's first; an item
only in the trailing partial block keys nothing. 0.10.2 - 0.11.0 key LoRA by the server's
``lora_int_id``: not derivable, so LoRA raises ValueError there.

**Lookahead** ``L > 0`` (vLLM >= 0.33 with EAGLE/EAGLE3/MTP): only blocks followed by ``L``
tokens are hashed (``max(N-L, 0) // B`` of them), the keys above are taken over the window
``[s, e+L)`` (an item starting in the lookahead has ``rel >= B``), and what is hashed is
always the tuple ``(E_i, *tokens[e:e+L])`` (``E_i`` None when empty).

The result is an :class:`ExtraPlan`: block 0's keys, the keys every other block shares, and
the blocks whose keys differ (those touching an item, every block with lookahead), so the
hasher can run the common keys through the C chain and splice in only the others.
"""

from __future__ import annotations

import operator
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from common import blockhash_cbor as cbor

ExtraKeys = tuple[object, ...] | None
Version = tuple[int, int, int]

MAX_MM_ITEMS = 1024
"""Multimodal items one request may carry (a documented limit: docs/api.md)."""
_LORA_NAME_SINCE = (0, 11, 1)
_MM_OFFSET_SINCE = (0, 19, 0)
_TAGGED_KEYS_SINCE = (0, 31, 0)
_LOOKAHEAD_SINCE = (0, 33, 0)
_MAX_LOOKAHEAD = 64


@dataclass(frozen=True)
class MmItem:
    """One multimodal item: the identifier vLLM hashes (``MultiModalFeatureSpec.identifier``)
    and its placeholder's token range ``[offset, offset + length)`` in the prompt."""

    identifier: str
    offset: int
    length: int


@dataclass(frozen=True)
class HashInputs:
    """A request's hash inputs beyond token ids and cache_salt. ``mm_items`` are kept sorted
    by offset with a stable sort, as vLLM's input processor orders them; construction raises
    ValueError (one sentence naming the item by its position as given) on an empty or
    non-string identifier, a negative offset, a length below 1, overlapping items, more
    than :data:`MAX_MM_ITEMS`, or a lookahead outside ``[0, 64]``."""

    lora_name: str | None = None
    lora_path: str | None = None
    mm_items: tuple[MmItem, ...] = ()
    lookahead: int = 0
    _order: tuple[int, ...] = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for label, value in (("lora_name", self.lora_name), ("lora_path", self.lora_path)):
            if value is not None and not isinstance(value, str):
                raise ValueError(f"{label} must be a string, not {type(value).__name__}")
        lookahead = self.lookahead
        if type(lookahead) is not int or not 0 <= lookahead <= _MAX_LOOKAHEAD:
            raise ValueError(f"lookahead must be an integer in [0, {_MAX_LOOKAHEAD}]")
        items = tuple(self.mm_items)
        if len(items) > MAX_MM_ITEMS:
            raise ValueError(
                f"mm_features has {len(items)} items, more than the limit of {MAX_MM_ITEMS}"
            )
        for i, item in enumerate(items):
            _check_item(i, item)
        order = sorted(range(len(items)), key=lambda i: items[i].offset)  # stable, as vLLM
        for before, after in zip(order, order[1:], strict=False):
            if items[after].offset < items[before].offset + items[before].length:
                raise ValueError(f"mm_features[{after}] overlaps mm_features[{before}]")
        object.__setattr__(self, "mm_items", tuple(items[i] for i in order))
        object.__setattr__(self, "_order", tuple(order))

    @property
    def plain(self) -> bool:
        """No LoRA, no items, no lookahead: the hasher's fast path."""
        return not (self.lora_name or self.lora_path or self.mm_items or self.lookahead)

    def check_prompt(self, n_tokens: int) -> None:
        """ValueError if an item reaches past the prompt's ``n_tokens`` tokens."""
        for position, item in zip(self._order, self.mm_items, strict=True):
            if item.offset + item.length > n_tokens:
                raise ValueError(
                    f"mm_features[{position}] covers tokens [{item.offset}, "
                    f"{item.offset + item.length}), outside the prompt of {n_tokens} tokens"
                )


def _check_item(i: int, item: object) -> None:
    if not isinstance(item, MmItem):
        raise ValueError(f"mm_features[{i}] must be an MmItem, not {type(item).__name__}")
    if not isinstance(item.identifier, str) or not item.identifier:
        raise ValueError(f"mm_features[{i}].identifier must be a non-empty string")
    for label, value, least in (("offset", item.offset, 0), ("length", item.length, 1)):
        if type(value) is not int or value < least:
            raise ValueError(f"mm_features[{i}].{label} must be an integer >= {least}")


PLAIN = HashInputs()


@dataclass(frozen=True)
class ExtraPlan:
    """Every hashed block's extra keys ``E``: ``special[i]`` where block ``i``'s differ from
    the shared ones, ``first`` for block 0 otherwise, ``rest`` for every other block. With
    ``lookahead`` L > 0 what block ``i`` hashes is ``(E, *ids[e:e+L])`` (:meth:`keys`)."""

    blocks: int
    first: ExtraKeys
    rest: ExtraKeys
    special: dict[int, ExtraKeys]
    lookahead: int = 0
    ids: Sequence[int] = ()
    block_size: int = 0

    def window(self, index: int) -> ExtraKeys:
        """Block ``index``'s keys E (without lookahead tokens)."""
        if index in self.special:
            return self.special[index]
        return self.first if index == 0 else self.rest

    def lookahead_ids(self, index: int) -> list[int]:
        """The L token ids after block ``index``, as plain ints."""
        end = (index + 1) * self.block_size
        return [operator.index(t) for t in self.ids[end : end + self.lookahead]]

    def keys(self, index: int) -> ExtraKeys:
        """What block ``index`` hashes as its extra keys."""
        if self.lookahead:
            return (self.window(index), *self.lookahead_ids(index))
        return self.window(index)

    @property
    def uniform(self) -> bool:
        """Block 0 has ``first``, every other block ``rest``: one C call does it all."""
        return not self.special and not self.lookahead


def tags_extra_keys(vllm_version: Version) -> bool:
    """Whether this vLLM tags each extra key with its kind (``("lora", name, path)``...)."""
    return vllm_version >= _TAGGED_KEYS_SINCE


def plan(
    vllm_version: Version,
    token_ids: Sequence[int],
    block_size: int,
    cache_salt: str | None,
    inputs: HashInputs,
) -> ExtraPlan:
    """The extra keys of every block vLLM hashes for this prompt (spec §2, §5). Token ids
    are validated by the caller; the lookahead tokens are read as plain ints here."""
    if cache_salt is not None and not isinstance(cache_salt, str):
        raise ValueError(f"cache_salt must be a string, not {type(cache_salt).__name__}")
    n_tokens, lookahead = len(token_ids), inputs.lookahead
    inputs.check_prompt(n_tokens)
    if lookahead and vllm_version < _LOOKAHEAD_SINCE:
        raise ValueError("vLLM < 0.33 does not hash lookahead tokens (lookahead must be 0)")
    tagged = tags_extra_keys(vllm_version)
    lora = _lora_keys(vllm_version, inputs.lora_name, inputs.lora_path, tagged)
    salt: list[object] = []
    if cache_salt:  # vLLM ignores a falsy salt
        salt = [("cache_salt", cache_salt) if tagged else cache_salt]
    blocks = max(n_tokens - lookahead, 0) // block_size
    windows = _mm_keys(vllm_version, inputs.mm_items, blocks, block_size, lookahead)
    first = tuple(lora + windows.get(0, []) + salt) or None
    special: dict[int, ExtraKeys] = {i: tuple(lora + k) for i, k in windows.items() if i}
    rest = tuple(lora) or None
    return ExtraPlan(blocks, first, rest, special, lookahead, token_ids, block_size)


def check(vllm_version: Version, inputs: HashInputs, n_tokens: int) -> None:
    """ValueError if ``inputs`` cannot be hashed for this vLLM over a prompt of ``n_tokens``
    tokens (what :func:`plan` would refuse), without hashing anything."""
    inputs.check_prompt(n_tokens)
    _lora_keys(vllm_version, inputs.lora_name, inputs.lora_path, tags_extra_keys(vllm_version))
    if inputs.lookahead and vllm_version < _LOOKAHEAD_SINCE:
        raise ValueError("vLLM < 0.33 does not hash lookahead tokens (lookahead must be 0)")


def _lora_keys(version: Version, name: str | None, path: str | None, tagged: bool) -> list[object]:
    if not name:  # an empty name means no LoRA
        if path:
            raise ValueError("lora_path was given without lora_name")
        return []
    if version < _LORA_NAME_SINCE:
        shown = ".".join(map(str, version))
        raise ValueError(
            f"vLLM {shown} keys LoRA blocks by the server-assigned lora_int_id, which cannot "
            "be derived from a LoRA name (LoRA requests are supported from vLLM 0.11.1)"
        )
    if not tagged:
        return [name]
    if not path:
        shown = ".".join(map(str, version))
        raise ValueError(
            f"vLLM {shown} hashes the LoRA adapter's path too (since 0.31): lora_path is required"
        )
    return [("lora", name, path)]


def _mm_keys(
    version: Version, items: tuple[MmItem, ...], blocks: int, block_size: int, lookahead: int
) -> dict[int, list[object]]:
    """Block index -> the keys of the items overlapping its window ``[s, e+L)``, in offset
    order (items are sorted); blocks no item touches are absent."""
    out: dict[int, list[object]] = {}
    for item in items:
        offset, identifier = item.offset, item.identifier
        first = max(0, (offset - lookahead) // block_size)
        last = min(blocks - 1, (offset + item.length - 1) // block_size)
        for i in range(first, last + 1):
            rel = offset - i * block_size
            if version >= _TAGGED_KEYS_SINCE:
                key: object = ("mm", identifier, rel)
            elif version >= _MM_OFFSET_SINCE:
                key = (identifier, rel)
            else:
                key = identifier
            out.setdefault(i, []).append(key)
    return out


def block_tails(keys: ExtraPlan) -> list[bytes]:
    """Each block's tail for the C chain: the CBOR of its extra keys (:meth:`ExtraPlan.keys`)."""
    memo: dict[object, bytes] = {}
    tails = [_encode_window(keys.rest, memo)] * keys.blocks
    if keys.blocks:
        tails[0] = _encode_window(keys.first, memo)
    for index, window in keys.special.items():
        tails[index] = _encode_window(window, memo)
    if keys.lookahead:  # (E, *next L ids): an array head, E, then the ids
        head, size, span = cbor.head(4, 1 + keys.lookahead), keys.block_size, keys.lookahead
        starts = np.arange(1, keys.blocks + 1, dtype=np.int64) * size
        where = (starts[:, None] + np.arange(span, dtype=np.int64)).ravel()
        ids = keys.ids
        if isinstance(ids, array):
            words = np.frombuffer(ids, np.uint64) if len(ids) else np.zeros(0, np.uint64)
        else:
            words = np.asarray(ids, dtype=np.uint64)
        encoded = cbor.encode_uints(words[where].tolist())
        if span > 1:
            encoded = [b"".join(encoded[i : i + span]) for i in range(0, len(encoded), span)]
        tails = [head + tail + look for tail, look in zip(tails, encoded, strict=True)]
    return tails


def _encode_window(window: ExtraKeys, memo: dict[object, bytes]) -> bytes:
    """:func:`cbor.encode` of a window built by :func:`plan` (str and int leaves
    only, so equal keys are equal values), each key's encoding computed once per chain:
    a multimodal key differs between blocks only in its last item, the relative offset."""
    if window is None:
        return cbor.NULL
    parts = [cbor.head(4, len(window))]
    for key in window:
        if type(key) is tuple and type(key[-1]) is int:
            stem = key[:-1]
            prefix = memo.get(stem)
            if prefix is None:
                prefix = memo[stem] = cbor.head(4, len(key)) + b"".join(map(cbor.encode, stem))
            parts.append(prefix + cbor.encode(key[-1]))
        else:
            encoded = memo.get(key)
            if encoded is None:
                encoded = memo[key] = cbor.encode(key)
            parts.append(encoded)
    return b"".join(parts)
