"""``cache-indexer audit-probe``: the active prediction audit (``audit.probe``, off by default).

    cache-indexer audit-probe --config FILE [--metrics-port N]

Sends every registered vLLM instance (its OpenAI-compatible port, from discovery) a tiny
fresh prompt with the prober's own ``cache_salt``, waits until the index shows its blocks,
asks the hit-rate API (with a ``request_id``), sends the prompt again and reports the
engine's ``cached_tokens`` to ``POST /kv-cache/outcome`` (:mod:`.probe`), at most once per
instance per ``audit.probe.interval`` with ``concurrency`` probes at once (:mod:`.scheduler`).
It talks only HTTP (the API and the engines), never Redis. With ``audit.probe.enabled:
false`` it idles (ready, nothing probed), so a chart may run it switched off. Metrics:
:mod:`.metrics`. The process frame (flags, config, logging, signals, metrics endpoint) is
:mod:`common.shell`.
"""

from __future__ import annotations

import argparse
import logging

import httpx

from common import shell
from common.config import Config
from common.settings import ProberSettings
from services.prober.metrics import ProberMetrics
from services.prober.probe import Prober
from services.prober.scheduler import Scheduler

_PROG = "cache-indexer audit-probe"
logger = logging.getLogger(__name__)


def _settings(cfg: Config, _args: argparse.Namespace) -> ProberSettings:
    return ProberSettings.from_config(cfg)


def _run(proc: shell.Process[ProberSettings]) -> None:
    s = proc.settings
    metrics = ProberMetrics.register(proc.registry)
    if not s.enabled:
        logger.info("audit-probe: audit.probe.enabled is false; nothing to do")
        proc.health.condition("registry").set(True, "probes disabled")
        beat = proc.health.heartbeat("probe loop")
        while not beat.wait(proc.stop, 60.0):
            pass
        beat.close()
        return
    client = httpx.Client(limits=httpx.Limits(max_connections=4 * s.concurrency + 4))
    proc.on_exit(client.close)
    logger.info(
        "audit-probe: every %gs, %d at once, API %s, index deadline %gs",
        s.interval,
        s.concurrency,
        s.api_url,
        s.index_deadline,
    )
    prober = Prober(s, client, stop=proc.stop)
    Scheduler(s, prober, client, metrics, proc.health).run(proc.stop)


def main(argv: list[str]) -> int:
    return shell.run_worker(_PROG, __doc__.split("\n")[0], argv, translate=_settings, run=_run)
