"""``POST /kv-cache/outcome``: a router (or the prober) reports what vLLM reused for a request
it routed; the answer is the verdict of :mod:`services.api.audit_verdict` against the answer
recorded at routing time (:mod:`services.api.audit_record`).

Body: ``{"request_id": str, "server_ip": str, "cached_tokens": int, "prompt_tokens": int
(optional), "source": "router" | "probe" (optional, default "router")}``. Statuses: 400 for a
malformed body or a ``server_ip`` that was not a candidate of that question, 404 for an
unknown or expired ``request_id`` (or the audit switched off), 409 for a second report of the
same (request_id, server_ip) with another ``cached_tokens`` (the same one again is answered
200 with the first verdict and ``"duplicate": true``, and counted once), 413 over
``audit.maxReportBytes``, 503 when Redis cannot be read. The API keeps no state of its own:
any replica may receive any report.

Three pipelined round trips: the record and an earlier report of this instance; the
evidence (concurrent questions on the prefix, whether the instance's index now holds the
block where the prediction stopped, whether the instance is registered) together with a
claim of the (request_id, server_ip) slot; the verdict, the tallies and the recent
discrepancies (:mod:`services.api.audit_store`).
"""

from __future__ import annotations

import logging
from typing import Any

import falcon
import orjson
import redis

from common.config import Audit
from common.errors import RequestError
from services.api import audit_store
from services.api.api_metrics import ApiMetrics
from services.api.audit_record import parse_request_id
from services.api.audit_verdict import Outcome, Report, classify
from services.api.hit_rate_request import read_body

logger = logging.getLogger(__name__)

PATH = "/kv-cache/outcome"
SOURCES = ("router", "probe")
_FIELDS = ("request_id", "server_ip", "cached_tokens", "prompt_tokens", "source")
_REQUIRED = ("request_id", "server_ip", "cached_tokens")
_MAX_TOKENS = 1 << 40
UNREACHABLE = "the outcome could not be recorded: the state store is unreachable"


def parse_report(raw: bytes) -> Report:
    """Decode and validate a report body; :class:`RequestError` 400 if malformed."""
    if not raw.strip():
        raise RequestError(400, "the request body is empty")
    try:
        doc = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise RequestError(400, f"the request body is not valid JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise RequestError(400, "the request body must be a JSON object")
    for name in doc:
        if name not in _FIELDS:
            raise RequestError(400, f"the report has an unknown field {name}")
    for name in _REQUIRED:
        if name not in doc:
            raise RequestError(400, f"the required field {name} is missing")
    rid = parse_request_id(doc["request_id"])
    ip = doc["server_ip"]
    if not isinstance(ip, str) or not 0 < len(ip) <= 256:
        raise RequestError(400, "server_ip must be a non-empty string")
    cached = _tokens(doc["cached_tokens"], "cached_tokens", 0)
    prompt = doc.get("prompt_tokens")
    if prompt is not None:
        prompt = _tokens(prompt, "prompt_tokens", 1)
    if prompt is not None and cached > prompt:
        raise RequestError(400, f"cached_tokens ({cached}) exceeds prompt_tokens ({prompt})")
    source = doc.get("source", "router")
    if source not in SOURCES:
        raise RequestError(400, f"source must be one of {list(SOURCES)}, got {source!r}")
    assert rid is not None
    return Report(rid, ip, cached, prompt, source)


def _tokens(value: Any, name: str, low: int) -> int:
    if type(value) is not int or not low <= value < _MAX_TOKENS:
        raise RequestError(400, f"{name} must be an integer >= {low}, got {value!r}")
    return value


class OutcomeResource:
    """``/kv-cache/outcome`` (POST only; Falcon answers 405 to other methods)."""

    def __init__(self, client: Any, settings: Audit, metrics: ApiMetrics) -> None:
        self.settings, self.metrics = settings, metrics
        self.store = audit_store.AuditStore(client, settings)

    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        if not self.settings.enabled:
            raise RequestError(404, "the prediction audit is off (audit.enabled: false)")
        report = parse_report(read_body(req, self.settings.max_report_bytes))
        try:
            doc = self._answer(report)
        except redis.RedisError as exc:
            self.metrics.redis_errors.inc(op="audit_outcome")
            logger.warning("audit outcome: Redis failed: %s", exc)
            raise RequestError(503, UNREACHABLE) from None
        resp.content_type = falcon.MEDIA_JSON
        resp.data = orjson.dumps(doc)

    def _answer(self, report: Report) -> dict[str, Any]:
        question, earlier = self.store.read_question(report.request_id, report.server_ip)
        if question is None:
            raise RequestError(
                404,
                f"no hit-rate answer is recorded under request_id {report.request_id!r}: "
                f"unknown, expired (audit.ttl {int(self.settings.ttl)}s) or not yet written",
            )
        candidate = question.get("c", {}).get(report.server_ip)
        if candidate is None:
            raise RequestError(
                400,
                f"server_ip {report.server_ip!r} was not a candidate of request_id "
                f"{report.request_id!r}",
            )
        if earlier is not None:
            return self._duplicate(report, earlier)
        evidence, claimed, registered = self.store.gather(report, question, candidate)
        if not claimed:  # another replica claimed the slot between our two reads
            _, earlier = self.store.read_question(report.request_id, report.server_ip)
            return self._duplicate(report, earlier or {})
        outcome = classify(
            question, candidate, report.cached_tokens, report.prompt_tokens, evidence
        )
        doc = _document(report, question, candidate, outcome)
        self.store.save(report, doc, outcome, registered, str(question.get("fp") or ""))
        self._count(report, outcome)
        return doc

    def _duplicate(self, report: Report, earlier: dict[str, Any]) -> dict[str, Any]:
        if earlier.get("pending") or not earlier:
            raise RequestError(
                409,
                f"a report of server_ip {report.server_ip!r} for request_id "
                f"{report.request_id!r} is being recorded by another request",
            )
        if earlier.get("realized_tokens") != report.cached_tokens:
            raise RequestError(
                409,
                f"server_ip {report.server_ip!r} already reported cached_tokens "
                f"{earlier.get('realized_tokens')} for request_id {report.request_id!r}",
            )
        return {**earlier, "duplicate": True}

    def _count(self, report: Report, outcome: Outcome) -> None:
        verdict = str(outcome.verdict)
        explained = "true" if outcome.explained else "false"
        self.metrics.audit_outcomes.inc(verdict=verdict, source=report.source, explained=explained)
        self.metrics.audit_difference.observe(
            abs(outcome.difference), verdict=verdict, source=report.source
        )


def _document(
    report: Report, question: dict[str, Any], candidate: dict[str, Any], outcome: Outcome
) -> dict[str, Any]:
    """The answer (and what is stored as the report and in the recent discrepancies)."""
    return {
        "status": 0,
        "message": "",
        "request_id": report.request_id,
        "server_ip": report.server_ip,
        "source": report.source,
        **outcome.document(),
        "l1_hit_tokens": candidate.get("l1", 0),
        "l3_hit_tokens": candidate.get("l3", 0),
        "inexact_reasons": sorted(set(candidate.get("r1", ())) | set(candidate.get("r3", ()))),
        "prompt_tokens": question.get("n"),
        "reported_prompt_tokens": report.prompt_tokens,
        "block_size": question.get("bs"),
        "salt": bool(question.get("salt")),
        "asked_at_ms": question.get("t"),
        "duplicate": False,
    }
