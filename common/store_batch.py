"""The words of one fenced L1/L2 batch write (``store_lua.APPLY_BATCH``): the writes of a
batch (:class:`TierOps`), the cursor that fences it (:class:`StoredCursor`), what the store
did (:class:`BatchStatus`, :class:`ApplyResult`) and the status write (:class:`L1Status`).

:class:`common.store.Store` sends them; its module re-exports every name here.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from common.tiers import EventTier
from common.store_lua import APPLY_BATCH_OPS, APPLY_BATCH_STATUS


class BatchStatus(StrEnum):
    """What the store did with one fenced batch write (its values are metric label values)."""

    APPLIED = "applied"
    DUPLICATE = "duplicate"
    """The sequence is not above the last applied one: nothing changed."""
    STALE_GEN = "stale_gen"
    """Refused: the instance is no longer the generation the writer follows."""
    NOT_OWNER = "not_owner"
    """Refused: another ingester holds the instance's lease."""
    GROUPS_CHANGED = "groups_changed"
    """Refused: a KV-cache group's kind or window changed; the store reset the instance (new
    generation, ``reset_reason`` in its state hash) and the ingester re-syncs it."""
    CURSOR_MOVED = "cursor_moved"
    """Refused: the rank's stored cursor is not the one the writer follows (:class:`StoredCursor`;
    what the ingester does then: ``services/l1_ingest/stream.py``)."""


@dataclass
class ApplyResult:
    """What one fenced batch write did (the fields of ``store_lua.APPLY_BATCH_REPLY``)."""

    status: BatchStatus
    unknown_removes: int = 0


@dataclass(frozen=True)
class StoredCursor:
    """What the l1 state hash says was applied last on one rank: ``seq:<rank>`` (None = no
    field: nothing applied, or reset) and ``dig:<rank>``, the digest of that batch's payload
    (hex; ``""`` = none recorded): what :meth:`Store.apply_batch`'s ``follows`` names."""

    seq: int | None = None
    digest: str = ""

    def fence(self) -> list[str]:
        """The cursor as ``APPLY_BATCH`` compares it (no field is the same as ``-1``)."""
        seq = -1 if self.seq is None or self.seq < 0 else self.seq
        return [str(seq), self.digest if seq >= 0 else ""]

    def same(self, other: StoredCursor) -> bool:
        return self.fence() == other.fence()


_OP = APPLY_BATCH_OPS
_DESCRIBING = (_OP["describe"], _OP["settings"], _OP["lookahead"])

Op = tuple[str, str, int, list[Any]]
"""One write of a batch: (op, tier, KV-cache group, values); see ``APPLY_BATCH``."""


@dataclass
class TierOps:
    """The writes of one ZMQ batch for one rank, in event order: (op, tier, group, values).

    ``describe`` records a group's descriptor as a ``BlockStored`` carries it, ``settings``
    the ingester's per-instance settings and ``lookahead`` the engine's lookahead L; the store
    checks and writes them before any hash.
    """

    ops: list[Op] = field(default_factory=list)

    def store(self, tier: EventTier, hashes: Iterable[int], group: int = 0) -> None:
        self._hashes(_OP["stored"], tier, group, list(hashes))

    def remove(self, tier: EventTier, hashes: Iterable[int], group: int = 0) -> None:
        self._hashes(_OP["removed"], tier, group, list(hashes))

    def _hashes(self, op: str, tier: EventTier, group: int, hashes: list[int]) -> None:
        """Append ``op``; merge into the previous op when it is the same op on the same tier
        and group (descriptors between them are applied first by the store, so they do not
        part)."""
        for last in reversed(self.ops):
            if last[0] in _DESCRIBING:
                continue
            if last[0] == op and last[1] == tier and last[2] == group:
                last[3].extend(hashes)
                return
            break
        self.ops.append((op, tier, group, hashes))

    def clear(self, tier: EventTier) -> None:
        self.ops.append((_OP["cleared"], tier, 0, []))

    def describe(self, group: int, kind: str | None, block_size: int, window: int | None) -> None:
        self.ops.append(
            (
                _OP["describe"],
                "",
                group,
                [kind or "-", int(block_size), "" if window is None else int(window)],
            )
        )

    def settings(self, hash_unit: int, chunk: int, dp_size: int) -> None:
        self.ops.append((_OP["settings"], "", 0, [int(hash_unit), int(chunk), int(dp_size)]))

    def lookahead(self, tokens: int) -> None:
        """The instance's speculative-decoding lookahead L as its events show it (spec
        vllm-extra-keys.md §5); a different L than the one stored resets the instance."""
        self.ops.append((_OP["lookahead"], "", 0, [int(tokens)]))

    def argv(self) -> list[str | int]:
        out: list[str | int] = []
        for op, tier, group, values in self.ops:
            out += [op, tier, group, len(values)]
            out += values
        return out


@dataclass
class L1Status:
    """One instance's status write: fields to set and counters to increment (l1 state hash)."""

    ip: str
    gen: int
    owner: str
    fields: dict[str, str]
    incr: dict[str, int] = field(default_factory=dict)


BATCH_STATUS_CODES = {code: BatchStatus(name) for name, code in APPLY_BATCH_STATUS.items()}
"""APPLY_BATCH's status code → what it means."""
