"""What one KV-event batch does to an instance's index, and where it fits in the sequence.

Pure (no I/O), so every rule here is unit-tested directly:

* :func:`plan_ops` maps a decoded batch to the store's :class:`~common.store.TierOps`.
  - **Medium.** ``"GPU"`` (any case) and ``None`` (vLLM < 0.10.2 sends no medium) go to tier
    ``l1``; every other medium (``CPU``/``STORAGE`` from the offloading connector, ``cpu`` from
    the Mooncake store connector, LMCache's own names) goes to tier ``l2``, never to ``l1``.
  - **KV-cache group.** Every group is indexed, each in its own set (``group_idx``; none =
    group 0, as vLLM < 0.20 sends and dense models have). A ``BlockStored`` also records its
    group's descriptor (kind, block size, window: :meth:`~common.store.TierOps.describe`),
    which the store checks and the hit rule (:mod:`common.hit_rule`) reads; group ids are
    never taken to mean a kind. Sparse stores (hashes for only the kept blocks, even none)
    are applied as they are: a hash names a prefix length, so it needs no position.
  - **Lookahead.** A GPU ``BlockStored`` also says the engine's speculative-decoding
    lookahead L (vLLM >= 0.33 with EAGLE/MTP: ``len(lookahead_token_ids[0])``; none sent =
    0): :meth:`~common.store.TierOps.lookahead`, once per batch (its last such event). Other
    media are not asked: a connector may leave the field out where the engine hashes with L.
  - **Placeholders** (``token_ids == []`` and ``block_size == 0``, emitted by connectors) are
    not indexed. ``AllBlocksCleared`` clears tier ``l1`` of the batch's rank only: it carries no
    medium and is only emitted by the GPU block pool's ``reset_prefix_cache``.
* :class:`Cursor` / :func:`classify` decide whether a live sequence number is the next one, a
  duplicate (already applied via replay), a gap, or a publisher restart.
* :func:`plan_run` orders replayed and live batches and marks where a gap could not be filled.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

from common.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    EventBatch,
    hash_to_int,
)
from common.tiers import EventTier
from common.store import TierOps

L1: EventTier = "l1"
L2: EventTier = "l2"
_KNOWN_MEDIA = frozenset({"CPU", "STORAGE", "DISK", "GPU"})


def tier_for_medium(medium: str | None) -> EventTier:
    """``l1`` for GPU (or no medium: vLLM < 0.10.2), ``l2`` for every other medium."""
    return L1 if medium is None or medium.upper() == "GPU" else L2


def medium_label(medium: str | None) -> str:
    """A bounded metric label for a non-GPU medium (the wire may carry any string)."""
    name = (medium or "").upper()
    return name if name in _KNOWN_MEDIA else "other"


@dataclass(frozen=True)
class GroupSettings:
    """What the ingester's config says of one instance's hash unit, chunk size and DP size
    (written next to the learned group descriptors, see :meth:`TierOps.settings`)."""

    hash_unit: int = 0
    """vLLM's ``--prefix-match-unit`` (0 = derive from the events' block sizes)."""
    chunk: int = 0
    """Chunk size of chunked-local attention groups (0 = unknown: a lower bound)."""
    dp_size: int = 1


@dataclass
class Plan:
    """The store writes of one batch plus per-event outcome counts for metrics.

    ``outcomes`` keys are ``(event_type, outcome)``; outcome is ``l1``, ``l2``,
    ``placeholder`` or ``skipped:<reason>`` (malformed / unknown events of the batch).
    ``other_media`` counts events sent to ``l2`` by medium label (:func:`medium_label`),
    ``hash_updates`` the hashes stored or removed per tier.
    """

    ops: TierOps = field(default_factory=TierOps)
    outcomes: Counter[tuple[str, str]] = field(default_factory=Counter)
    other_media: Counter[str] = field(default_factory=Counter)
    hash_updates: Counter[str] = field(default_factory=Counter)
    described: set[tuple[int, str | None, int, int | None]] = field(default_factory=set)
    lookahead: int | None = None
    """The engine's lookahead L from the batch's last GPU ``BlockStored`` that shows it."""


def plan_ops(batch: EventBatch, settings: GroupSettings | None = None) -> Plan:
    """Translate one decoded batch into ordered tier operations (consecutive ops merged);
    ``settings`` go with the first group descriptor of the batch."""
    plan = Plan()
    for event in batch.events:
        kind, outcome = _plan_event(event, plan)
        plan.outcomes[(kind, outcome)] += 1
    if plan.described and settings is not None:
        plan.ops.settings(settings.hash_unit, settings.chunk, settings.dp_size)
    if plan.lookahead is not None:
        plan.ops.lookahead(plan.lookahead)
    for skipped in batch.skipped:
        plan.outcomes[("unknown", f"skipped:{skipped.reason}")] += 1
    return plan


def _plan_event(event: Event, plan: Plan) -> tuple[str, str]:
    if isinstance(event, AllBlocksCleared):
        plan.ops.clear(L1)
        return "AllBlocksCleared", L1
    if isinstance(event, BlockStored):
        if not event.token_ids and event.block_size == 0:
            return "BlockStored", "placeholder"
        group = event.group_idx or 0
        if group < 0:
            return "BlockStored", "skipped:bad_group"
        _describe(plan, group, event)
        tier = _tier(plan, event.medium)
        if tier == L1:
            _learn_lookahead(plan, event.lookahead_token_ids)
        _add(plan, plan.ops.store, tier, group, [hash_to_int(h) for h in event.block_hashes])
        return "BlockStored", tier
    assert isinstance(event, BlockRemoved)
    group = event.group_idx or 0
    if group < 0:
        return "BlockRemoved", "skipped:bad_group"
    tier = _tier(plan, event.medium)
    _add(plan, plan.ops.remove, tier, group, [hash_to_int(h) for h in event.block_hashes])
    return "BlockRemoved", tier


def _describe(plan: Plan, group: int, event: BlockStored) -> None:
    """Record the group's descriptor once per batch and distinct descriptor."""
    desc = (group, event.kv_cache_spec_kind, event.block_size, event.kv_cache_spec_sliding_window)
    if desc not in plan.described:
        plan.described.add(desc)
        plan.ops.describe(*desc)


def _learn_lookahead(plan: Plan, lookahead: list[list[int]] | None) -> None:
    """L = the length of a block's lookahead tokens; none sent = 0 (vLLM < 0.33 or no
    lookahead). An empty list names no block, so says nothing."""
    if lookahead is None:
        plan.lookahead = 0
    elif lookahead:
        plan.lookahead = len(lookahead[0])


def _tier(plan: Plan, medium: str | None) -> EventTier:
    tier = tier_for_medium(medium)
    if tier != L1:
        plan.other_media[medium_label(medium)] += 1
    return tier


def _add(
    plan: Plan,
    write: Callable[[EventTier, list[int], int], None],
    tier: EventTier,
    group: int,
    hashes: list[int],
) -> None:
    plan.hash_updates[tier] += len(hashes)
    write(tier, hashes, group)


# -- sequence tracking --------------------------------------------------------------------


class Verdict(Enum):
    """What a live batch is, given the cursor (:func:`classify`)."""

    APPLY = "apply"
    """The next sequence (or the first one seen): write it."""
    DUPLICATE = "duplicate"
    """Already applied this session (replay overlapping the live stream): drop it."""
    GAP = "gap"
    """Batches are missing before it: replay them first."""
    RESTART = "restart"
    """The sequence went backwards: the publisher restarted."""


@dataclass
class Cursor:
    """Sequence state of one instance rank for one subscription session.

    ``applied`` is the last applied sequence (read from the store when the session starts;
    ``None`` = nothing applied yet, the stream is joined wherever it is). ``live_max`` is the
    highest sequence seen on the live socket this session, ``covered_from`` the lowest one this
    session applied. ``reset_pending`` makes the next write clear the rank first.
    """

    applied: int | None = None
    live_max: int | None = None
    covered_from: int | None = None
    reset_pending: bool = False

    def expected(self) -> int | None:
        return None if self.applied is None else self.applied + 1

    def mark_applied(self, seq: int) -> None:
        self.applied = seq
        self.reset_pending = False
        if self.covered_from is None or seq < self.covered_from:
            self.covered_from = seq

    def mark_restart(self) -> None:
        """The publisher restarted: expect sequence 0 and clear the rank on the next write."""
        self.applied = -1
        self.live_max = None
        self.covered_from = None
        self.reset_pending = True


def classify(cursor: Cursor, seq: int) -> Verdict:
    """What a *live* batch with ``seq`` is, given the cursor (does not change it).

    A live sequence at or below ``applied`` is a duplicate only if this session already
    applied it (replay overlapping the live stream). Otherwise it went backwards, which a
    single publisher never does: vLLM restarted and began again at 0.
    """
    if cursor.applied is None or seq == cursor.applied + 1:
        return Verdict.APPLY
    if seq > cursor.applied + 1:
        return Verdict.GAP
    if cursor.live_max is not None and seq <= cursor.live_max:
        return Verdict.RESTART
    if cursor.covered_from is not None and seq >= cursor.covered_from:
        return Verdict.DUPLICATE
    return Verdict.RESTART


@dataclass(frozen=True)
class Step:
    """One batch to write: its sequence, payload, and whether an unfilled gap precedes it."""

    seq: int
    payload: bytes
    gap_before: bool = False


def plan_run(applied: int | None, batches: list[tuple[int, bytes]]) -> tuple[list[Step], int]:
    """Order candidate batches (replayed + live) after ``applied``; flag unfilled gaps.

    Batches at or below ``applied`` and repeated sequences are dropped. With ``applied`` None
    (joining a stream) the first batch starts the run without a gap. Returns the steps and
    the number of dropped duplicates.
    """
    steps: list[Step] = []
    expected = None if applied is None else applied + 1
    dropped = 0
    for seq, payload in sorted(batches, key=lambda b: b[0]):
        if expected is not None and seq < expected:
            dropped += 1
            continue
        steps.append(Step(seq, payload, gap_before=expected is not None and seq > expected))
        expected = seq + 1
    return steps, dropped
