"""Writing the registry: the discovery lease, the diff against Redis, and the main loop.

A *source* (Kubernetes watches or the static file) keeps an in-memory view and sets its
``changed`` event; :func:`run` then computes the desired set, reads the registry
(``store.instance_ips`` / ``list_instances`` / ``list_masters``), removes what is absent,
upserts what differs and replaces the master hash if it differs. Every write is
idempotent, so a pass can be repeated any time; one also runs every ``leaseTTL/3``.

Only the lease holder writes (``store.claim_discovery_lease``, renewed every TTL/3). A
standby keeps its source up to date and retries the claim every TTL/3; once it holds the
lease its first pass is a full reconcile. Writes stop as soon as the holder cannot prove
it still holds the lease: each write checks that the last successful claim is younger than
0.8 × TTL, so a holder that stalls or loses Redis stops before its key can expire. This
narrows, but cannot close, the window of two writers (a stall *inside* one write); writes
are not fenced by the lease in Redis. Both processes derive their writes from the same
API state and every write is idempotent, so such an overlap converges at the next pass.

A part of the view that was never listed successfully is ``None`` ("unknown") and is
never written: the last good registry stays in place while discovery is blind. Redis
errors back off (``ingest.l1.backoffInitial``..``backoffMax``) and drop the lease claim.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Protocol

import redis

from common.health import Health
from common.lifecycle import Backoff, StateLog
from common.store import Instance, RegistryChange
from services.discovery.metrics import DiscoveryMetrics

logger = logging.getLogger(__name__)


class Registry(Protocol):
    """Discovery's role of :class:`common.store.Store`: the registry and the discovery lease."""

    def claim_discovery_lease(self, holder: str, ttl_ms: int) -> bool: ...
    def release_discovery_lease(self, holder: str) -> bool: ...
    def instance_ips(self) -> set[str]: ...
    def list_instances(self) -> list[Instance]: ...
    def upsert_instance(self, inst: Instance) -> tuple[RegistryChange, int]: ...
    def remove_instance(self, ip: str) -> bool: ...
    def list_masters(self) -> dict[str, str]: ...
    def set_masters(self, masters: dict[str, str]) -> None: ...


_STOP_POLL = 0.25
"""Longest wait between checks of the stop event while idle (seconds)."""


@dataclass(frozen=True)
class Desired:
    """What should be registered. ``None`` parts are unknown (never synced): not touched."""

    instances: dict[str, Instance] | None
    masters: dict[str, str] | None


class Source(Protocol):
    changed: threading.Event

    def start(self) -> None: ...

    def desired(self) -> Desired: ...

    def close(self) -> None: ...


class LeaseLost(Exception):
    """The lease can no longer be proven held: stop writing until the next claim."""


class Reconciler:
    """Holds the discovery lease and makes the registry equal to a :class:`Desired`."""

    def __init__(
        self, store: Registry, holder: str, lease_ttl: float, metrics: DiscoveryMetrics
    ) -> None:
        self.store, self.holder, self.metrics = store, holder, metrics
        self.ttl = max(lease_ttl, 0.3)
        self.renew_every = self.ttl / 3
        self.held = False
        self._valid_until = 0.0
        self._next_claim = 0.0
        self._lease_log = StateLog(logger, f"discovery lease ({holder})")

    def hold_lease(self) -> bool:
        """Claim or renew the lease when due; True while this process may write."""
        now = time.monotonic()
        if now < self._next_claim:
            return self.held and now < self._valid_until
        try:
            held = self.store.claim_discovery_lease(self.holder, int(self.ttl * 1000))
        except redis.RedisError:
            self._set_held(False, now, "unknown (redis unreachable): not writing")
            # Try Redis again on the next pass (the caller's backoff paces it): a pass that
            # skipped Redis would report it reachable (readiness, alerts) while it is down.
            self._next_claim = 0.0
            raise
        self._set_held(held, now, "held" if held else "standby (another process writes)")
        return held

    def _set_held(self, held: bool, now: float, state: str) -> None:
        self.held = held
        self._valid_until = now + 0.8 * self.ttl if held else 0.0
        self._next_claim = now + self.renew_every if held else now + min(self.renew_every, 1.0)
        self.metrics.lease_held.set(1 if held else 0)
        self._lease_log.set(state)

    def _check(self) -> None:
        if not self.held or time.monotonic() >= self._valid_until:
            self._next_claim = 0.0  # re-claim at once: we may well still hold it
            raise LeaseLost()

    def sync(self, desired: Desired) -> None:
        """One reconcile pass (no-op unless the lease is held)."""
        if desired.instances is not None:
            self.metrics.instances.set(len(desired.instances))
        if desired.masters is not None:
            self.metrics.masters.set(len(desired.masters))
        if not self.hold_lease():
            return
        if desired.instances is not None:
            self._sync_instances(desired.instances)
        if desired.masters is not None:
            self._sync_masters(desired.masters)

    def _sync_instances(self, want: dict[str, Instance]) -> None:
        registered = self.store.instance_ips()
        have = {inst.ip: inst for inst in self.store.list_instances()}
        for ip in sorted(registered - want.keys()):
            self._check()
            self.store.remove_instance(ip)
            self.metrics.changes.inc(action="removed")
            logger.info("instance %s removed (pod %s)", ip, have[ip].pod if ip in have else "?")
        for ip, inst in sorted(want.items()):
            if ip in registered and not _differs(have.get(ip), inst):
                continue
            self._check()
            action, gen = self.store.upsert_instance(inst)
            if action is not RegistryChange.UNCHANGED:
                self.metrics.changes.inc(action=action)
                logger.info(
                    "instance %s %s (pod %s, uid %s, gen %d)", ip, action, inst.pod, inst.uid, gen
                )

    def _sync_masters(self, want: dict[str, str]) -> None:
        have = self.store.list_masters()
        if have == want:
            return
        self._check()
        self.store.set_masters(want)
        self.metrics.changes.inc(action="masters")
        logger.info(
            "mooncake masters: %s (added %s, removed %s)",
            sorted(want),
            sorted(want.keys() - have.keys()),
            sorted(have.keys() - want.keys()),
        )

    def release(self) -> None:
        """Give the lease up (on shutdown) so a standby takes over at its next claim."""
        if self.held:
            try:
                self.store.release_discovery_lease(self.holder)
            except redis.RedisError as exc:
                logger.warning("could not release the discovery lease: %s", exc)
        self.held = False
        self.metrics.lease_held.set(0)


def _differs(cur: Instance | None, new: Instance) -> bool:
    if cur is None:
        return True
    return (cur.uid, cur.restarts, cur.meta_fields()) != (new.uid, new.restarts, new.meta_fields())


def run(
    source: Source,
    reconciler: Reconciler,
    stop: threading.Event,
    backoff: Backoff,
    health: Health | None = None,
) -> None:
    """Reconcile on every source change and every lease renewal until ``stop`` is set.
    Beats ``health`` once per pass; ready once a pass has reached Redis."""
    redis_log = StateLog(logger, "redis")
    health = health or Health()
    beat, ready = health.heartbeat("discovery loop"), health.condition("registry")
    source.start()
    try:
        while not stop.is_set():
            beat.beat()
            source.changed.clear()
            delay = reconciler.renew_every
            try:
                reconciler.sync(source.desired())
                redis_log.set("ok")
                ready.set(True)
                backoff.reset()
            except LeaseLost:
                logger.warning("discovery lease not renewed in time; writes paused")
                reconciler.metrics.errors.inc(kind="lease_lost")
                delay = 0.0
            except redis.RedisError as exc:
                reconciler.metrics.errors.inc(kind="redis")
                redis_log.set("down", f"{type(exc).__name__}: {exc}", logging.WARNING)
                ready.set(False, f"Redis: {type(exc).__name__}: {exc}")
                delay = backoff.next_delay()
            except Exception:  # top of the loop: log it, back off, keep the registry
                logger.exception("reconcile pass failed")
                reconciler.metrics.errors.inc(kind="internal")
                ready.set(False, "the last pass failed (see the log)")
                delay = backoff.next_delay()
            beat.beat(delay)  # a planned wait, not a stall
            _wait(stop, source.changed, delay)
    finally:
        beat.close()
        source.close()
        reconciler.release()


def _wait(stop: threading.Event, changed: threading.Event, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not stop.is_set():
        left = deadline - time.monotonic()
        if left <= 0 or changed.wait(min(left, _STOP_POLL)):
            return
