"""What the processes export (names and label names, read from the code) and what PromQL
expressions select: the alert rules and dashboard queries are checked against the first.

:func:`exported` builds every process's metrics the way the processes do — the workers'
registries (:class:`~services.l1_ingest.metrics.IngestMetrics`, the L3 poller's,
discovery's and the audit prober's), the API's (:class:`~services.api.api_metrics.ApiMetrics`),
the probes' gauges (:func:`common.metrics.serve`) and the API's scrape-time gauges over a real Redis
(:func:`services.api.instances.status_metrics`) — and lists every sample name it can expose
(``_total`` for counters, ``_bucket``/``_count``/``_sum`` for histograms) with its labels.
"""

from __future__ import annotations

import re
from typing import Any

import httpx
import redis
from prometheus_client.parser import text_string_to_metric_families

from common.health import Health
from common.metrics import Registry, serve
from common.status_report import Limits, StatusReader
from common.store import Store
from services.api.api_metrics import ApiMetrics
from services.api.instances import status_metrics
from services.discovery.metrics import DiscoveryMetrics
from services.l1_ingest.metrics import IngestMetrics
from services.l3_poller.metrics import PollerMetrics
from services.prober.metrics import ProberMetrics

_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",)}
# PromQL words that look like a metric name, and what `by (...)` may name besides labels.
_SCRAPE_LABELS = {"job", "instance", "le"}


def _registry_catalog(collector: Any) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for metric in set(collector._collector_to_names):  # prometheus_client's own index
        labels = set(getattr(metric, "_labelnames", ()))
        kind = getattr(metric, "_type", "gauge")
        for suffix in _SUFFIXES.get(kind, ("",)):
            extra = {"le"} if suffix == "_bucket" else set()
            out[metric._name + suffix] = labels | extra
    return out


def _text_catalog(text: str) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, set()).update(sample.labels)
    return out


def exported(client: redis.Redis, populate: Any) -> dict[str, set[str]]:
    """Every sample name any cache-indexer process exposes → its label names.
    ``populate(store)`` fills ``client``'s Redis so the scrape-time gauges have series."""
    catalog: dict[str, set[str]] = {}
    workers = Registry()
    IngestMetrics(workers)
    PollerMetrics.register(workers)
    DiscoveryMetrics.register(workers)
    ProberMetrics.register(workers)
    catalog.update(_registry_catalog(workers.collector))
    api = ApiMetrics()
    catalog.update(_registry_catalog(api.registry.collector))
    health = Health()
    health.condition("redis")
    server = serve(Registry(), "127.0.0.1", 0, health)
    try:
        text = httpx.get(f"http://127.0.0.1:{server.server_address[1]}/metrics").text
    finally:
        server.shutdown()
        server.server_close()
    catalog.update(_text_catalog(text))
    populate(Store(client))
    catalog.update(_text_catalog(status_metrics(StatusReader(client), Limits(), api)))
    return catalog


_NAME = re.compile(r"\b(cache_indexer_[a-z0-9_]+)\b(\{[^}]*\})?")
_MATCHER = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)\s*"')
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")


def selectors(expr: str) -> list[tuple[str, set[str]]]:
    """(metric name, label names matched) of every cache_indexer_* selector in ``expr``."""
    return [(m.group(1), set(_MATCHER.findall(m.group(2) or ""))) for m in _NAME.finditer(expr)]


def grouping_labels(expr: str) -> set[str]:
    """Label names in ``by (...)``/``on (...)`` clauses."""
    return {label.strip() for group in _GROUPING.findall(expr) for label in group.split(",")} - {""}


def unknown_names(expr: str, catalog: dict[str, set[str]]) -> list[str]:
    """Metric or label names in ``expr`` that no process exports (misspellings)."""
    bad: list[str] = []
    used: set[str] = set()
    for name, labels in selectors(expr):
        if name not in catalog:
            bad.append(f"metric {name}")
            continue
        bad += [f"label {name}{{{lb}}}" for lb in sorted(labels - catalog[name])]
        used |= catalog[name]
    bad += [f"grouping label {lb}" for lb in sorted(grouping_labels(expr) - used - _SCRAPE_LABELS)]
    return bad
