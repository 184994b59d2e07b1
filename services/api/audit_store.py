"""Every Redis read and write of the outcome reports and the audit view (keys:
:mod:`common.keys`, ``ci:audit:*`` and ``ci:{ip}:audit``).

Bounded by construction: a question's record and its reports expire with ``audit.ttl``; the
prefix sets keep their latest 64 members and expire; an instance's tallies exist only for a
registered instance (``ci:instances``) and expire a day after its last report; the worst
instances keep ``audit.worstInstances`` members, the recent discrepancies ``audit.recent``.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import orjson

from common import keys
from common.config import Audit
from services.api.api_metrics import ApiMetrics
from services.api.audit_verdict import Evidence, Outcome, Verdict, stop_block

if TYPE_CHECKING:
    from services.api.audit_outcome import Report

INSTANCE_TTL = 86_400
"""Seconds an instance's tallies outlive its last report."""
_CLAIM = b"pending"
TALLY_FIELDS = ("reports", "exact", "under", "over", "unexplained", "difference_tokens")


def _loads(raw: Any) -> dict[str, Any] | None:
    if raw is None:
        return None
    try:
        doc = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    return doc if isinstance(doc, dict) else None


class AuditStore:
    def __init__(self, client: Any, settings: Audit, clock: Any = time.time) -> None:
        self.r, self.settings, self.clock = client, settings, clock

    def read_question(
        self, request_id: str, ip: str
    ) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        """The record of ``request_id`` and ``ip``'s earlier report of it (None: none)."""
        q, earlier = self.r.hmget(keys.audit_question(request_id), ["q", f"r:{ip}"])
        if earlier == _CLAIM or earlier == _CLAIM.decode():
            earlier = orjson.dumps({"pending": True})
        return _loads(q), _loads(earlier)

    def gather(
        self, report: Report, question: dict[str, Any], candidate: dict[str, Any]
    ) -> tuple[Evidence, bool, bool]:
        """(evidence, whether this call claimed the report slot, whether ip is registered)."""
        ip, rid = report.server_ip, report.request_id
        pipe = self.r.pipeline(transaction=False)
        fp = question.get("fp") or ""
        asked = int(question.get("t", 0))
        if fp:
            low = asked - int(self.settings.race_window * 1000)
            pipe.zrangebyscore(keys.audit_prefix(fp), low, "+inf")
        stop = question.get("k", {}).get(str(stop_block(candidate, int(question["bs"]))))
        if stop:
            pipe.sismember(keys.tier_set(ip, "l1"), stop)
            pipe.sismember(keys.l3_set(ip), stop)
        pipe.sismember(keys.INSTANCES, ip)
        pipe.hsetnx(keys.audit_question(rid), f"r:{ip}", _CLAIM)
        replies = list(pipe.execute())
        claimed, registered = bool(replies.pop()), bool(replies.pop())
        holds: bool | None = None
        if stop:
            in_l3, in_l1 = bool(replies.pop()), bool(replies.pop())
            holds = in_l1 or in_l3
        others = replies.pop() if fp else []
        concurrent = any(_text(m) != rid for m in others)
        return Evidence(concurrent=concurrent, index_holds_stop=holds), claimed, registered

    def save(
        self,
        report: Report,
        doc: dict[str, Any],
        outcome: Outcome,
        registered: bool,
        metrics: ApiMetrics,
    ) -> None:
        """The report, the tallies and (for a discrepancy) the recent list, in one trip."""
        ip, verdict = report.server_ip, str(outcome.verdict)
        explained = "explained" if outcome.explained else "unexplained"
        pipe = self.r.pipeline(transaction=False)
        pipe.hset(keys.audit_question(report.request_id), f"r:{ip}", orjson.dumps(doc))
        pipe.hincrby(keys.AUDIT_TOTALS, verdict, 1)
        pipe.hincrby(keys.AUDIT_TOTALS, f"{verdict}:{explained}:{report.source}", 1)
        if registered:
            tally = keys.audit_instance(ip)
            pipe.hincrby(tally, "reports", 1)
            pipe.hincrby(tally, verdict, 1)
            pipe.hincrby(tally, "difference_tokens", abs(outcome.difference))
            if not outcome.explained:
                pipe.hincrby(tally, "unexplained", 1)
            pipe.hset(tally, "last_report_ms", int(self.clock() * 1000))
            pipe.expire(tally, INSTANCE_TTL)
            if not outcome.explained:
                pipe.zincrby(keys.AUDIT_WORST, 1, ip)
                pipe.zremrangebyrank(keys.AUDIT_WORST, 0, -(self.settings.worst_instances + 1))
        if outcome.verdict is not Verdict.EXACT:
            entry = {**doc, "reported_at_ms": int(self.clock() * 1000)}
            entry.pop("status", None)
            entry.pop("message", None)
            pipe.lpush(keys.AUDIT_RECENT, orjson.dumps(entry))
            pipe.ltrim(keys.AUDIT_RECENT, 0, self.settings.recent - 1)
        pipe.execute()

    def view(self, worst: int, recent: int) -> dict[str, Any]:
        """The audit's state for ``GET /kv-cache/audit`` and ``cache-indexer audit``."""
        pipe = self.r.pipeline(transaction=False)
        pipe.hgetall(keys.AUDIT_TOTALS)
        pipe.zrevrange(keys.AUDIT_WORST, 0, max(0, worst - 1), withscores=True)
        pipe.lrange(keys.AUDIT_RECENT, 0, max(0, recent - 1))
        totals, ranked, entries = pipe.execute()
        ips = [_text(ip) for ip, _ in ranked][:worst]
        tallies: list[Any] = []
        if ips:
            pipe = self.r.pipeline(transaction=False)
            for ip in ips:
                pipe.hgetall(keys.audit_instance(ip))
            tallies = pipe.execute()
        instances = []
        for ip, tally in zip(ips, tallies, strict=True):
            row: dict[str, Any] = {"server_ip": ip}
            fields = {_text(k): _text(v) for k, v in (tally or {}).items()}
            for name in TALLY_FIELDS:
                row[name] = int(fields.get(name, 0) or 0)
            row["last_report_ms"] = int(fields.get("last_report_ms", 0) or 0)
            instances.append(row)
        return {
            "totals": {_text(k): int(v) for k, v in (totals or {}).items()},
            "worst_instances": instances,
            "recent_discrepancies": [d for d in map(_loads, entries[:recent]) if d is not None],
        }


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
