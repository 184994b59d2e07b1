"""``GET /kv-cache/instances``: every instance's freshness and hash self-check, every master.

The document is :func:`common.status_report.build_report` over one pipelined Redis read. The
same read feeds the per-instance and per-master gauges that ``GET /metrics`` appends
(:func:`status_metrics`): they describe the system, not this worker, so they are computed at
scrape time from Redis rather than summed over workers.
"""

from __future__ import annotations

import logging
from typing import Any

import falcon
import orjson
import redis

from common.metrics import Registry
from common.status_report import STATES, Limits, StatusReader, build_report
from services.api.api_metrics import ApiMetrics

logger = logging.getLogger(__name__)

PATH = "/kv-cache/instances"
_HASH_CHECKS = ("ok", "mismatch", "unchecked")


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
            resp.data = orjson.dumps(
                {"message": "the state store is unreachable", "status": 500})
            return
        resp.data = orjson.dumps(build_report(raw, self.limits))


def status_metrics(reader: StatusReader, limits: Limits, metrics: ApiMetrics) -> str:
    """Prometheus text of the per-instance and per-master gauges ('' if Redis fails)."""
    try:
        report = build_report(reader.read(), limits)
    except redis.RedisError as exc:
        metrics.redis_errors.inc(op="metrics")
        logger.warning("cannot read the instances' status for /metrics: %s", exc)
        return ""
    r = Registry()
    state = r.gauge("cache_indexer_instance_l1_state",
                    "1 for the instance's current L1 state (see GET /kv-cache/instances)",
                    ("server_ip", "state"))  # fmt: skip
    check = r.gauge("cache_indexer_instance_l1_hash_check",
                    "1 for the instance's block-hash self-check result", ("server_ip", "result"))
    blocks = r.gauge("cache_indexer_instance_blocks", "blocks indexed per instance and tier",
                     ("server_ip", "tier"))  # fmt: skip
    age = r.gauge("cache_indexer_instance_l1_last_event_age_seconds",
                  "seconds since the instance's last KV-event batch arrived", ("server_ip",))
    for inst in report["instances"]:
        ip, l1 = inst["server_ip"], inst["l1"]
        for name in STATES:
            state.set(1 if l1["state"] == name else 0, server_ip=ip, state=name)
        for name in _HASH_CHECKS:
            check.set(1 if l1["hash_check"] == name else 0, server_ip=ip, result=name)
        blocks.set(l1["blocks"], server_ip=ip, tier="l1")
        if inst["l3"]["blocks"] is not None:
            blocks.set(inst["l3"]["blocks"], server_ip=ip, tier="l3")
        if l1["last_event_age_s"] is not None:
            age.set(l1["last_event_age_s"], server_ip=ip)
    _master_metrics(r, report["masters"])
    return r.render()


def _master_metrics(r: Registry, masters: list[dict[str, Any]]) -> None:
    keys = r.gauge("cache_indexer_master_keys", "keys in the master's last listing", ("url",))
    unparsed = r.gauge("cache_indexer_master_keys_unparsed",
                       "keys of the master's last listing that parse as no known family",
                       ("url",))  # fmt: skip
    age = r.gauge("cache_indexer_master_poll_age_seconds",
                  "seconds since the master was last polled successfully", ("url",))
    stale = r.gauge("cache_indexer_master_stale", "1 when the master's blocks were dropped "
                    "as stale (ingest.l3.staleAfter)", ("url",))  # fmt: skip
    for m in masters:
        url = m["url"]
        if m["keys"] is not None:
            keys.set(m["keys"], url=url)
            unparsed.set(m["keys_unparsed"], url=url)
        if m["age_s"] is not None:
            age.set(m["age_s"], url=url)
        stale.set(1 if m["stale"] else 0, url=url)
