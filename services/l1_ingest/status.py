"""What the ingester tells operators about each of its instances, through Redis.

One :class:`InstanceStatus` per followed instance (kept while the instance stays assigned
with the same generation, across resubscriptions). The rank streams count the batches they
receive (live or replayed) and feed applied batches to the :class:`HashChecker`; about once a
second the subscriber turns every status into a :class:`~common.store.L1Status` write (one
pipeline, fenced by generation and owner) into the instance's ``ci:{ip}:l1:state`` hash:

| field | meaning |
|---|---|
| ``ingester`` | id of the ingester writing (``--id``, else ``<host>-<pid>-<6 hex>``: ``main.py``) |
| ``status_ms`` | when this status was written (ms since epoch, the ingester's clock) |
| ``subscribed_ms`` | when this ingester began following the instance |
| ``last_event_ms`` | last batch (live or replayed) arrival, to ~1 s; absent = none yet |
| ``conn`` | worst rank: connected, connecting, disconnected, unreachable, retrying |
| ``conn_detail`` | endpoint or why it is being retried |
| ``replaying`` | ``1`` while a replay is in flight on any rank |
| ``resyncing`` | ``1`` while a rank re-syncs because its stored cursor moved (lost writes) |
| ``resyncs`` / ``resync_detail`` | re-syncs so far (counter) / the last one's reason |
| ``lifetime_detail`` | the last new engine lifetime recognised: rank and evidence |
| ``lifetime_ms`` | when it was recognised |
| ``hash_check`` | ``ok``, ``mismatch`` or ``unchecked`` (see :mod:`.hashcheck`) |
| ``hash_check_ok`` / ``hash_check_mismatch`` | blocks verified / mismatched (counters) |
| ``hash_check_detail`` | one sentence: what was verified, or which setting the engine uses |
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import redis

from common.errors import ConfigError
from common.lifecycle import StateLog
from common.settings import L1IngestSettings
from common.status_report import ConnState
from common.store import Instance, L1Status
from services.l1_ingest.hashcheck import UNCHECKED, HashChecker
from services.l1_ingest.metrics import IngestMetrics

logger = logging.getLogger(__name__)


class StatusWriter(Protocol):
    """The status board's role of :class:`common.store.Store`."""

    def write_l1_status(self, updates: Sequence[L1Status]) -> list[bool]: ...


CONN_ORDER = tuple(ConnState)
"""Connection states, best first; an instance shows its worst rank."""


def now_ms() -> int:
    return int(time.time() * 1000)


class InstanceStatus:
    """The ingester-side status of one instance (one generation)."""

    def __init__(
        self, inst: Instance, checker: HashChecker | None, why_unchecked: str = ""
    ) -> None:
        self.inst, self.checker = inst, checker
        self.why_unchecked = why_unchecked or "the hash self-check is off (hashCheckRate 0)"
        self.subscribed_ms = now_ms()
        self.batches = 0
        """Batches received so far (live and replayed); bumped by the rank streams."""
        self.retry_reason = ""
        self._seen = 0
        self._last_event_ms: int | None = None
        self._acked = self._pending = (0, 0)  # (ok, mismatch) counted in Redis / in flight
        self._resyncs = self._resyncs_acked = self._pending_resyncs = 0
        self._notes: dict[str, str] = {}

    def resynced(self, why: str) -> None:
        """A rank began re-syncing after its stored cursor moved."""
        self._resyncs += 1
        self._notes["resync_detail"] = why

    def restarted(self, why: str) -> None:
        """A rank recognised a new engine lifetime (``why`` names the evidence)."""
        self._notes.update(lifetime_detail=why, lifetime_ms=str(now_ms()))

    def update(
        self,
        owner: str,
        ingester: str,
        conn: str,
        conn_detail: str,
        replaying: bool,
        resyncing: bool = False,
    ) -> L1Status:
        """The write for this round (counters as increments since the last write)."""
        stamp = now_ms()
        if self.batches != self._seen:
            self._seen, self._last_event_ms = self.batches, stamp
        fields = {
            "ingester": ingester,
            "status_ms": str(stamp),
            "subscribed_ms": str(self.subscribed_ms),
            "conn": conn,
            "conn_detail": conn_detail,
            "replaying": "1" if replaying else "0",
            "resyncing": "1" if resyncing else "0",
            **self._notes,
        }
        if self._last_event_ms is not None:
            fields["last_event_ms"] = str(self._last_event_ms)
        incr: dict[str, int] = {}
        if self._resyncs != self._resyncs_acked:
            incr["resyncs"] = self._resyncs - self._resyncs_acked
        self._pending_resyncs = self._resyncs
        checker = self.checker
        if checker is None:
            fields.update(hash_check=UNCHECKED, hash_check_detail=self.why_unchecked)
        else:
            fields.update(hash_check=checker.verdict, hash_check_detail=checker.detail)
            self._pending = (checker.ok, checker.mismatch)
            incr |= {
                "hash_check_ok": checker.ok - self._acked[0],
                "hash_check_mismatch": checker.mismatch - self._acked[1],
            }
        return L1Status(self.inst.ip, self.inst.gen, owner, fields, incr)

    def acked(self) -> None:
        """The last write landed: its counter increments are in Redis (else they are sent
        again with the next write)."""
        self._acked = self._pending
        self._resyncs_acked = self._pending_resyncs


def worst(states: list[ConnState]) -> ConnState:
    """The worst connection state of an instance's ranks (connecting for none)."""
    return max(states, key=CONN_ORDER.index, default=ConnState.CONNECTING)


@dataclass(frozen=True)
class ConnRound:
    """What the subscriber knows of one wanted instance's sockets this round."""

    inst: Instance
    conn: ConnState
    detail: str
    replaying: bool
    resyncing: bool = False


class StatusBoard:
    """The statuses of every wanted instance of one ingester, and their periodic write."""

    def __init__(
        self,
        store: StatusWriter,
        cfg: L1IngestSettings,
        metrics: IngestMetrics,
        *,
        owner: str,
        ingester: str,
    ) -> None:
        self.store, self.cfg, self.metrics, self.settings = store, cfg, metrics, cfg.hash
        self.owner, self.ingester = owner, ingester
        self.statuses: dict[str, InstanceStatus] = {}
        self._log = StateLog(logger, "status writes")

    def of(self, inst: Instance) -> InstanceStatus:
        """The status of ``inst`` (a new one for a new generation)."""
        status = self.statuses.get(inst.ip)
        if status is None or status.inst.gen != inst.gen:
            status = self.statuses[inst.ip] = self._new(inst)
        return status

    def prune(self, wanted: dict[str, Instance]) -> None:
        self.statuses = {
            ip: st
            for ip, st in self.statuses.items()
            if ip in wanted and st.inst.gen == wanted[ip].gen
        }

    def _new(self, inst: Instance) -> InstanceStatus:
        if self.cfg.hash_check_rate <= 0:
            return InstanceStatus(inst, None)
        try:
            checker = HashChecker(
                inst.ip,
                self.settings,
                self.cfg.hash_check_rate,
                metrics=self.metrics,
                hash_unit=self.cfg.hybrid_settings(inst.model).prefix_match_unit,
            )
        except ConfigError as exc:
            return InstanceStatus(inst, None, f"cannot check: {exc}")
        return InstanceStatus(inst, checker)

    def write(self, rounds: Sequence[ConnRound]) -> None:
        """One pipeline of fenced writes; a Redis failure is logged once and retried next
        round (the counters not yet written are sent again)."""
        pending = []
        for r in rounds:
            status = self.of(r.inst)
            detail = r.detail if r.conn is not ConnState.RETRYING else status.retry_reason
            pending.append(
                (
                    status,
                    status.update(
                        self.owner, self.ingester, r.conn, detail, r.replaying, r.resyncing
                    ),
                )
            )
        try:
            written = self.store.write_l1_status([update for _, update in pending])
        except redis.RedisError as exc:
            self.metrics.status_writes.inc(result="error")
            self._log.set("failing", str(exc), logging.WARNING)
            return
        self._log.set("ok")
        for (status, _), ok in zip(pending, written, strict=True):
            self.metrics.status_writes.inc(result="ok" if ok else "refused")
            if ok:
                status.acked()
