"""Buffered recording for :mod:`common.metrics` under prometheus_client's multiprocess mode.

In multiprocess mode every ``inc`` is a locked write into an mmap file (two for a histogram
observation), several times dearer than an in-memory add. The API records three metrics per
request, so its workers buffer instead: a request adds to plain numbers under a lock
(what the earlier hand-written registry cost), and :meth:`Buffers.flush` moves the sums into
prometheus_client's values — from a daemon thread every ``interval`` seconds, before the
worker renders ``/metrics``, and when it exits (gunicorn ``worker_exit``). Another worker's
scrape therefore lags by at most ``interval``; a worker killed with SIGKILL loses at most
its last ``interval`` of counts (its earlier counts stay in its files).
"""

from __future__ import annotations

import logging
import threading
import weakref
from bisect import bisect_left
from typing import Any, Protocol

logger = logging.getLogger(__name__)

FLUSH_INTERVAL = 1.0


class Flushable(Protocol):
    def flush(self) -> None: ...


class BufferedCount:
    """Stands in for a counter child: ``inc`` adds to a pending sum."""

    __slots__ = ("_target", "_lock", "_pending")

    def __init__(self, target: Any) -> None:
        self._target = target
        self._lock = threading.Lock()
        self._pending = 0.0

    def inc(self, amount: float) -> None:
        with self._lock:
            self._pending += amount

    def flush(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, 0.0
        if pending:
            self._target.inc(pending)


class BufferedObserver:
    """Stands in for a histogram child: per-bucket counts and the sum, added on flush.

    prometheus_client has no public call that adds n observations to one bucket, so this
    one uses the child's value objects (``_sum``, ``_buckets``, ``_upper_bounds``), which
    its own ``observe`` increments; without them the histogram is recorded unbuffered
    (tests/unit/test_metrics.py fails then, so an upgrade that moves them is noticed)."""

    __slots__ = ("_sum", "_buckets", "_bounds", "_lock", "_pending_sum", "_pending")

    def __init__(self, child: Any) -> None:
        self._sum, self._buckets = child._sum, child._buckets  # AttributeError: not buffered
        self._bounds = list(child._upper_bounds)
        self._lock = threading.Lock()
        self._pending_sum = 0.0
        self._pending = [0] * len(self._bounds)

    def observe(self, value: float) -> None:
        i = bisect_left(self._bounds, value)  # the first bucket whose bound is >= value
        with self._lock:
            self._pending_sum += value
            self._pending[i] += 1

    def flush(self) -> None:
        with self._lock:
            total, counts = self._pending_sum, self._pending
            self._pending_sum, self._pending = 0.0, [0] * len(self._bounds)
        if any(counts):
            self._sum.inc(total)
            for bucket, n in zip(self._buckets, counts):
                if n:
                    bucket.inc(n)


class Buffers:
    """The buffered series of one registry, and the thread that flushes them."""

    _all: weakref.WeakSet[Buffers] = weakref.WeakSet()

    def __init__(self) -> None:
        self._items: list[Flushable] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        Buffers._all.add(self)

    def add(self, item: Flushable) -> None:
        with self._lock:
            self._items.append(item)

    def flush(self) -> None:
        with self._lock:
            items = list(self._items)
        for item in items:
            item.flush()

    def start(self, interval: float = FLUSH_INTERVAL) -> None:
        threading.Thread(
            target=self._run, args=(interval,), name="metrics-flush", daemon=True
        ).start()

    def _run(self, interval: float) -> None:
        while not self._stop.wait(interval):
            try:
                self.flush()
            except Exception:  # a full disk must not stop the next flush
                logger.exception("cannot flush the buffered metrics")

    def stop(self) -> None:
        self._stop.set()
        self.flush()


def flush_all() -> None:
    """Flush every buffered registry of this process (a gunicorn worker that is exiting)."""
    for buffers in list(Buffers._all):
        buffers.stop()
