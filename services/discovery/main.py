"""``cache-indexer discovery``: keep the registry of vLLM instances and Mooncake masters in Redis.

One process (or two during a rolling update: the lease lets one write at a time). The
source is Kubernetes (default; :mod:`services.discovery.kube`) or the config file's static
lists (:mod:`services.discovery.static`); :mod:`services.discovery.reconcile` writes.
Metrics (``metrics.port`` or ``--metrics-port``; 0 = off) are listed in
:mod:`services.discovery.metrics`. Exit status: 0 after SIGTERM/SIGINT (the lease is
released, the registry is left as it is), 2 for a bad config or command line.
"""

from __future__ import annotations

import argparse
import os
import secrets
import socket
import sys
import threading


from common import logs
from common.config import Config, config_path_from, load_config
from common.errors import ConfigError
from common.health import Health
from common.lifecycle import Backoff, install_signal_handlers
from common.metrics import Registry, serve
from common.redis_client import connect
from common.store import Store
from services.discovery.metrics import DiscoveryMetrics
from services.discovery.pods import label_problems
from services.discovery.reconcile import Reconciler, Source, run

_PROG = "cache-indexer discovery"


def build_source(cfg: Config, path: str | None, metrics: DiscoveryMetrics) -> Source:
    """The configured source; ConfigError when it cannot be set up."""
    if cfg.discovery.mode == "static":
        from services.discovery.static import StaticSource

        return StaticSource(path, cfg, metrics)
    if problems := label_problems(cfg.discovery.labels):
        raise ConfigError("invalid config: " + "; ".join(problems))
    from services.discovery.kube import KubeSource, connect

    api_client, namespace = connect(cfg.discovery, os.environ)
    return KubeSource(api_client, namespace, cfg, metrics)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog=_PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", help="config file (default: $CACHE_INDEXER_CONFIG)")
    parser.add_argument("--metrics-port", type=int, help="serve /metrics here (0 = off)")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse has printed usage or help already
        return 0 if exc.code == 0 else 2
    path = config_path_from(args.config)
    registry = Registry()
    metrics = DiscoveryMetrics.register(registry)
    try:
        cfg = load_config(path)
        logs.configure(cfg.log.level, cfg.log.format)
        source = build_source(cfg, path, metrics)
    except ConfigError as exc:
        print(f"{_PROG}: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()
    install_signal_handlers(stop)
    health = Health(cfg.metrics.liveness_timeout)
    port = cfg.metrics.port if args.metrics_port is None else args.metrics_port
    if port:
        serve(registry, cfg.metrics.addr, port, health)
    client = connect(cfg.redis, retries=3)
    holder = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
    reconciler = Reconciler(Store(client), holder, cfg.discovery.lease_ttl, metrics)
    l1 = cfg.ingest.l1
    run(source, reconciler, stop, Backoff(l1.backoff_initial, l1.backoff_max), health)
    client.close()
    return 0
