"""Which registered vLLM instances this ingester subscribes to.

Two modes (``ingest.l1.shardMode``):

* ``static`` — ``--shard i --shards N``: an instance belongs to shard ``fnv1a64(ip) % N``.
  No coordination; the operator runs exactly one process per shard. Writes are fenced by
  the instance generation only.
* ``lease`` (default) — every live ingester heartbeats into Redis (TTL ``leaseTTL``); an
  instance is assigned to the live ingester with the highest rendezvous score
  ``fnv1a64(ingester_id + "|" + ip)``, so adding or losing an ingester moves only the
  instances it gains or held. The assignee must also hold the instance's owner lease
  (renewed every ``heartbeatInterval``) before it subscribes, and passes its id to every
  write: a process that lost the lease can no longer write (the store refuses it). When an
  ingester dies, its heartbeat and leases expire after ``leaseTTL`` and the survivors take
  its instances on their next round.

FNV-1a is used because Python's ``hash()`` is randomised per process.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from typing import Protocol

import redis

from common.health import Health
from common.lifecycle import Backoff
from common.store import Instance

logger = logging.getLogger(__name__)


class Registry(Protocol):
    """What the assignment loop reads of :class:`common.store.Store`."""

    def list_instances(self) -> list[Instance]: ...


class Leases(Protocol):
    """Lease mode's role of :class:`common.store.Store`: the heartbeat and instance leases."""

    def heartbeat_ingester(self, ingester_id: str, ttl_ms: int) -> list[str]: ...
    def leave_ingesters(self, ingester_id: str) -> None: ...
    def claim_instance(self, ip: str, holder: str, ttl_ms: int) -> bool: ...
    def release_instance(self, ip: str, holder: str) -> bool: ...


_FNV_OFFSET = 0xCBF29CE484222325
_FNV_PRIME = 0x100000001B3
_U64 = (1 << 64) - 1


def fnv1a64(data: str | bytes) -> int:
    """64-bit FNV-1a of a string's UTF-8 bytes (stable across processes and platforms)."""
    raw = data.encode() if isinstance(data, str) else data
    h = _FNV_OFFSET
    for byte in raw:
        h = ((h ^ byte) * _FNV_PRIME) & _U64
    return h


def static_shard(ip: str, shards: int) -> int:
    return fnv1a64(ip) % shards


def rendezvous_owner(ip: str, ingesters: Iterable[str]) -> str | None:
    """The ingester with the highest score for ``ip`` (ties broken by id); None if none live."""
    best: tuple[int, str] | None = None
    for ingester in ingesters:
        score = (_mix(fnv1a64(f"{ingester}|{ip}")), ingester)
        if best is None or score > best:
            best = score
    return None if best is None else best[1]


def _mix(h: int) -> int:
    """A 64-bit finaliser (splitmix64) so that ids differing in the last byte spread evenly."""
    h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & _U64
    h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & _U64
    return h ^ (h >> 31)


class StaticAssigner:
    """``--shard i --shards N``: keep the instances whose IP hashes to shard i."""

    owner = ""

    def __init__(self, shard: int, shards: int) -> None:
        self.shard, self.shards = shard, shards

    def assign(self, instances: list[Instance]) -> dict[str, Instance]:
        return {i.ip: i for i in instances if static_shard(i.ip, self.shards) == self.shard}

    def leave(self) -> None:
        pass


class LeaseAssigner:
    """Lease mode: heartbeat, rendezvous over live ingesters, hold owner leases."""

    def __init__(self, store: Leases, ingester_id: str, lease_ttl: float) -> None:
        self.store = store
        self.owner = ingester_id
        self.ttl_ms = max(1, int(lease_ttl * 1000))
        self.held: set[str] = set()

    def assign(self, instances: list[Instance]) -> dict[str, Instance]:
        """One round: heartbeat, then claim (or renew) the leases of our rendezvous share."""
        live = self.store.heartbeat_ingester(self.owner, self.ttl_ms)
        if self.owner not in live:  # our own heartbeat is always there; be defensive
            live.append(self.owner)
        mine = {i.ip: i for i in instances if rendezvous_owner(i.ip, live) == self.owner}
        for ip in sorted(self.held - mine.keys()):
            self.store.release_instance(ip, self.owner)
            logger.info("released instance %s (assigned elsewhere or gone)", ip)
        held: set[str] = set()
        for ip in sorted(mine):
            if self.store.claim_instance(ip, self.owner, self.ttl_ms):
                if ip not in self.held:
                    logger.info("took instance %s (%d live ingesters)", ip, len(live))
                held.add(ip)
            elif ip in self.held:
                logger.warning("lost the lease of instance %s", ip)
        self.held = held
        return {ip: mine[ip] for ip in held}

    def leave(self) -> None:
        """Warm shutdown: give up every lease and the heartbeat so others take over now."""
        for ip in sorted(self.held):
            self.store.release_instance(ip, self.owner)
        self.held = set()
        self.store.leave_ingesters(self.owner)


class Assigner(Protocol):
    owner: str

    def assign(self, instances: list[Instance]) -> dict[str, Instance]: ...

    def leave(self) -> None: ...


def run_assignment(
    stop: threading.Event,
    store: Registry,
    assigner: Assigner,
    publish: Callable[[dict[str, Instance]], None],
    *,
    interval: float,
    backoff: Backoff,
    health: Health | None = None,
) -> None:
    """Every ``interval``: re-read the registry, decide this process's share, publish it.
    Beats ``health`` once per round; ready while the registry was last read."""
    health = health or Health()
    beat, ready = health.heartbeat("assignment loop"), health.condition("redis")
    failing = False
    while not stop.is_set():
        try:
            publish(assigner.assign(store.list_instances()))
            delay = interval
            if failing:
                logger.info("registry reachable again")
            failing = False
            ready.set(True)
            backoff.reset()
        except redis.RedisError as exc:
            delay = backoff.next_delay()
            logger.warning("cannot read the registry (%s); retrying in %.1fs", exc, delay)
            failing = True
            ready.set(False, f"cannot read the registry: {type(exc).__name__}: {exc}")
        beat.wait(stop, delay)
    beat.close()
