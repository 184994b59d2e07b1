"""Merges every master's latest result into each registered instance's L3 set in Redis.

Masters are polled independently; each successful poll (or a master's state being dropped
or removed) publishes a :class:`MasterView`, and the writer then replaces the L3 set of
every registered instance **whose content or state changed** (``Store.replace_l3``: staged
and renamed, so readers never see half a set; an instance with nothing gets an empty set).
"Changed" is decided without touching Redis: per instance the writer remembers the
generation, masters, stale flag and the blake2b digest of each master's (sorted) part of
each KV-cache group it last wrote (a group that appears or disappears changes that list);
a new generation, a failed write (Redis error, refused) or :data:`REWRITE_AFTER` forces a
rewrite. In scope pool every attached instance's set is the whole pool, so
skipping unchanged sets is what keeps steady-state polls from re-adding the pool N times.
Writes are serialised by one lock so two masters' publications cannot interleave and leave
an older union behind.

KV-cache groups are separate sets: an instance whose blocks are all of group 0 is written as
before (``Store.replace_l3`` with a plain collection: ``ci:{ip}:l3``); one with blocks of
other groups too gets a mapping group → blocks (group 0 always in it; groups without a
block are left out, so the store deletes their sets).

State hash per instance, written with the set: ``master`` (comma-separated masters it is
attached to), ``updated_ms`` (when the oldest of those masters had last been polled
successfully; refreshed on every poll, also when the set itself is unchanged and not
rewritten), ``blocks`` (members of all its group sets) and ``stale`` (``1`` when a master it
is attached to was dropped after ``ingest.l3.staleAfter`` without a good poll); the store
adds ``groups``.

Each master's poll status (``ci:master:{<url>}:state``) is written here too (:meth:`report`,
after every poll attempt, only by the master's current poller) and deleted by :meth:`retire`.
"""

from __future__ import annotations

import logging
import threading
import time
from array import array
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import redis

from common.lifecycle import StateLog
from common.store import Instance
from services.l3_poller.index import Blocks, canonical_ip
from services.l3_poller.metrics import PollerMetrics

logger = logging.getLogger(__name__)


class L3Writes(Protocol):
    """The writer's role of :class:`common.store.Store`: the L3 sets and the master states."""

    def list_instances(self) -> list[Instance]: ...

    def replace_l3(
        self,
        ip: str,
        hashes: Iterable[int] | Mapping[int, Iterable[int]],
        state: dict[str, str] | None = None,
        gen: int | None = None,
    ) -> bool: ...

    def touch_l3_state(self, ip: str, state: dict[str, str], gen: int) -> bool: ...
    def set_master_state(self, url: str, state: dict[str, str]) -> None: ...
    def drop_master_state(self, url: str) -> None: ...


Part = tuple[str, int, bytes, "array[int]"]
"""What one master gives an instance in one KV-cache group: (url, group, digest, hashes)."""

REWRITE_AFTER = 600.0
"""Seconds after which an unchanged set is written again anyway: a safety net bounding how
long a set that Redis lost behind our back (e.g. a manual DEL) stays lost. A Redis that
restarts empty is already covered: re-registration gives every instance a new generation."""


@dataclass(frozen=True)
class MasterView:
    """What one master contributes: its blocks, the pod IPs with segments on it, when."""

    blocks: Blocks
    attached: frozenset[str]
    polled_ms: int
    stale: bool = False
    gens: Mapping[str, int] = field(default_factory=dict)
    """Each registered instance's generation when the poll began (canonical IP → gen)."""

    def dropped(self) -> MasterView:
        """The view after ``staleAfter``: no blocks, same attachment, flagged stale."""
        return MasterView(
            Blocks({}, array("Q"), 0), self.attached, self.polled_ms, stale=True, gens=self.gens
        )


class L3Writer:
    def __init__(self, store: L3Writes, scope: str, metrics: PollerMetrics) -> None:
        self._store = store
        self._scope = scope
        self._metrics = metrics
        self._lock = threading.Lock()
        self._views: dict[str, MasterView] = {}
        self._owners: dict[str, object] = {}
        self._state = StateLog(logger, "l3 writer")
        self._written: dict[str, tuple[object, float]] = {}
        """Registered IP → (what was last written: gen, masters, stale, part digests; when)."""

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
        """The master left the registry: forget its blocks and status, rewrite all instances."""
        with self._lock:
            self._owners.pop(master, None)
            self._views.pop(master, None)
            try:
                self._store.drop_master_state(master)
            except redis.RedisError as exc:
                self._metrics.errors.inc(master=master, reason="redis")
                logger.warning("master %s: cannot delete its status: %r", master, exc)
            return self._write_all()

    def report(self, master: str, state: dict[str, str], owner: object) -> bool:
        """Write a master's poll status (``ci:master:{url}:state``); ignored when ``owner``
        no longer polls it, so a retired master's status is not written back."""
        with self._lock:
            if self._owners.get(master) is not owner:
                return False
            try:
                self._store.set_master_state(master, state)
            except redis.RedisError as exc:
                self._metrics.errors.inc(master=master, reason="redis")
                self._state.set("failing", repr(exc), logging.WARNING)
                return False
            return True

    def generations(self) -> dict[str, int]:
        """Registered instances' generations (canonical IP → gen), taken when a poll begins."""
        return {canonical_ip(i.ip): i.gen for i in self._store.list_instances()}

    def _write_all(self) -> bool:
        started = time.monotonic()
        written = 0
        try:
            instances = self._store.list_instances()
            fallback = self._pool_fallback({canonical_ip(i.ip) for i in instances})
            for inst in instances:
                parts, masters, polled, stale = self._parts(
                    canonical_ip(inst.ip), inst.gen, fallback
                )
                mark = (inst.gen, masters, stale, tuple(p[:3] for p in parts))
                last = self._written.pop(inst.ip, None)
                if last is not None and last[0] == mark and started - last[1] < REWRITE_AFTER:
                    self._written[inst.ip] = last  # same gen, masters, flag and content
                    if polled:
                        self._store.touch_l3_state(
                            inst.ip, {"updated_ms": str(min(polled))}, inst.gen
                        )
                    continue
                hashes, state = self._merge(parts, masters, polled, stale)
                if self._store.replace_l3(inst.ip, hashes, state, gen=inst.gen):
                    self._written[inst.ip] = (mark, started)
                written += 1
        except redis.RedisError as exc:
            self._written.clear()  # whatever Redis holds now, the next write redoes it all
            self._metrics.errors.inc(master="", reason="redis")
            self._state.set("failing", repr(exc), logging.WARNING)
            return False
        for ip in self._written.keys() - {i.ip for i in instances}:
            del self._written[ip]
        self._metrics.write_seconds.observe(time.monotonic() - started)
        self._metrics.sets_written.inc(written)
        self._state.set("writing", f"{len(instances)} instances")
        return True

    def _pool_fallback(self, registered: set[str]) -> str | None:
        """Scope pool with a single master that no registered instance has a segment on
        (e.g. vLLM's standalone-store mode, where ranks mount no segment): that master is
        the namespace's only pool, so its blocks count for every instance."""
        if self._scope != "pool" or len(self._views) != 1:
            return None
        ((url, view),) = self._views.items()
        return None if view.attached & registered else url

    def _parts(
        self, ip: str, gen: int, fallback: str | None
    ) -> tuple[list[Part], tuple[str, ...], list[int], bool]:
        """What each master gives ``ip``: (url, group, digest, hashes) per non-empty part,
        the masters it is attached to, when they were polled, and whether one was dropped."""
        parts: list[Part] = []
        masters: list[str] = []
        polled: list[int] = []
        stale = False
        pool = self._scope == "pool"
        for url, view in self._views.items():
            if view.gens.get(ip) != gen:
                continue  # polled for an earlier pod on this IP (or before it registered)
            blocks = view.blocks
            if pool:
                mine = ip in view.attached or url == fallback
            else:
                mine = (
                    ip in view.attached
                    or ip in blocks.per_ip
                    or any(ip in b.per_ip for b in blocks.groups.values())
                )
            if not mine:
                continue
            masters.append(url)
            polled.append(view.polled_ms)
            stale |= view.stale
            for group, b in blocks.by_group():
                hashes = b.pool if pool else b.per_ip.get(ip)
                if hashes:
                    parts.append((url, group, b.digest(None if pool else ip), hashes))
        return parts, tuple(masters), polled, stale

    @staticmethod
    def _merge(
        parts: list[Part], masters: tuple[str, ...], polled: list[int], stale: bool
    ) -> tuple[Collection[int] | dict[int, Collection[int]], dict[str, str]]:
        """The instance's blocks — group 0's collection when it has no other group, else
        group → blocks — and its state hash."""
        by_group: dict[int, list[array[int]]] = {0: []}
        for _, group, _, hashes in parts:
            by_group.setdefault(group, []).append(hashes)
        merged = {
            group: arrays[0] if len(arrays) == 1 else set().union(*arrays)
            for group, arrays in by_group.items()
        }
        state = {
            "master": ",".join(masters),
            "updated_ms": str(min(polled) if polled else int(time.time() * 1000)),
            "blocks": str(sum(len(m) for m in merged.values())),
            "stale": "1" if stale else "0",
        }
        return (merged[0] if len(merged) == 1 else merged), state
