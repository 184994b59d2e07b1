"""The API's Falcon app: routes, error rendering, request metrics; built once per worker.

:func:`create_app` takes every dependency (settings, store, hasher, metrics) so tests can pass
their own; :func:`get_app` / :func:`build_app` make the real ones from the API's settings
(:class:`common.settings.ApiSettings`) in a gunicorn worker, after the fork (a Redis
connection pool must not cross a fork).

Routes: ``POST /kv-cache/hit-rate`` (:mod:`services.api.hit_rate`), ``GET
/kv-cache/instances`` (:mod:`services.api.instances`), ``POST /kv-cache/outcome``
(:mod:`services.api.audit_outcome`), ``GET /kv-cache/audit`` (:mod:`services.api.audit_view`),
``GET /healthz``
(liveness: answers while the process serves), ``GET /readyz`` (Redis ROLE: ``redis`` names
the role and address it talks to; 503 with a reason if Redis does not answer, is a
replica, whose copy is frozen, or is a sentinel), ``GET /metrics`` (Prometheus text,
summed over workers). Every error — ours, Falcon's 404/405, an unexpected exception — is
JSON: on the hit-rate path in the contract's shape ``{"server_score_list": [], "message": …,
"status": <http status>}``, elsewhere ``{"message": …, "status": …}``. Every answer names
the worker process that gave it in an ``X-Served-By`` header (its pid).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Protocol

import falcon
import orjson
import redis

from common.blockhash import BlockHasher
from common.config import Redis, config_path_from, load_config
from common.errors import RequestError
from common.redis_client import Client, connect, role, role_problem
from common.settings import ApiSettings
from common.store import Store
from common.status_report import Limits, StatusReader
from services.api import api_metrics, audit_outcome, audit_view, hit_rate, instances
from services.api.api_metrics import ApiMetrics
from services.api.audit_record import Recorder
from services.api.instances import status_metrics
from services.api.scoring import StoreReads

logger = logging.getLogger(__name__)

App = falcon.App[falcon.Request, falcon.Response]


class ApiStore(StoreReads, Protocol):
    """The API's role of :class:`common.store.Store`: the read round trip (scoring) and the
    client ``/readyz`` asks for the Redis role and the status reader shares."""

    r: Client


class _Health:
    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        resp.data = orjson.dumps({"status": "ok"})


class _Ready:
    def __init__(self, store: ApiStore, metrics: ApiMetrics) -> None:
        self.store, self.metrics = store, metrics

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        try:
            where = role(self.store.r)
        except redis.RedisError as exc:
            self.metrics.redis_errors.inc(op="readyz")
            resp.status = falcon.HTTP_503
            resp.data = orjson.dumps(
                {"status": "unavailable", "reason": f"the state store is unreachable: {exc}"}
            )
            return
        problem = role_problem(where)
        if problem:
            resp.status = falcon.HTTP_503
            resp.data = orjson.dumps({"status": "unavailable", "reason": problem, "redis": where})
            return
        resp.data = orjson.dumps({"status": "ok", "redis": where})


class _Metrics:
    def __init__(self, metrics: ApiMetrics, reader: StatusReader, limits: Limits) -> None:
        self.metrics, self.reader, self.limits = metrics, reader, limits

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        resp.content_type = "text/plain; version=0.0.4; charset=utf-8"
        status = status_metrics(self.reader, self.limits, self.metrics)  # may count an error
        resp.data = self.metrics.render() + status.encode()


class _RequestMetrics:
    """Middleware: count every answer by route template (bounded labels) and status."""

    def __init__(self, metrics: ApiMetrics) -> None:
        self.metrics = metrics

    def process_request(self, req: falcon.Request, resp: falcon.Response) -> None:
        req.context.started = time.perf_counter()

    def process_response(
        self, req: falcon.Request, resp: falcon.Response, resource: object, req_succeeded: bool
    ) -> None:
        path = req.uri_template if resource is not None and req.uri_template else "unmatched"
        elapsed = time.perf_counter() - float(req.context.started)
        self.metrics.requests.inc(path=path, status=str(resp.status_code))
        self.metrics.latency.observe(elapsed, path=path)


class _ServedBy:
    """Middleware: ``X-Served-By: <worker pid>`` on every answer, so an operator (or a test)
    can see that every gunicorn worker of a replica serves and which one answered."""

    def process_response(
        self, req: falcon.Request, resp: falcon.Response, resource: object, req_succeeded: bool
    ) -> None:
        resp.set_header("X-Served-By", str(os.getpid()))


def _request_error(
    req: falcon.Request, resp: falcon.Response, exc: RequestError, _params: dict[str, Any]
) -> None:
    resp.status = exc.status
    resp.content_type = falcon.MEDIA_JSON
    resp.data = hit_rate.error_body(req.path, exc.status, exc.message)


def _http_error_message(req: falcon.Request, resp: falcon.Response, exc: falcon.HTTPError) -> str:
    if isinstance(exc, falcon.HTTPMethodNotAllowed):  # Falcon has already set Allow on resp
        allowed = resp.get_header("Allow") or ""
        return f"method {req.method} is not allowed on {req.path}; allowed: {allowed}"
    if exc.status_code == 404:
        return f"there is no resource at {req.path}"
    if exc.description:
        return str(exc.description)
    return str(exc.title)


def _serialize_http_error(
    req: falcon.Request, resp: falcon.Response, exc: falcon.HTTPError
) -> None:
    resp.content_type = falcon.MEDIA_JSON
    resp.data = hit_rate.error_body(req.path, exc.status_code, _http_error_message(req, resp, exc))


def _unexpected_error(
    req: falcon.Request, resp: falcon.Response, exc: Exception, _params: dict[str, Any]
) -> None:
    # Falcon picks the most specific handler, so its own HTTPErrors never come here.
    logger.exception("unexpected error answering %s %s", req.method, req.path)
    resp.status = 500
    resp.content_type = falcon.MEDIA_JSON
    resp.data = hit_rate.error_body(
        req.path, 500, "the request could not be processed: internal error"
    )


def create_app(
    settings: ApiSettings, store: ApiStore, hasher: hit_rate.Hasher, metrics: ApiMetrics
) -> App:
    """The WSGI app over injected dependencies."""
    middleware: list[Any] = [_RequestMetrics(metrics), _ServedBy(), hit_rate.PostOnly()]
    app: App = falcon.App(middleware=middleware)
    audit = settings.audit
    recorder = Recorder(store.r, audit, metrics) if audit.enabled else None
    app.add_route(
        hit_rate.PATH,
        hit_rate.HitRateResource(
            store,
            hasher,
            metrics,
            settings.max_hit_rate_body_bytes,
            settings.max_candidates,
            settings.hash.vllm_version,
            recorder,
        ),
    )
    app.add_route(audit_outcome.PATH, audit_outcome.OutcomeResource(store.r, audit, metrics))
    app.add_route(audit_view.PATH, audit_view.AuditViewResource(store.r, audit, metrics))
    reader = StatusReader(store.r)
    limits = settings.instance_limits
    app.add_route(instances.PATH, instances.InstancesResource(reader, limits, metrics))
    app.add_route("/healthz", _Health())
    app.add_route("/readyz", _Ready(store, metrics))
    app.add_route("/metrics", _Metrics(metrics, reader, limits))
    app.add_error_handler(Exception, _unexpected_error)
    app.add_error_handler(RequestError, _request_error)
    app.set_error_serializer(_serialize_http_error)
    return app


def redis_client(redis_cfg: Redis) -> Client:
    """A pooled client with bounded timeouts and one quick retry (a stale pooled socket
    after a Redis restart), so a request fails fast instead of backing off for seconds."""
    return connect(redis_cfg, retries=1)


def build_app(settings: ApiSettings, redis_cfg: Redis) -> App:
    """Real dependencies; metrics shared through the gunicorn master's dir."""
    hasher = BlockHasher(settings.hash)
    hasher.member_keys(list(range(16)), 16)  # builds its lazy tables before the first request
    metrics = api_metrics.from_environment()
    return create_app(settings, Store(redis_client(redis_cfg)), hasher, metrics)


def get_app() -> App:
    """Entry point for a plain ``gunicorn 'services.api.app:get_app()'``: config from
    ``CACHE_INDEXER_CONFIG`` (defaults when unset). Without the hooks of
    :mod:`services.api.gunicorn_conf`, ``/metrics`` then shows only the answering worker,
    unless gunicorn is started with ``PROMETHEUS_MULTIPROC_DIR`` set to an empty directory."""
    cfg = load_config(config_path_from(None))
    return build_app(ApiSettings.from_config(cfg), cfg.redis)
