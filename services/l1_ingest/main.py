"""``cache-indexer l1-ingest``: keep the L1 (GPU) index of this process's vLLM instances exact.

    cache-indexer l1-ingest --config FILE [--shard i --shards N] [--metrics-port N] [--id ID]

``--shards`` selects static sharding (``ingest.l1.shardMode: static``); otherwise live
ingesters share the instances through Redis leases. The subscriber runs in its own thread;
the main thread re-reads the registry every second (heartbeat and lease renewal included).
The process frame (flags, config, logging, signals, metrics endpoint, Redis) is
:mod:`common.shell`.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import threading
import uuid
from dataclasses import dataclass

import redis

from common import shell
from common.config import Config
from common.errors import ConfigError
from common.lifecycle import Backoff
from common.settings import L1IngestSettings
from common.store import Store
from services.l1_ingest.metrics import IngestMetrics
from services.l1_ingest.sharding import Assigner, LeaseAssigner, StaticAssigner, run_assignment
from services.l1_ingest.subscriber import Subscriber

_PROG = "cache-indexer l1-ingest"


@dataclass(frozen=True)
class _Setup:
    l1: L1IngestSettings
    static: bool
    shard: int
    shards: int
    ingester_id: str


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shard", type=int, default=None, help="static shard index i (0-based)")
    p.add_argument("--shards", type=int, default=None, help="static shard count N")
    p.add_argument("--id", default="", help="ingester id (default: host-pid-random)")


def _settings(cfg: Config, args: argparse.Namespace) -> _Setup:
    """The settings, whether sharding is static, and this process's shard i of N."""
    l1 = L1IngestSettings.from_config(cfg)
    shard, shards = args.shard or 0, args.shards or 1
    if not 0 <= shard < shards:
        raise ConfigError(f"--shard {shard} is not in [0, --shards {shards})")
    ingester_id = args.id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    return _Setup(
        l1, args.shards is not None or l1.shard_mode == "static", shard, shards, ingester_id
    )


def _leave(assigner: Assigner) -> None:
    try:
        assigner.leave()
    except redis.RedisError:
        pass  # the leases expire on their own


def _run(proc: shell.Process[_Setup]) -> None:
    s, l1 = proc.settings, proc.settings.l1
    metrics = IngestMetrics(proc.registry)
    store = Store(proc.redis())
    assigner: Assigner = (
        StaticAssigner(s.shard, s.shards)
        if s.static
        else LeaseAssigner(store, s.ingester_id, l1.lease_ttl)
    )
    proc.on_exit(lambda: _leave(assigner))
    logging.getLogger(__name__).info(
        "l1-ingest %s: %s",
        s.ingester_id,
        f"static shard {s.shard}/{s.shards}" if s.static else f"lease mode, ttl {l1.lease_ttl}s",
    )
    subscriber = Subscriber(
        store, l1, metrics, owner=assigner.owner, health=proc.health, ingester=s.ingester_id
    )
    thread = threading.Thread(target=subscriber.run, args=(proc.stop,), name="subscriber")
    thread.start()
    proc.on_exit(thread.join)
    proc.on_exit(proc.stop.set)  # runs first: the subscriber stops, then the leases go
    interval = 1.0 if s.static else min(1.0, l1.heartbeat_interval)
    run_assignment(
        proc.stop,
        store,
        assigner,
        subscriber.set_instances,
        interval=interval,
        backoff=Backoff(l1.backoff_initial, l1.backoff_max),
        health=proc.health,
    )


def main(argv: list[str]) -> int:
    return shell.run_worker(
        _PROG, __doc__.split("\n")[0], argv, translate=_settings, run=_run, arguments=_arguments
    )
