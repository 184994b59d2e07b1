"""``cache-indexer l3-poll``: keep every instance's L3 (Mooncake) index by polling masters.

    cache-indexer l3-poll --config FILE [--metrics-port N]

Masters come from the registry that discovery writes (``Store.list_masters``); each one is
polled every ``ingest.l3.pollInterval`` in its own thread (see :mod:`.poller`). SIGTERM or
SIGINT stops the loops; a second signal exits at once. The process frame (flags, config,
logging, signals, metrics endpoint, Redis) is :mod:`common.shell`.
"""

from __future__ import annotations

import argparse
import logging

from common import shell
from common.config import Config
from common.settings import L3PollerSettings
from common.store import Store
from services.l3_poller.metrics import PollerMetrics
from services.l3_poller.poller import L3Poller

_PROG = "cache-indexer l3-poll"


def _settings(cfg: Config, _args: argparse.Namespace) -> L3PollerSettings:
    return L3PollerSettings.from_config(cfg)


def _run(proc: shell.Process[L3PollerSettings]) -> None:
    l3 = proc.settings
    metrics = PollerMetrics.register(proc.registry)
    store = Store(proc.redis())
    logging.getLogger(__name__).info(
        "l3-poll: scope %s, every %gs, stale after %gs, batches of %d keys",
        l3.scope,
        l3.poll_interval,
        l3.stale_after,
        l3.batch_size,
    )
    L3Poller(l3, store, metrics, health=proc.health).run(proc.stop)


def main(argv: list[str]) -> int:
    return shell.run_worker(_PROG, __doc__.split("\n")[0], argv, translate=_settings, run=_run)
