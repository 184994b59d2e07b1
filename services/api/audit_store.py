"""Every Redis read and write of the outcome reports (keys: :mod:`common.keys`, ``ci:audit:*``
and ``ci:{ip}:audit``; the view reads them back: :mod:`common.audit_report`).

Bounded by construction: a question's record and its reports expire with ``audit.ttl``; the
prefix sets keep their latest 64 members and expire; an instance's tallies exist only for a
registered instance (``ci:instances``) and expire a day after its last report; the worst
instances keep ``audit.worstInstances`` members, the recent discrepancies ``audit.recent``.
"""

from __future__ import annotations

import time
from typing import Any

import orjson

from common import keys
from common.audit_report import loads as _loads
from common.audit_report import text as _text
from common.config import Audit
from services.api.audit_record import PREFIX_MEMBERS
from services.api.audit_verdict import Evidence, Outcome, Report, Verdict, stop_block

INSTANCE_TTL = 86_400
"""Seconds an instance's tallies outlive its last report."""
_CLAIM = b"pending"


class AuditStore:
    def __init__(self, client: Any, settings: Audit, clock: Any = time.time) -> None:
        self.r, self.settings, self.clock = client, settings, clock

    def read_question(
        self, request_id: str, ip: str
    ) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        """The record of ``request_id`` and ``ip``'s earlier report of it (None: none)."""
        pipe = self.r.pipeline(transaction=False)
        pipe.get(keys.audit_question(request_id))
        pipe.hget(keys.audit_reports(request_id), f"r:{ip}")
        q, earlier = pipe.execute()
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
            pipe.zrange(keys.audit_prefix_done(fp), 0, -1, withscores=True)
        stop = question.get("kh", {}).get(ip) or question.get("k", {}).get(
            str(stop_block(candidate, int(question["bs"])))
        )
        if stop:
            pipe.sismember(keys.tier_set(ip, "l1"), stop)
            pipe.sismember(keys.l3_set(ip), stop)
        pipe.zcount(keys.audit_instance_reports(ip), f"({asked}", "+inf")
        pipe.sismember(keys.INSTANCES, ip)
        pipe.hsetnx(keys.audit_reports(rid), f"r:{ip}", _CLAIM)
        pipe.expire(keys.audit_reports(rid), max(1, int(self.settings.ttl)))
        replies = list(pipe.execute())
        replies.pop()  # EXPIRE
        claimed, registered = bool(replies.pop()), bool(replies.pop())
        busy = int(replies.pop()) > 0
        holds: bool | None = None
        if stop:
            in_l3, in_l1 = bool(replies.pop()), bool(replies.pop())
            holds = in_l1 or in_l3
        concurrent = False
        if fp:
            done = {_text(m): score for m, score in replies.pop()}
            others = [_text(m) for m in replies.pop()]
            # In flight together: asked within the window and not reported before we asked.
            concurrent = any(m != rid and done.get(m, asked) >= asked for m in others)
        evidence = Evidence(concurrent=concurrent, index_holds_stop=holds, instance_busy=busy)
        return evidence, claimed, registered

    def save(
        self,
        report: Report,
        doc: dict[str, Any],
        outcome: Outcome,
        registered: bool,
        fp: str,
    ) -> None:
        """The report (also as done on prefix ``fp``), the tallies and (for a discrepancy)
        the recent list, in one round trip."""
        ip, verdict = report.server_ip, str(outcome.verdict)
        explained = "explained" if outcome.explained else "unexplained"
        pipe = self.r.pipeline(transaction=False)
        pipe.hset(keys.audit_reports(report.request_id), f"r:{ip}", orjson.dumps(doc))
        if fp:
            done = keys.audit_prefix_done(fp)
            pipe.zadd(done, {report.request_id: int(self.clock() * 1000)}, nx=True)
            pipe.zremrangebyrank(done, 0, -(PREFIX_MEMBERS + 1))
            pipe.expire(done, max(1, int(2 * self.settings.race_window + 0.999)))
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
            reported = keys.audit_instance_reports(ip)
            pipe.zadd(reported, {report.request_id: int(self.clock() * 1000)})
            pipe.zremrangebyrank(reported, 0, -(PREFIX_MEMBERS + 1))
            pipe.expire(reported, INSTANCE_TTL)
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
