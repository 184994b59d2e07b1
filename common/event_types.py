"""The vLLM KV-cache events as msgspec Structs, mirroring ``vllm/distributed/kv_events.py``.

Re-exported by :mod:`common.events`, which owns decoding and encoding; import from there. The
Structs are vLLM's own declarations (tagged by class name, ``omit_defaults``, ``gc=False``, the
same fields in the same order) with two deliberate differences, both for reading older and
newer releases with one type: every field after ``block_size`` defaults to None (vLLM leaves
``lora_id``, ``medium`` and ``lora_name`` without a default, and releases before 0.14 lack
some of them), and the wire types carry the checks vLLM's writer guarantees but a reader must
not assume: hashes are uint64 or 16n-byte digests, counts are never negative, ``extra_keys``
nests only arrays of scalars, ``lookahead_token_ids`` lists all have one length (the
instance's L, spec vllm-extra-keys.md §5). msgspec never takes a bool for an int.

:data:`STORED_FIELDS` / :data:`REMOVED_FIELDS` say which release first declared each field
(spec vllm-kv-events.md §2.3); the encoder builds each release's Structs from them, and
tests/unit/test_events.py checks they list the Structs' fields in order. A new vLLM field is
one line in its Struct and one in its table, both here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, TypeAlias

import msgspec

# A block hash: the uint64 of VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1 (msgpack has no larger
# int), or raw digests: 32 bytes for sha256, 16 for xxhash, k of them for a hybrid group in
# 0.12-0.23 (§4.5); the multiple of 16 is checked in __post_init__ (msgspec has no such Meta).
Hash: TypeAlias = Annotated[int, msgspec.Meta(ge=0)] | Annotated[bytes, msgspec.Meta(min_length=16)]
Count: TypeAlias = Annotated[int, msgspec.Meta(ge=0)]
Version: TypeAlias = tuple[int, int, int]

# What vLLM puts in extra keys (names, ids, mm identifiers, offsets, digests), nested in arrays.
_EXTRA_KEY_LEAVES = frozenset((str, int, bytes, float, bool, type(None)))


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the events; the tag is the class name, under the key "type" (§2.2)."""


class BlockStored(KVCacheEvent):
    """Blocks became full and cached. Field order is vLLM's declaration (= wire) order.

    ``block_size`` may be 0 for connector placeholders (§3.5); ``extra_keys`` is aligned with
    ``block_hashes`` by vLLM, which this decoder does not check.
    """

    block_hashes: list[Hash]
    parent_block_hash: Hash | None
    token_ids: list[int]
    block_size: Count
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[list[Any] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None

    def __post_init__(self) -> None:
        _check_digests(self.block_hashes)
        if type(self.parent_block_hash) is bytes:
            _check_digests([self.parent_block_hash])
        if self.extra_keys is not None:
            _check_extra_keys(self.extra_keys)
        if self.lookahead_token_ids is not None:
            _check_lookahead(self.lookahead_token_ids)


class BlockRemoved(KVCacheEvent):
    """Cached blocks left the prefix cache; vLLM sends one hash per event (§3.2)."""

    block_hashes: list[Hash]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None

    def __post_init__(self) -> None:
        _check_digests(self.block_hashes)


class AllBlocksCleared(KVCacheEvent):
    """The whole prefix cache was reset."""


Event: TypeAlias = BlockStored | BlockRemoved | AllBlocksCleared


def _check_digests(hashes: list[Hash]) -> None:
    """Raise ValueError (a ValidationError when decoding) for a digest not 16n bytes long."""
    if bytes in map(type, hashes):  # ints, the common case, cost one pass in C
        for h in hashes:
            if type(h) is bytes and len(h) % 16:
                raise ValueError(f"a block hash of {len(h)} bytes: expected 16n")


def _check_extra_keys(entries: list[list[Any] | None]) -> None:
    """Only arrays and scalar leaves, however deep; iterative, so depth is no risk."""
    stack = [entry for entry in entries if entry is not None]
    while stack:
        for item in stack.pop():
            if type(item) is list:
                stack.append(item)
            elif type(item) not in _EXTRA_KEY_LEAVES:
                raise ValueError(f"extra_keys holds {type(item).__name__}: expected arrays")


MAX_LOOKAHEAD = 64
"""The longest lookahead accepted (vLLM's L is 1, or ``num_speculative_tokens`` for
multi-module MTP: a handful); a longer one is a malformed event."""


def _check_lookahead(lists: list[list[int]]) -> None:
    """One L for the whole event: vLLM hashes every block of an engine with the same number
    of lookahead tokens, so lists of different lengths cannot be told apart from a bad
    writer (and would leave the instance's L undefined)."""
    lengths = {len(tokens) for tokens in lists}
    if len(lengths) > 1:
        raise ValueError("lookahead_token_ids lists of different lengths")
    if lengths and max(lengths) > MAX_LOOKAHEAD:
        raise ValueError(f"lookahead_token_ids of {max(lengths)} tokens, over {MAX_LOOKAHEAD}")


@dataclass(slots=True)
class SkippedEvent:
    """An event of a batch that was dropped; ``reason`` is a counter label."""

    index: int
    reason: str  # "not_an_event" | "unknown_type" | "malformed"
    detail: str


@dataclass(slots=True)
class EventBatch:
    """One decoded payload. ``form`` is the first event's: "array", "map", or "empty"."""

    ts: float
    events: list[Event]
    data_parallel_rank: int | None
    skipped: list[SkippedEvent]
    form: str


# (field, first vLLM release declaring it, written in map form even when None: vLLM declares
# it without a default). Declaration order, the Structs' order.
FieldSpec: TypeAlias = tuple[tuple[str, Version, bool], ...]
STORED_FIELDS: FieldSpec = (
    ("block_hashes", (0, 9, 0), True),
    ("parent_block_hash", (0, 9, 0), True),
    ("token_ids", (0, 9, 0), True),
    ("block_size", (0, 9, 0), True),
    ("lora_id", (0, 9, 0), True),
    ("medium", (0, 10, 2), True),
    ("lora_name", (0, 14, 0), True),
    ("extra_keys", (0, 17, 0), False),
    ("group_idx", (0, 20, 0), False),
    ("kv_cache_spec_kind", (0, 22, 0), False),
    ("kv_cache_spec_sliding_window", (0, 22, 0), False),
    ("locality", (0, 26, 0), False),
    ("ownership", (0, 29, 0), False),
    ("session_id", (0, 30, 0), False),
    ("lookahead_token_ids", (0, 33, 0), False),
)
REMOVED_FIELDS: FieldSpec = (
    ("block_hashes", (0, 9, 0), True),
    ("medium", (0, 10, 2), True),
    ("group_idx", (0, 20, 0), False),
    ("locality", (0, 26, 0), False),
    ("ownership", (0, 29, 0), False),
)
MAP_FORM_SINCE: Version = (0, 24, 0)  # vLLM#42892 dropped array_like from the events
