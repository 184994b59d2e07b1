"""The discovery process's metrics, registered once on the process's :class:`Registry`.

Served by :func:`common.metrics.serve` on ``metrics.port`` / ``--metrics-port`` (0 = off);
names and meanings are the help strings below. Error kinds: ``unreachable``, ``forbidden``
(401/403), ``api_error`` (other HTTP errors), ``gone`` (410: relist), ``watch_broken``,
``decode``, ``redis``, ``lease_lost``, ``config`` (a bad static file), ``internal``.

One counter with an ``action`` label rather than a counter per action keeps the set of
names small; only the lease holder's ``registry_changes_total`` moves, so summing it over
all discovery processes counts each write once."""

from __future__ import annotations

from dataclasses import dataclass

from common.metrics import Counter, Gauge, Registry


@dataclass(frozen=True)
class DiscoveryMetrics:
    instances: Gauge
    masters: Gauge
    changes: Counter
    relists: Counter
    watch_restarts: Counter
    errors: Counter
    lease_held: Gauge
    reloads: Counter

    @classmethod
    def register(cls, registry: Registry) -> DiscoveryMetrics:
        p = "cache_indexer_discovery_"
        return cls(
            instances=registry.gauge(
                p + "instances", "vLLM instances discovery currently sees (standbys too)"
            ),
            masters=registry.gauge(
                p + "masters", "Mooncake masters discovery currently sees (standbys too)"
            ),
            changes=registry.counter(
                p + "registry_changes_total",
                "registry writes by action (added, replaced, restarted, updated, removed, masters)",
                ["action"],
            ),
            relists=registry.counter(
                p + "relists_total", "successful pod list calls (vllm, masters)", ["source"]
            ),
            watch_restarts=registry.counter(
                p + "watch_restarts_total", "watch streams that broke or expired", ["source"]
            ),
            errors=registry.counter(p + "errors_total", "errors by kind", ["kind"]),
            lease_held=registry.gauge(p + "lease_held", "1 while this process holds the lease"),
            reloads=registry.counter(
                p + "static_reloads_total",
                "static config reloads by result (ok, invalid)",
                ["result"],
            ),
        )
