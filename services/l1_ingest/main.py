"""``cache-indexer l1-ingest``: keep the L1 (GPU) index of this process's vLLM instances exact.

    cache-indexer l1-ingest --config FILE [--shard i --shards N] [--metrics-port N] [--id ID]

``--shards`` selects static sharding (``ingest.l1.shardMode: static``); otherwise live
ingesters share the instances through Redis leases. The subscriber runs in its own thread;
the main thread re-reads the registry every second (heartbeat and lease renewal included).
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import threading
import uuid

import redis

from common import logs
from common.blockhash import HashSettings
from common.config import Config, config_path_from, load_config
from common.errors import ConfigError
from common.health import Health
from common.lifecycle import Backoff, install_signal_handlers
from common.metrics import serve
from common.redis_client import connect
from common.store import Store
from services.l1_ingest.metrics import IngestMetrics
from services.l1_ingest.sharding import Assigner, LeaseAssigner, StaticAssigner, run_assignment
from services.l1_ingest.subscriber import Subscriber


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="cache-indexer l1-ingest", description=__doc__.split("\n")[0])
    p.add_argument("--config", help="config file (default: $CACHE_INDEXER_CONFIG)")
    p.add_argument("--shard", type=int, default=None, help="static shard index i (0-based)")
    p.add_argument("--shards", type=int, default=None, help="static shard count N")
    p.add_argument("--metrics-port", type=int, default=None, help="Prometheus port (0 = off)")
    p.add_argument("--id", default="", help="ingester id (default: host-pid-random)")
    return p.parse_args(argv)


def _load(args: argparse.Namespace) -> tuple[Config, bool, int, int]:
    """The config, whether sharding is static, and this process's shard i of N."""
    cfg = load_config(config_path_from(args.config))
    static = args.shards is not None or cfg.ingest.l1.shard_mode == "static"
    shard, shards = args.shard or 0, args.shards or 1
    if not 0 <= shard < shards:
        raise ConfigError(f"--shard {shard} is not in [0, --shards {shards})")
    return cfg, static, shard, shards


def main(argv: list[str]) -> int:
    args = _parse(argv)
    try:
        cfg, static, shard, shards = _load(args)
    except ConfigError as exc:
        print(f"cache-indexer l1-ingest: {exc}", file=sys.stderr)
        return 2
    logs.configure(cfg.log.level, cfg.log.format)
    l1 = cfg.ingest.l1
    bk = cfg.block_key
    try:
        settings = HashSettings.from_strings(bk.prefix_caching_hash_algo, bk.python_hash_seed,
                                             bk.vllm_version)
    except ConfigError as exc:
        print(f"cache-indexer l1-ingest: {exc}", file=sys.stderr)
        return 2
    metrics = IngestMetrics()
    health = Health(cfg.metrics.liveness_timeout)
    port = cfg.metrics.port if args.metrics_port is None else args.metrics_port
    if port:
        serve(metrics.registry, cfg.metrics.addr, port, health)
    client = connect(cfg.redis, retries=3)
    store = Store(client)
    ingester_id = args.id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    assigner: Assigner = (StaticAssigner(shard, shards) if static
                          else LeaseAssigner(store, ingester_id, l1.lease_ttl))
    logging.getLogger(__name__).info(
        "l1-ingest %s: %s", ingester_id,
        f"static shard {shard}/{shards}" if static else f"lease mode, ttl {l1.lease_ttl}s")
    stop = threading.Event()
    install_signal_handlers(stop)
    subscriber = Subscriber(store, l1, metrics, owner=assigner.owner, health=health,
                            hash_settings=settings, ingester=ingester_id)
    thread = threading.Thread(target=subscriber.run, args=(stop,), name="subscriber")
    thread.start()
    interval = 1.0 if static else min(1.0, l1.heartbeat_interval)
    try:
        run_assignment(stop, store, assigner, subscriber.set_instances, interval=interval,
                       backoff=Backoff(l1.backoff_initial, l1.backoff_max), health=health)
    finally:
        stop.set()
        thread.join()
        try:
            assigner.leave()
        except redis.RedisError:
            pass  # the leases expire on their own
    return 0
