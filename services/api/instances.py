"""``GET /kv-cache/instances``: every instance's freshness and hash self-check, every master.

The document is :func:`common.status_report.build_report` over one pipelined Redis read. The
same read feeds the per-instance and per-master gauges that ``GET /metrics`` appends
(:func:`status_metrics`): they describe the system, not this worker, so they are computed at
scrape time from Redis rather than summed over workers.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import falcon
import orjson
import redis

from common.status_report import STATES, HashCheck, Limits, StatusReader, build_report
from services.api.api_metrics import ApiMetrics
from services.api.hit_rate import error_body

if TYPE_CHECKING:
    from prometheus_client.core import GaugeMetricFamily

logger = logging.getLogger(__name__)

PATH = "/kv-cache/instances"
_HASH_CHECKS = tuple(HashCheck)


class InstancesResource:
    def __init__(self, reader: StatusReader, limits: Limits, metrics: ApiMetrics) -> None:
        self.reader, self.limits, self.metrics = reader, limits, metrics

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        try:
            raw = self.reader.read()
        except redis.RedisError as exc:
            self.metrics.redis_errors.inc(op="instances")
            logger.warning("cannot read the instances' status: %s", exc)
            resp.status = falcon.HTTP_500
            resp.data = error_body(req.path, 500, "the state store is unreachable")
            return
        resp.data = orjson.dumps(build_report(raw, self.limits))


def status_metrics(reader: StatusReader, limits: Limits, metrics: ApiMetrics) -> str:
    """Prometheus text of the per-instance and per-master gauges ('' if Redis fails).

    Built as metric families on a throw-away registry: they hold no value objects, so in
    the gunicorn workers' multiprocess mode nothing is written to the shared value files
    (scrape-time gauges there would be summed with stale copies from every worker).
    prometheus_client is imported here, in the worker: the gunicorn master must not import
    it before it has set ``PROMETHEUS_MULTIPROC_DIR`` (:mod:`services.api.api_metrics`)."""
    from prometheus_client import CollectorRegistry, generate_latest

    try:
        report = build_report(reader.read(), limits)
    except redis.RedisError as exc:
        metrics.redis_errors.inc(op="metrics")
        logger.warning("cannot read the instances' status for /metrics: %s", exc)
        return ""
    families = [*_instance_metrics(report["instances"]), *_master_metrics(report["masters"])]
    families += _redis_memory(reader, metrics)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(families))
    return generate_latest(registry).decode()


def _instance_metrics(instances: list[dict[str, Any]]) -> list[GaugeMetricFamily]:
    """The per-instance gauges of the status report's instances."""
    from prometheus_client.core import GaugeMetricFamily

    state = GaugeMetricFamily(
        "cache_indexer_instance_l1_state",
        "1 for the instance's current L1 state (see GET /kv-cache/instances)",
        labels=("server_ip", "state"),
    )
    check = GaugeMetricFamily(
        "cache_indexer_instance_l1_hash_check",
        "1 for the instance's block-hash self-check result",
        labels=("server_ip", "result"),
    )
    blocks = GaugeMetricFamily(
        "cache_indexer_instance_blocks",
        "blocks indexed per instance and tier",
        labels=("server_ip", "tier"),
    )
    age = GaugeMetricFamily(
        "cache_indexer_instance_l1_last_event_age_seconds",
        "seconds since the instance's last KV-event batch arrived",
        labels=("server_ip",),
    )
    exact = GaugeMetricFamily(
        "cache_indexer_instance_exact",
        "1 when the instance's hit ratios are exact, 0 when only a lower bound (groups.exact)",
        labels=("server_ip",),
    )
    for inst in instances:
        ip, l1 = inst["server_ip"], inst["l1"]
        for st in STATES:
            state.add_metric((ip, st.value), 1 if l1["state"] == st else 0)
        for verdict in _HASH_CHECKS:
            check.add_metric((ip, verdict.value), 1 if l1["hash_check"] == verdict else 0)
        blocks.add_metric((ip, "l1"), l1["blocks"])
        if inst["l3"]["blocks"] is not None:
            blocks.add_metric((ip, "l3"), inst["l3"]["blocks"])
        if l1["last_event_age_s"] is not None:
            age.add_metric((ip,), l1["last_event_age_s"])
        exact.add_metric((ip,), 1 if inst["groups"]["exact"] else 0)
    return [state, check, blocks, age, exact]


class _Families:
    """A collector (prometheus_client's protocol: ``collect()``) of ready-made families."""

    def __init__(self, families: list[GaugeMetricFamily]) -> None:
        self.families = families

    def collect(self) -> Iterable[GaugeMetricFamily]:
        return self.families


def _redis_memory(reader: StatusReader, metrics: ApiMetrics) -> list[GaugeMetricFamily]:
    """Redis ``used_memory`` and ``maxmemory``, summed over a cluster's nodes ([] on error):
    the index's size is what an operator sizes Redis by (docs/operations.md)."""
    from prometheus_client.core import GaugeMetricFamily

    try:
        used_bytes, max_bytes = reader.memory()
    except redis.ResponseError:  # INFO refused (an ACL without it): not an outage
        return []
    except redis.RedisError as exc:
        metrics.redis_errors.inc(op="metrics")
        logger.warning("cannot read Redis INFO memory for /metrics: %s", exc)
        return []
    used = GaugeMetricFamily(
        "cache_indexer_redis_used_memory_bytes", "Redis used_memory (summed over cluster nodes)"
    )
    used.add_metric((), used_bytes)
    limit = GaugeMetricFamily(
        "cache_indexer_redis_maxmemory_bytes", "Redis maxmemory (0 = unbounded; summed)"
    )
    limit.add_metric((), max_bytes)
    return [used, limit]


def _master_metrics(masters: list[dict[str, Any]]) -> list[GaugeMetricFamily]:
    from prometheus_client.core import GaugeMetricFamily

    keys = GaugeMetricFamily(
        "cache_indexer_master_keys", "keys in the master's last listing", labels=("url",)
    )
    unparsed = GaugeMetricFamily(
        "cache_indexer_master_keys_unparsed",
        "keys of the master's last listing that parse as no known family",
        labels=("url",),
    )
    unmappable = GaugeMetricFamily(
        "cache_indexer_master_keys_unmappable_group",
        "keys of the master's last listing in KV-cache groups whose hashes are not vLLM block"
        " hashes (indexed nowhere)",
        labels=("url",),
    )
    age = GaugeMetricFamily(
        "cache_indexer_master_poll_age_seconds",
        "seconds since the master was last polled successfully",
        labels=("url",),
    )
    stale = GaugeMetricFamily(
        "cache_indexer_master_stale",
        "1 when the master's blocks were dropped as stale (ingest.l3.staleAfter)",
        labels=("url",),
    )
    for m in masters:
        url = m["url"]
        if m["keys"] is not None:
            keys.add_metric((url,), m["keys"])
            unparsed.add_metric((url,), m["keys_unparsed"])
            unmappable.add_metric((url,), m["keys_unmappable_group"])
        if m["age_s"] is not None:
            age.add_metric((url,), m["age_s"])
        stale.add_metric((url,), 1 if m["stale"] else 0)
    return [keys, unparsed, unmappable, age, stale]
