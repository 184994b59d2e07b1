"""``GET /kv-cache/audit``: the prediction audit as JSON — outcome totals over every replica,
the instances with the most unexplained discrepancies (with their tallies) and the latest
discrepancies with what helps debug them. ``?worst=N`` and ``?recent=N`` shorten the lists
(at most ``audit.worstInstances`` and ``audit.recent``). ``cache-indexer audit`` prints the
same as a table (:mod:`services.tools.audit_cmd`).
"""

from __future__ import annotations

import logging
from typing import Any

import falcon
import orjson
import redis

from common.audit_report import read_audit
from common.config import Audit
from common.errors import RequestError
from services.api.api_metrics import ApiMetrics

logger = logging.getLogger(__name__)

PATH = "/kv-cache/audit"


class AuditViewResource:
    def __init__(self, client: Any, settings: Audit, metrics: ApiMetrics) -> None:
        self.client, self.settings, self.metrics = client, settings, metrics

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        worst = _limit(req, "worst", self.settings.worst_instances)
        recent = _limit(req, "recent", self.settings.recent)
        try:
            doc = read_audit(self.client, worst, recent)
        except redis.RedisError as exc:
            self.metrics.redis_errors.inc(op="audit_view")
            logger.warning("cannot read the audit: %s", exc)
            raise RequestError(503, "the state store is unreachable") from None
        doc["enabled"] = self.settings.enabled
        resp.content_type = falcon.MEDIA_JSON
        resp.data = orjson.dumps(doc)


def _limit(req: falcon.Request, name: str, most: int) -> int:
    raw = req.get_param(name)
    if raw is None:
        return most
    if not raw.isdigit():
        raise RequestError(400, f"{name} must be a non-negative integer, got {raw!r}")
    return min(int(raw), most)
