"""``cache-indexer discovery``: keep the registry of vLLM instances and Mooncake masters in Redis.

One process (or two during a rolling update: the lease lets one write at a time). The
source is Kubernetes (default; :mod:`services.discovery.kube`) or the config file's static
lists (:mod:`services.discovery.static`); :mod:`services.discovery.reconcile` writes.
Metrics (``metrics.port`` or ``--metrics-port``; 0 = off) are listed in
:mod:`services.discovery.metrics`. Exit status: 0 after SIGTERM/SIGINT (the lease is
released, the registry is left as it is), 2 for a bad config or command line. The process
frame (flags, config, logging, signals, metrics endpoint, Redis) is :mod:`common.shell`.
"""

from __future__ import annotations

import argparse
import os
import secrets
import socket

from common import shell
from common.config import Config
from common.errors import ConfigError
from common.lifecycle import Backoff
from common.settings import DiscoverySettings
from common.store import Store
from services.discovery.metrics import DiscoveryMetrics
from services.discovery.pods import label_problems
from services.discovery.reconcile import Reconciler, Source, run

_PROG = "cache-indexer discovery"


def build_source(d: DiscoverySettings, path: str | None, metrics: DiscoveryMetrics) -> Source:
    """The configured source; ConfigError when it cannot be set up."""
    if d.mode == "static":
        from services.discovery.static import StaticSource

        return StaticSource(path, d, metrics)
    if problems := label_problems(d.labels):
        raise ConfigError("invalid config: " + "; ".join(problems))
    from services.discovery.kube import KubeSource, connect

    api_client, namespace = connect(d, os.environ)
    return KubeSource(api_client, namespace, d, metrics)


def _settings(cfg: Config, _args: argparse.Namespace) -> DiscoverySettings:
    return DiscoverySettings.from_config(cfg)


def _run(proc: shell.Process[DiscoverySettings]) -> None:
    d = proc.settings
    metrics = DiscoveryMetrics.register(proc.registry)
    source = build_source(d, proc.config_path, metrics)
    holder = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
    reconciler = Reconciler(Store(proc.redis()), holder, d.lease_ttl, metrics)
    run(source, reconciler, proc.stop, Backoff(d.backoff_initial, d.backoff_max), proc.health)


def main(argv: list[str]) -> int:
    return shell.run_worker(_PROG, __doc__.split("\n\n")[0], argv, translate=_settings, run=_run)
