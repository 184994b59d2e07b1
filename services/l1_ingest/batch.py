"""One L1 batch write, apart from the sequence rules around it (:mod:`~services.l1_ingest.stream`).

What the write needs from the store (:class:`BatchWriter`), the payload's digest stored next to
its sequence, the payload decoded into the store's ops (a payload that is not a batch, or an
event the decoder skips, is logged and counted, and the write goes on with what is left), and
the counting of what an applied write did.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Protocol

from common.errors import NotABatchError
from common.events import Event, decode_batch
from common.store import ApplyResult, StoredCursor, TierOps
from services.l1_ingest.apply import GroupSettings, Plan, Step, plan_ops
from services.l1_ingest.metrics import IngestMetrics

logger = logging.getLogger(__name__)


class BatchWriter(Protocol):
    """A rank stream's role of :class:`common.store.Store`: fenced batch writes, the cursor."""

    def apply_batch(
        self,
        ip: str,
        gen: int,
        rank: int,
        seq: int,
        ops: TierOps,
        *,
        owner: str = "",
        reset: bool = False,
        gap: bool = False,
        follows: StoredCursor | None = None,
        digest: str = "",
    ) -> ApplyResult: ...

    def cursor(self, ip: str, rank: int) -> StoredCursor: ...


def payload_digest(payload: bytes) -> bytes:
    """8 bytes identifying a payload (compared with the replayed batch at the same seq)."""
    return hashlib.blake2b(payload, digest_size=8).digest()


def digest_of(cursor: StoredCursor) -> tuple[int, bytes] | None:
    """The (seq, digest) a replay's first batch is compared with; None if none is stored."""
    if cursor.seq is None or cursor.seq < 0 or not cursor.digest:
        return None
    try:
        return cursor.seq, bytes.fromhex(cursor.digest)
    except ValueError:
        return None


def show_cursor(cursor: StoredCursor) -> str:
    """A stored cursor for a log line."""
    if cursor.seq is None or cursor.seq < 0:
        return "none"
    return f"seq {cursor.seq}" + (f" ({cursor.digest})" if cursor.digest else "")


def decode_plan(
    name: str, step: Step, groups: GroupSettings, metrics: IngestMetrics
) -> tuple[Plan, list[Event]]:
    """The store's ops for ``step``'s payload (none for a payload that is not a batch), and
    the events they came from."""
    try:
        batch = decode_batch(step.payload)
    except NotABatchError as exc:
        logger.error(
            "%s: seq %d is not an event batch (%d bytes): %s",
            name,
            step.seq,
            len(step.payload),
            exc,
        )
        metrics.malformed_frames.inc(reason=exc.reason)
        return Plan(TierOps()), []
    for skipped in batch.skipped:
        logger.error(
            "%s: seq %d event %d skipped (%s): %s",
            name,
            step.seq,
            skipped.index,
            skipped.reason,
            skipped.detail,
        )
    return plan_ops(batch, groups), batch.events


def count_applied(metrics: IngestMetrics, plan: Plan, result: ApplyResult) -> None:
    """Count what an applied write did: its events' outcomes, media skipped, hash updates
    per tier, removals of blocks the index did not hold."""
    for (kind, outcome), n in plan.outcomes.items():
        metrics.events.inc(n, type=kind, outcome=outcome)
    for medium, n in plan.other_media.items():
        metrics.skipped_media.inc(n, medium=medium)
    for tier, n in plan.hash_updates.items():
        metrics.hash_updates.inc(n, tier=tier)
    if result.unknown_removes:
        metrics.unknown_removes.inc(result.unknown_removes)
