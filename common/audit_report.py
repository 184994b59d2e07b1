"""The prediction audit as one document: outcome totals, the instances with the most
unexplained discrepancies and the latest discrepancies, read from Redis in two pipelined
round trips. Shared by ``GET /kv-cache/audit`` (:mod:`services.api.audit_view`) and
``cache-indexer audit`` (:mod:`services.tools.audit_cmd`); the API's outcome endpoint
writes what this reads (``services/api/audit_store.py``; keys: :mod:`common.keys`).
"""

from __future__ import annotations

from typing import Any

import orjson

from common import keys

TALLY_FIELDS = ("reports", "exact", "under", "over", "unexplained", "difference_tokens")
"""An instance's counters in ``ci:{ip}:audit`` (besides ``last_report_ms``)."""


def text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def loads(raw: Any) -> dict[str, Any] | None:
    """A JSON object stored by the audit, None if absent or not one."""
    if raw is None:
        return None
    try:
        doc = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    return doc if isinstance(doc, dict) else None


def read_audit(client: Any, worst: int, recent: int) -> dict[str, Any]:
    """``{"totals", "worst_instances", "recent_discrepancies"}``; raises redis errors."""
    pipe = client.pipeline(transaction=False)
    pipe.hgetall(keys.AUDIT_TOTALS)
    pipe.zrevrange(keys.AUDIT_WORST, 0, max(0, worst - 1), withscores=True)
    pipe.lrange(keys.AUDIT_RECENT, 0, max(0, recent - 1))
    totals, ranked, entries = pipe.execute()
    ips = [text(ip) for ip, _ in ranked][:worst]
    tallies: list[Any] = []
    if ips:
        pipe = client.pipeline(transaction=False)
        for ip in ips:
            pipe.hgetall(keys.audit_instance(ip))
        tallies = pipe.execute()
    instances = []
    for ip, tally in zip(ips, tallies, strict=True):
        fields = {text(k): text(v) for k, v in (tally or {}).items()}
        row: dict[str, Any] = {"server_ip": ip}
        for name in (*TALLY_FIELDS, "last_report_ms"):
            row[name] = int(fields.get(name, 0) or 0)
        instances.append(row)
    return {
        "totals": {text(k): int(v) for k, v in (totals or {}).items()},
        "worst_instances": instances,
        "recent_discrepancies": [d for d in map(loads, entries[:recent]) if d is not None],
    }
