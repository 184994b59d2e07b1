"""Merges every master's latest result into each registered instance's L3 set in Redis.

Masters are polled independently; each successful poll (or a master's state being dropped
or removed) publishes a :class:`MasterView`, and the writer then replaces the L3 set of
*every* registered instance (``Store.replace_l3``: staged and renamed, so readers never
see half a set; an instance with nothing gets an empty set). Writes are serialised by one
lock so two masters' publications cannot interleave and leave an older union behind.

State hash per instance: ``master`` (comma-separated masters it is attached to),
``updated_ms`` (when the oldest of those masters was last polled successfully),
``blocks`` and ``stale`` (``1`` when a master it is attached to was dropped after
``ingest.l3.staleAfter`` without a good poll).
"""

from __future__ import annotations

import logging
import threading
import time
from array import array
from collections.abc import Collection
from dataclasses import dataclass

import redis

from common.lifecycle import StateLog
from common.store import Store
from services.l3_poller.index import Blocks, canonical_ip
from services.l3_poller.metrics import PollerMetrics

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MasterView:
    """What one master contributes: its blocks, the pod IPs with segments on it, when."""

    blocks: Blocks
    attached: frozenset[str]
    polled_ms: int
    stale: bool = False

    def dropped(self) -> MasterView:
        """The view after ``staleAfter``: no blocks, same attachment, flagged stale."""
        return MasterView(Blocks({}, array("Q"), 0), self.attached, self.polled_ms, stale=True)


class L3Writer:
    def __init__(self, store: Store, scope: str, metrics: PollerMetrics) -> None:
        self._store = store
        self._scope = scope
        self._metrics = metrics
        self._lock = threading.Lock()
        self._views: dict[str, MasterView] = {}
        self._owners: dict[str, object] = {}
        self._state = StateLog(logger, "l3 writer")

    def enroll(self, master: str, owner: object) -> None:
        """Accept publications for ``master`` from ``owner`` (its current poll thread) only."""
        with self._lock:
            self._owners[master] = owner

    def publish(self, master: str, view: MasterView, owner: object) -> bool:
        """Record a master's new view and rewrite all instances; ignored (False) when
        ``owner`` no longer polls this master (it was removed while a poll was running)."""
        with self._lock:
            if self._owners.get(master) is not owner:
                return False
            self._views[master] = view
            return self._write_all()

    def retire(self, master: str) -> bool:
        """The master left the registry: forget its blocks and rewrite all instances."""
        with self._lock:
            self._owners.pop(master, None)
            self._views.pop(master, None)
            return self._write_all()

    def _write_all(self) -> bool:
        started = time.monotonic()
        try:
            ips = sorted(self._store.instance_ips())
            fallback = self._pool_fallback({canonical_ip(ip) for ip in ips})
            for ip in ips:
                hashes, state = self._merge(canonical_ip(ip), fallback)
                self._store.replace_l3(ip, hashes, state)
        except redis.RedisError as exc:
            self._metrics.errors.inc(master="", reason="redis")
            self._state.set("failing", repr(exc), logging.WARNING)
            return False
        self._metrics.write_seconds.observe(time.monotonic() - started)
        self._state.set("writing", f"{len(ips)} instances")
        return True

    def _pool_fallback(self, registered: set[str]) -> str | None:
        """Scope pool with a single master that no registered instance has a segment on
        (e.g. vLLM's standalone-store mode, where ranks mount no segment): that master is
        the namespace's only pool, so its blocks count for every instance."""
        if self._scope != "pool" or len(self._views) != 1:
            return None
        (url, view), = self._views.items()
        return None if view.attached & registered else url

    def _merge(self, ip: str, fallback: str | None) -> tuple[Collection[int], dict[str, str]]:
        parts: list[array[int]] = []
        masters: list[str] = []
        polled: list[int] = []
        stale = False
        for url, view in self._views.items():
            if self._scope == "pool":
                mine = ip in view.attached or url == fallback
                hashes = view.blocks.pool if mine else None
            else:
                hashes = view.blocks.per_ip.get(ip)
                mine = ip in view.attached or hashes is not None
            if not mine:
                continue
            masters.append(url)
            polled.append(view.polled_ms)
            stale |= view.stale
            if hashes:
                parts.append(hashes)
        merged: Collection[int] = parts[0] if len(parts) == 1 else set().union(*parts)
        state = {
            "master": ",".join(masters),
            "updated_ms": str(min(polled) if polled else int(time.time() * 1000)),
            "blocks": str(len(merged)),
            "stale": "1" if stale else "0",
        }
        return merged, state
