"""``cache-indexer l3-poll``: keep every instance's L3 (Mooncake) index by polling masters.

    cache-indexer l3-poll --config FILE [--metrics-port N]

Masters come from the registry that discovery writes (``Store.list_masters``); each one is
polled every ``ingest.l3.pollInterval`` in its own thread (see :mod:`.poller`). SIGTERM or
SIGINT stops the loops; a second signal exits at once.
"""

from __future__ import annotations

import argparse
import logging
import sys
import threading


from common import logs
from common.config import config_path_from, load_config
from common.errors import ConfigError
from common.health import Health
from common.lifecycle import install_signal_handlers
from common.metrics import serve
from common.redis_client import connect
from common.store import Store
from services.l3_poller.metrics import PollerMetrics
from services.l3_poller.poller import L3Poller


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="cache-indexer l3-poll", description=__doc__.split("\n")[0])
    p.add_argument("--config", help="config file (default: $CACHE_INDEXER_CONFIG)")
    p.add_argument("--metrics-port", type=int, default=None, help="Prometheus port (0 = off)")
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    args = _parse(argv)
    try:
        cfg = load_config(config_path_from(args.config))
    except ConfigError as exc:
        print(f"cache-indexer l3-poll: {exc}", file=sys.stderr)
        return 2
    logs.configure(cfg.log.level, cfg.log.format)
    l3 = cfg.ingest.l3
    metrics = PollerMetrics.register()
    health = Health(cfg.metrics.liveness_timeout)
    port = cfg.metrics.port if args.metrics_port is None else args.metrics_port
    if port:
        serve(metrics.registry, cfg.metrics.addr, port, health)
    client = connect(cfg.redis, retries=3)
    logging.getLogger(__name__).info(
        "l3-poll: scope %s, every %gs, stale after %gs, batches of %d keys",
        l3.scope, l3.poll_interval, l3.stale_after, l3.batch_size)
    stop = threading.Event()
    install_signal_handlers(stop)
    poller = L3Poller(l3, cfg.discovery.segments_fetch_timeout, Store(client), metrics,
                      health=health)
    poller.run(stop)
    client.close()
    return 0
