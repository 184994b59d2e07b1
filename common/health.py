"""Liveness and readiness of a worker process, answered on its metrics port.

**Liveness** (``/healthz``): each loop that must keep going takes a :class:`Heartbeat`
(:meth:`Health.heartbeat`) and calls :meth:`~Heartbeat.beat` on every iteration; before a
planned wait it calls :meth:`~Heartbeat.wait`, which announces the wait so it does not count
as a stall. The process is live while every registered loop has beaten within the liveness
timeout (``metrics.livenessTimeout``) plus the wait it announced. A loop stuck in a call (a
Redis command without a timeout, a deadlock, a hung read) stops beating, ``/healthz``
answers 503 naming it, and the kubelet restarts the pod: a stuck thread cannot be
recovered from inside the process. The HTTP server runs in its own threads, so it still
answers while a loop is stuck. A loop that ends on purpose calls :meth:`~Heartbeat.close`.

**Readiness** (``/readyz``): named conditions (:meth:`Health.condition`) that the loops set
from what they just did, e.g. ``redis`` after each registry read. Ready = live and every
condition holds; a condition starts as "not yet" until its first :meth:`Condition.set`.
The probes never do I/O themselves: answering from the loops' own outcomes keeps a probe
fast and means "ready" reports what the worker actually achieved.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

Clock = Callable[[], float]


class Heartbeat:
    """One loop's progress marker; see the module docstring."""

    def __init__(self, health: Health, name: str) -> None:
        self.name = name
        self._health = health
        self.last = self.deadline = 0.0
        self.beat()

    def beat(self, allow: float = 0.0) -> None:
        """Progress now; the next beat is due within the timeout plus ``allow`` seconds."""
        self.last = self._health.clock()
        self.deadline = self.last + self._health.timeout + max(allow, 0.0)

    def wait(self, event: threading.Event, seconds: float) -> bool:
        """``event.wait(seconds)`` announced as a planned wait; returns what it returned."""
        self.beat(seconds)
        woke = event.wait(max(seconds, 0.0))
        self.beat()
        return woke

    def close(self) -> None:
        """The loop has ended on purpose: stop watching it."""
        self._health.remove(self)


class Condition:
    """One readiness condition; starts not ready."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.ok = False
        self.reason = "not checked yet"

    def set(self, ok: bool, reason: str = "") -> None:
        self.ok, self.reason = ok, reason


class Health:
    """The heartbeats and readiness conditions of one process."""

    def __init__(self, timeout: float = 60.0, clock: Clock = time.monotonic) -> None:
        self.timeout = timeout
        self.clock = clock
        self._lock = threading.Lock()
        self._beats: list[Heartbeat] = []
        self._conditions: list[Condition] = []

    def heartbeat(self, name: str) -> Heartbeat:
        hb = Heartbeat(self, name)
        with self._lock:
            self._beats.append(hb)
        return hb

    def remove(self, hb: Heartbeat) -> None:
        with self._lock:
            if hb in self._beats:
                self._beats.remove(hb)

    def condition(self, name: str) -> Condition:
        cond = Condition(name)
        with self._lock:
            self._conditions.append(cond)
        return cond

    def liveness(self) -> tuple[bool, str]:
        """(live, text): not live while a loop is past its deadline."""
        now = self.clock()
        with self._lock:
            late = [
                f"{hb.name} (no progress for {now - hb.last:.0f}s)"
                for hb in self._beats
                if now > hb.deadline
            ]
        if late:
            return False, "stalled: " + ", ".join(late)
        return True, "ok"

    def conditions(self) -> list[tuple[str, bool]]:
        """(name, holds) of every readiness condition, in registration order."""
        with self._lock:
            return [(c.name, c.ok) for c in self._conditions]

    def readiness(self) -> tuple[bool, str]:
        """(ready, text): live and every condition holds."""
        live, text = self.liveness()
        if not live:
            return False, text
        with self._lock:
            failing = [f"{c.name}: {c.reason}" for c in self._conditions if not c.ok]
        if failing:
            return False, "not ready: " + "; ".join(failing)
        return True, "ok"
