"""The store's reads for the status view (:mod:`common.status_report`): one place for the
readers of the registry, the ingesters' heartbeats and every instance's and master's state.

:class:`StatusReader` reads everything in **one pipelined round trip** in steady state: the
registry (``ci:instances``, ``ci:masters``), the live ingesters, Redis ``TIME`` and, for
every instance and master it already knows, their status hashes. Registry members it did not
know yet (new since this reader's previous call) cost one more round trip for those members
only. No Lua: the reads stay valid on a Redis Cluster, whose pipelines refuse ``TIME``: there
it is one more call, to one node (tests/integration/test_status_cluster.py). The keys are
:mod:`common.keys`'.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import redis

from common import keys
from common.redis_client import Client, text, text_dict

_PER_IP = ("meta", "l1", "owner", "blocks", "l3", "groups")


@dataclass
class Raw:
    """What one read returned (text, decoded)."""

    now_ms: int
    ingesters: dict[str, int]
    instances: dict[str, dict[str, Any]] = field(default_factory=dict)
    masters: dict[str, dict[str, str]] = field(default_factory=dict)


class StatusReader:
    """Reads :class:`Raw` for one process; remembers the registry it saw last time."""

    def __init__(self, client: Client) -> None:
        self.r = client
        self._ips: list[str] = []
        self._urls: list[str] = []

    def memory(self) -> tuple[float, float]:
        """Redis ``used_memory`` and ``maxmemory`` (``INFO memory``), summed over a
        cluster's nodes; raises what the client raises (``ResponseError``: INFO refused)."""
        info = self.r.info("memory")
        # A cluster client answers {node: {field: value}}, a single server {field: value}.
        nodes = (
            [info] if "used_memory" in info else [v for v in info.values() if isinstance(v, dict)]
        )
        used = sum(float(n.get("used_memory", 0)) for n in nodes)
        return used, sum(float(n.get("maxmemory", 0)) for n in nodes)

    def read(self) -> Raw:
        cluster = not isinstance(self.r, redis.Redis)
        pipe = self.r.pipeline(transaction=False)
        if not cluster:
            pipe.time()
        pipe.smembers(keys.INSTANCES)
        pipe.hkeys(keys.MASTERS)
        pipe.zrange(keys.INGESTERS, 0, -1, withscores=True)
        self._queue(pipe, self._ips, self._urls)
        replies = pipe.execute()
        if cluster:  # a cluster pipeline refuses TIME (redis-py): it is asked of one node
            replies.insert(0, self.r.time())
        (sec, usec), ips, urls, live = replies[:4]
        raw = Raw(int(sec) * 1000 + int(usec) // 1000, {text(m): int(score) for m, score in live})
        ips, urls = sorted(map(text, ips)), sorted(map(text, urls))
        self._collect(raw, self._ips, self._urls, replies[4:])
        new_ips = [ip for ip in ips if ip not in raw.instances]
        new_urls = [u for u in urls if u not in raw.masters]
        if new_ips or new_urls:  # registry grew since the last call: one more round trip
            pipe = self.r.pipeline(transaction=False)
            self._queue(pipe, new_ips, new_urls)
            self._collect(raw, new_ips, new_urls, pipe.execute())
        raw.instances = {ip: raw.instances[ip] for ip in ips if raw.instances[ip]["meta"]}
        raw.masters = {u: raw.masters[u] for u in urls}
        self._ips, self._urls = ips, urls
        return raw

    @staticmethod
    def _queue(pipe: Any, ips: list[str], urls: list[str]) -> None:
        for ip in ips:
            pipe.hgetall(keys.instance_meta(ip))
            pipe.hgetall(keys.l1_state(ip))
            pipe.get(keys.l1_owner(ip))
            pipe.scard(keys.tier_set(ip, "l1"))
            pipe.hgetall(keys.l3_state(ip))
            pipe.hgetall(keys.l1_groups(ip))
        for url in urls:
            pipe.hgetall(keys.master_state(url))

    @staticmethod
    def _collect(raw: Raw, ips: list[str], urls: list[str], replies: list[Any]) -> None:
        n = len(_PER_IP)
        for i, ip in enumerate(ips):
            values = replies[i * n : (i + 1) * n]
            raw.instances[ip] = {
                name: (text_dict(v) if isinstance(v, dict) else v)
                for name, v in zip(_PER_IP, values, strict=True)
            }
            owner = raw.instances[ip]["owner"]
            raw.instances[ip]["owner"] = None if owner is None else text(owner)
        for j, url in enumerate(urls):
            raw.masters[url] = text_dict(replies[len(ips) * n + j])
