"""The typed vLLM KV-cache events and the table of which vLLM release declares which field.

Re-exported by :mod:`common.events`, which owns decoding and encoding; import from there. The
field tables follow spec vllm-kv-events.md §2.3 and are the single source for both the decoder's
map keys and the encoder's per-version layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeAlias

Hash: TypeAlias = int | bytes
Version: TypeAlias = tuple[int, int, int]


@dataclass(slots=True)
class BlockStored:
    """Blocks became full and cached. Field order is vLLM's declaration (= wire) order.

    ``block_size`` may be 0 for connector placeholders (§3.5); ``extra_keys`` is aligned with
    ``block_hashes`` by vLLM, which this decoder does not check.
    """

    block_hashes: list[Hash]
    parent_block_hash: Hash | None
    token_ids: list[int]
    block_size: int
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


@dataclass(slots=True)
class BlockRemoved:
    """Cached blocks left the prefix cache; vLLM sends one hash per event (§3.2)."""

    block_hashes: list[Hash]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


@dataclass(slots=True)
class AllBlocksCleared:
    """The whole prefix cache was reset."""


Event: TypeAlias = BlockStored | BlockRemoved | AllBlocksCleared


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


# (field, first vLLM release declaring it, written in map form even when None).
# Declaration order; the dataclasses above declare the same fields in the same order.
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
MAP_FORM_SINCE: Version = (0, 24, 0)
