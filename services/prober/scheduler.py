"""The prober's loop: which instances to probe, when, and how many at once.

Every :data:`TICK_S` the loop reads the registry through the API (``GET /kv-cache/instances``,
at most once per ``audit.probe.interval`` while it answers) and starts a probe on every
instance whose last probe started at least one interval ago and is not still running,
oldest first, while fewer than ``audit.probe.concurrency`` run (a thread pool of that size).
So an instance is probed at most once per interval, and a fleet larger than one interval's
capacity is probed round-robin. Results are counted by outcome and logged (WARNING for
anything but ``exact``, with the instance, the tokens and the request id to look up in the
API's audit view). A registry read that fails is counted and retried at the next tick.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import httpx

from common.health import Health
from common.lifecycle import StateLog
from common.settings import ProberSettings
from services.prober.metrics import ProberMetrics
from services.prober.probe import Outcome, Prober, Result, Target

logger = logging.getLogger(__name__)

TICK_S = 0.25


def targets(doc: Any, settings: ProberSettings) -> list[Target]:
    """The probe targets in a ``GET /kv-cache/instances`` document (bad entries skipped)."""
    out: list[Target] = []
    for inst in (doc or {}).get("instances") or []:
        if not isinstance(inst, dict) or not isinstance(inst.get("server_ip"), str):
            continue
        groups = inst.get("groups")
        if not isinstance(groups, dict):
            groups = {}
        sizes = [
            int(g["block_size"])
            for g in groups.get("kv_cache_groups") or []
            if isinstance(g, dict) and isinstance(g.get("block_size"), int) and g["block_size"] > 0
        ]
        unit = groups.get("hash_unit")
        block = unit if isinstance(unit, int) and unit > 0 else settings.block_size
        span = max([block, *sizes])
        http = inst.get("http")
        http = http.rstrip("/") if isinstance(http, str) else ""
        out.append(Target(inst["server_ip"], http, block, span))
    return out


class Scheduler:
    def __init__(
        self,
        settings: ProberSettings,
        prober: Prober,
        client: httpx.Client,
        metrics: ProberMetrics,
        health: Health | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.s, self.prober, self.http, self.metrics = settings, prober, client, metrics
        self.health = health or Health()
        self.clock = clock
        self._targets: dict[str, Target] = {}
        self._read_at = -float("inf")
        self._last_start: dict[str, float] = {}
        self._running: dict[str, Future[Result]] = {}
        self._api_log = StateLog(logger, f"registry at {settings.api_url}")

    def run(self, stop: threading.Event) -> None:
        beat = self.health.heartbeat("probe loop")
        ready = self.health.condition("registry")
        pool = ThreadPoolExecutor(self.s.concurrency, thread_name_prefix="probe")
        try:
            while not stop.is_set():
                beat.beat()
                self._refresh(ready)
                self._reap()
                self._start(pool)
                beat.wait(stop, TICK_S)
        finally:
            beat.close()
            pool.shutdown(wait=True, cancel_futures=True)
            self._reap()

    def _refresh(self, ready: Any) -> None:
        now = self.clock()
        if now - self._read_at < self.s.interval:
            return
        try:
            resp = self.http.get(f"{self.s.api_url}/kv-cache/instances", timeout=self.s.timeout)
            resp.raise_for_status()
            found = targets(resp.json(), self.s)
        except (httpx.HTTPError, ValueError) as exc:
            self.metrics.errors.inc(kind="instances")
            detail = f"{type(exc).__name__}: {exc}"
            self._api_log.set("down", detail, logging.WARNING)
            ready.set(False, f"GET /kv-cache/instances: {detail}")
            self._read_at = now - self.s.interval + min(self.s.interval, 5.0)  # retry soon
            return
        self._api_log.set("ok")
        ready.set(True)
        self._read_at = now
        self._targets = {t.ip: t for t in found}
        for ip in set(self._last_start) - set(self._targets):
            del self._last_start[ip]
        self.metrics.instances.set(len(self._targets))

    def _start(self, pool: ThreadPoolExecutor) -> None:
        now = self.clock()
        due = sorted(
            (self._last_start.get(ip, -float("inf")), ip)
            for ip in self._targets
            if ip not in self._running
            and now - self._last_start.get(ip, -float("inf")) >= self.s.interval
        )
        for _, ip in due[: max(0, self.s.concurrency - len(self._running))]:
            self._last_start[ip] = now
            self._running[ip] = pool.submit(self._probe, self._targets[ip])
        self.metrics.in_flight.set(len(self._running))

    def _probe(self, target: Target) -> Result:
        started = self.clock()
        try:
            return self.prober.probe(target)
        except Exception as exc:  # the top of a probe: never lose the loop to one probe
            logger.exception("probe of %s failed", target.ip)
            return Result(target.ip, Outcome.API_ERROR, f"internal error: {exc!r}")
        finally:
            self.metrics.probe_seconds.observe(self.clock() - started)

    def _reap(self) -> None:
        for ip, fut in list(self._running.items()):
            if fut.done():
                del self._running[ip]
                if not fut.cancelled():
                    self._record(fut.result())
        self.metrics.in_flight.set(len(self._running))

    def _record(self, r: Result) -> None:
        self.metrics.outcomes.inc(outcome=r.outcome.value)
        level = logging.DEBUG if r.outcome is Outcome.EXACT else logging.WARNING
        logger.log(
            level,
            "probe of %s: %s%s%s",
            r.ip,
            r.outcome.value,
            f" (index {r.predicted}, engine {r.realized} tokens)" if r.realized is not None else "",
            f": {r.detail}" if r.detail else f" [{r.request_id}]",
        )
