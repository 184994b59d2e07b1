"""The index's tiers as one type, spelled as in the Redis keys (:mod:`common.keys`) and the
metrics' ``tier`` label: ``l1`` (GPU), ``l2`` (CPU/offload: both fed by the KV events),
``l3`` (Mooncake, polled from the masters)."""

from __future__ import annotations

from typing import Literal

Tier = Literal["l1", "l2", "l3"]
"""A tier of the index."""
EventTier = Literal["l1", "l2"]
"""The tiers the KV events feed (their sets and copies hashes are written by APPLY_BATCH)."""
