"""Helpers for the discovery tests: config files, an in-process discovery loop, pod edits."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis
import yaml

from common.config import Config, load_config
from common.lifecycle import Backoff
from common.settings import DiscoverySettings
from common.metrics import Registry
from services.discovery.main import build_source
from services.discovery.metrics import DiscoveryMetrics
from services.discovery.reconcile import Reconciler, Source, run
from tests.fake_kube import make_pod
from tests.metrics_oracle import value_of
from tests.store_oracle import OracleStore

ENGINE = {"openfuyao.com/engine": "vllm", "openfuyao.com/pdRole": "prefill"}
MASTER = {"openfuyao.com/kvmanager": "mooncake"}
_ids = itertools.count(1)


def merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def write_config(path: Path, redis_url: str, extra: dict[str, Any] | None = None) -> Path:
    """A config file with test-speed timings (lease 1 s, backoff 50–300 ms)."""
    base = {
        "redis": {"url": redis_url},
        "discovery": {"namespace": "default", "refreshInterval": "10s", "leaseTTL": "1s"},
        "ingest": {"l1": {"backoffInitial": "50ms", "backoffMax": "300ms"}},
    }
    path.write_text(yaml.safe_dump(merge(base, extra or {})))
    return path


def vllm_pod(name: str, ip: str, **kw: Any) -> dict[str, Any]:
    return make_pod(name, ip, kw.pop("labels", ENGINE), **kw)


def set_ready(ready: bool) -> Any:
    def change(pod: dict[str, Any]) -> None:
        pod["status"]["conditions"] = [{"type": "Ready", "status": "True" if ready else "False"}]

    return change


class RunningDiscovery:
    """One discovery loop (source + reconciler) in a thread, like one process."""

    def __init__(
        self,
        cfg: Config,
        path: Path | None,
        make_source: Callable[[DiscoveryMetrics], Source] | None = None,
    ) -> None:
        self.registry = Registry()
        self.metrics = DiscoveryMetrics.register(self.registry)
        self.client = redis.Redis.from_url(
            cfg.redis.url, socket_timeout=1, socket_connect_timeout=1
        )
        self.store = OracleStore(self.client)
        self.holder = f"test-holder-{next(_ids)}"
        d = DiscoverySettings.from_config(cfg)
        self.reconciler = Reconciler(self.store, self.holder, d.lease_ttl, self.metrics)
        self.source = (
            make_source(self.metrics)
            if make_source
            else build_source(d, str(path) if path else None, self.metrics)
        )
        self.stop = threading.Event()
        backoff = Backoff(d.backoff_initial, d.backoff_max)
        self.thread = threading.Thread(
            target=run,
            name=self.holder,
            daemon=True,
            args=(self.source, self.reconciler, self.stop, backoff),
        )

    @classmethod
    def from_file(cls, path: Path) -> RunningDiscovery:
        return cls(load_config(path, env={}), path)

    def start(self) -> RunningDiscovery:
        self.thread.start()
        return self

    def close(self) -> None:
        self.stop.set()
        self.source.changed.set()  # wake the loop now rather than at its next stop check
        self.thread.join(10)
        assert not self.thread.is_alive(), "discovery loop did not stop"
        self.client.close()

    def count(self, metric: str, **labels: str) -> float:
        return float(value_of(getattr(self.metrics, metric), **labels))

    def writes(self) -> float:
        """Registry writes this loop made (every action)."""
        return float(
            sum(
                s.value
                for family in self.registry.collector.collect()
                if family.name == "cache_indexer_discovery_registry_changes"
                for s in family.samples
                if s.name.endswith("_total")
            )
        )
