"""gunicorn settings for the API, derived from the ``http`` section of the config, and its hooks.

How each ``http.*`` key is enforced (gunicorn 27.x,
:class:`services.api.transport.worker.DeadlineWorker`, a ``gthread`` worker that reads each
request whole in its selector thread before a pool thread sees it):

| key                 | enforced by                 | notes |
|---------------------|-----------------------------|-------|
| addr                | bind                        | Go style: ``:28080`` = all interfaces; ``--bind`` overrides |
| workers, threads    | workers, threads            | this project's keys; ``--workers`` overrides; threads only run complete requests |
| shutdownTimeout     | graceful_timeout            | SIGTERM: workers finish in-flight requests for at most this long |
| readHeaderTimeout, readTimeout, writeTimeout | the worker | what each spans and answers: :mod:`services.api.transport.worker`; zero values: ``Limits.from_go``. gunicorn's ``timeout`` (a wedged worker is replaced) is max(writeTimeout, 30 s) |
| idleTimeout         | the worker, keepalive       | as above |
| maxHeaderBytes      | limit_request_line, limit_request_field_size | each capped at 8190, gunicorn's maximum; with the default 100 fields the header block stays under ~800 KiB |
| maxHitRateBodyBytes | the worker, the app         | bodies over it are not buffered; :func:`services.api.hit_rate_request.read_body`: Content-Length check (413 unread), capped chunked read |
| maxCandidates       | the app                     | :func:`services.api.hit_rate_request.parse_request`: more distinct ``server_ip`` values, or more than maxCandidates × 4096 candidate-blocks → 400 |

gunicorn's own durations are rounded up to whole seconds (it takes integers); the worker's
deadlines are exact. The hooks (``on_starting``, ``child_exit``, ``worker_exit``,
``on_exit``) run the cross-worker metrics as :mod:`services.api.api_metrics` describes.
gunicorn's own log records go to the root handler that :func:`common.logs.configure`
installed.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
from typing import Any

from gunicorn import glogging

from common.config import parse_listen_addr
from common.settings import ApiSettings
from services.api import api_metrics, hit_rate
from services.api.transport.deadlines import Limits
from services.api.transport.worker import DeadlineWorker

GUNICORN_MAX_LINE = 8190
"""gunicorn refuses larger ``limit_request_line`` / ``limit_request_field_size`` values."""


def _seconds(value: float) -> int:
    return max(1, math.ceil(value))


def bind_address(addr: str) -> str:
    """``host:port`` as gunicorn wants it (IPv6 in brackets), from a Go-style address."""
    host, port = parse_listen_addr(addr)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def gunicorn_settings(
    http: ApiSettings, workers: int | None = None, bind: str | None = None
) -> dict[str, Any]:
    """Every gunicorn setting the API uses (see the module docstring for the mapping)."""
    line = min(http.max_header_bytes, GUNICORN_MAX_LINE)
    return {
        "bind": [bind_address(bind or http.addr)],
        "workers": workers or http.workers,
        "worker_class": worker_class(http),
        "threads": http.threads,
        "timeout": _seconds(max(http.write_timeout, 30)),  # a wedged worker
        "graceful_timeout": _seconds(http.shutdown_timeout),
        "keepalive": _seconds(http.idle_timeout),
        "limit_request_line": line,
        "limit_request_field_size": line,
        "loglevel": "warning" if http.log_level == "warn" else http.log_level,
        "accesslog": None,
        "errorlog": "-",
        "logger_class": RootLogger,
        "proc_name": "cache-indexer-api",
        "control_socket_disable": True,  # no shared ~/.gunicorn/gunicorn.ctl between servers
        "on_starting": on_starting,
        "child_exit": child_exit,
        "worker_exit": worker_exit,
        "on_exit": on_exit,
    }


def worker_class(http: ApiSettings) -> type[DeadlineWorker]:
    """:class:`DeadlineWorker` carrying these limits and the API's error shape (a class:
    gunicorn builds it)."""
    limits = Limits.from_go(
        http.read_header_timeout,
        http.read_timeout,
        http.write_timeout,
        http.idle_timeout,
        http.max_hit_rate_body_bytes,
    )
    error_body = staticmethod(hit_rate.error_body)
    return type("ApiWorker", (DeadlineWorker,), {"limits": limits, "error_body": error_body})


class RootLogger(glogging.Logger):  # type: ignore[misc]
    """gunicorn's logger, but writing through the root handler (one format for the process)."""

    def setup(self, cfg: Any) -> None:
        super().setup(cfg)
        for log in (self.error_log, self.access_log):
            log.handlers.clear()
            log.propagate = True


def on_starting(arbiter: Any) -> None:
    """Master, before forking: a fresh multiprocess directory, inherited by workers via env
    (always our own: files left by another server would be counted as ours)."""
    os.environ[api_metrics.MULTIPROC_ENV] = tempfile.mkdtemp(prefix="cache-indexer-metrics-")


def child_exit(arbiter: Any, worker: Any) -> None:
    """Master: a worker died; its live gauges go, its counter/histogram files stay."""
    shared = os.environ.get(api_metrics.MULTIPROC_ENV)
    if shared:
        from prometheus_client import multiprocess  # here, after on_starting set the env

        multiprocess.mark_process_dead(worker.pid, shared)  # type: ignore[no-untyped-call]


def worker_exit(arbiter: Any, worker: Any) -> None:
    """Worker, exiting: flush its buffered counts into its files."""
    if os.environ.get(api_metrics.MULTIPROC_ENV):
        from common.metrics_buffer import flush_all

        flush_all()


def on_exit(arbiter: Any) -> None:
    shared = os.environ.pop(api_metrics.MULTIPROC_ENV, None)
    if shared:
        shutil.rmtree(shared, ignore_errors=True)
