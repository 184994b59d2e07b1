"""Prometheus metrics on ``prometheus_client``: a small facade and the workers' endpoint.

One :class:`Registry` per process; it owns a :class:`prometheus_client.CollectorRegistry`.
Services declare metrics on it (:meth:`Registry.counter`, :meth:`~Registry.gauge`,
:meth:`~Registry.histogram`) with their exposition names (counters end in ``_total``) and
record with keyword labels, ``requests.inc(path="/x", status="200")``; a label left out is
``""``. ``*_created`` series are disabled, so the exposed names are exactly the declared ones.

Workers expose their registry with :func:`serve` on their metrics port: ``/metrics``
(prometheus_client's WSGI app: text format, OpenMetrics and gzip when asked for),
``/healthz`` and ``/readyz`` (:class:`common.health.Health`), whose answers also appear in
``/metrics`` as ``cache_indexer_worker_live`` and ``cache_indexer_worker_condition{condition}``
(1 or 0, computed at scrape time: alerts see a stuck loop before the kubelet restarts it,
and a failing condition names what is missing, e.g. ``redis``). The API's gunicorn workers
share one port and use prometheus_client's multiprocess mode instead (values in per-process
mmap files under ``PROMETHEUS_MULTIPROC_DIR``, which must be set before this module is first
imported): :func:`render_multiprocess` sums them. Their registry is *buffered* (counts add up
in memory and are flushed into prometheus_client every second, see
:mod:`common.metrics_buffer`), because a multiprocess value write is an mmap write.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from socketserver import ThreadingMixIn
from typing import Any, Literal
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import prometheus_client
from prometheus_client import CollectorRegistry, generate_latest, make_wsgi_app, values
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector

from common.health import Health
from common.metrics_buffer import BufferedCount, BufferedObserver, Buffers, Flushable

logger = logging.getLogger(__name__)

DEFAULT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)

prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]

_Labels = tuple[str, ...]
GaugeMode = Literal[
    "all",
    "liveall",
    "min",
    "livemin",
    "max",
    "livemax",
    "sum",
    "livesum",
    "mostrecent",
    "livemostrecent",
]


class _Metric:
    """One metric family. Recorders are cached by the caller's keyword labels as given, so
    the hot path is one dict lookup; a miss resolves them (a missing label is ``""``)."""

    def __init__(self, metric: Any, labels: Sequence[str], buffers: Buffers | None) -> None:
        self.name: str = metric.describe()[0].name  # a counter's name without "_total"
        self.labels = tuple(labels)
        self._metric = metric
        self._buffers = buffers
        self._by_call: dict[tuple[tuple[str, str], ...], Any] = {}
        self._by_values: dict[_Labels, Any] = {}

    def _buffered(self, child: Any) -> Flushable | None:
        return None

    def _get(self, labels: dict[str, str]) -> Any:
        try:
            return self._by_call[tuple(labels.items())]
        except KeyError:
            child = self._child(labels)
            buffered = self._buffered(child) if self._buffers is not None else None
            if buffered is not None and self._buffers is not None:
                self._buffers.add(buffered)
            recorder = self._by_call[tuple(labels.items())] = buffered or child
            return recorder

    def _child(self, labels: dict[str, str]) -> Any:
        if not self.labels:
            return self._metric  # labels given to an unlabelled metric are ignored
        key = tuple([str(labels.get(n, "")) for n in self.labels])
        child = self._by_values.get(key)
        if child is None:
            child = self._by_values[key] = self._metric.labels(*key)
        return child


class Counter(_Metric):
    def _buffered(self, child: Any) -> Flushable | None:
        return BufferedCount(child)

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        if amount < 0:
            raise ValueError(f"{self.name}: a counter only goes up, got {amount}")
        self._get(labels).inc(amount)


class Gauge(_Metric):
    def set(self, value: float, **labels: str) -> None:
        self._get(labels).set(value)

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        self._get(labels).inc(amount)


class Histogram(_Metric):
    def _buffered(self, child: Any) -> Flushable | None:
        try:
            return BufferedObserver(child)
        except AttributeError:  # another prometheus_client layout: record unbuffered
            return None

    def observe(self, value: float, **labels: str) -> None:
        self._get(labels).observe(value)


class Registry:
    """A process's metrics; ``collector`` is the prometheus_client registry behind them."""

    def __init__(self, buffered: bool = False) -> None:
        """``buffered``: counters and histograms add up in memory and are flushed into
        prometheus_client (see :mod:`common.metrics_buffer`; for multiprocess mode)."""
        self.collector = CollectorRegistry(auto_describe=True)
        self.buffers = Buffers() if buffered else None

    def flush(self) -> None:
        if self.buffers is not None:
            self.buffers.flush()

    def counter(self, name: str, doc: str, labels: Sequence[str] = ()) -> Counter:
        return Counter(
            prometheus_client.Counter(name, doc, tuple(labels), registry=self.collector),
            labels,
            self.buffers,
        )

    def gauge(
        self,
        name: str,
        doc: str,
        labels: Sequence[str] = (),
        multiprocess_mode: GaugeMode = "livesum",
    ) -> Gauge:
        """``multiprocess_mode`` matters only under multiprocess mode: the default sums the
        live processes' values (a dead process's gauge is dropped by ``mark_process_dead``)."""
        return Gauge(
            prometheus_client.Gauge(
                name,
                doc,
                tuple(labels),
                registry=self.collector,
                multiprocess_mode=multiprocess_mode,
            ),
            labels,
            None,
        )

    def histogram(
        self,
        name: str,
        doc: str,
        labels: Sequence[str] = (),
        buckets: Sequence[float] = DEFAULT_BUCKETS,
    ) -> Histogram:
        return Histogram(
            prometheus_client.Histogram(
                name, doc, tuple(labels), registry=self.collector, buckets=sorted(buckets)
            ),
            labels,
            self.buffers,
        )

    def render(self) -> str:
        """This registry in the Prometheus text format."""
        self.flush()
        return generate_latest(self.collector).decode()


def multiprocess_enabled() -> bool:
    """Whether prometheus_client picked its multiprocess values when first imported (it
    reads ``PROMETHEUS_MULTIPROC_DIR`` once, at import; see :mod:`services.api.api_metrics`)."""
    return bool(getattr(values.ValueClass, "_multiprocess", False))


def render_multiprocess(path: str) -> bytes:
    """The sum over every process that wrote metric files under ``path`` (live or dead)."""
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path)  # type: ignore[no-untyped-call]
    return generate_latest(registry)


# ---- the workers' HTTP endpoint --------------------------------------------------------

_WSGIApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (base signature)
        pass


def _text(start_response: Callable[..., Any], status: str, body: str) -> list[bytes]:
    data = body.encode()
    start_response(
        status, [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(data)))]
    )
    return [data]


def endpoint(registry: Registry, health: Health | None = None) -> _WSGIApp:
    """The WSGI app :func:`serve` runs: ``/metrics``, ``/healthz``, ``/readyz``."""
    metrics_app = make_wsgi_app(registry.collector)

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == "/metrics":
            return metrics_app(environ, start_response)  # type: ignore[no-any-return]
        if path in ("/healthz", "/readyz"):
            if health is None:
                return _text(start_response, "200 OK", "ok\n")
            ok, detail = health.liveness() if path == "/healthz" else health.readiness()
            status = "200 OK" if ok else "503 Service Unavailable"
            return _text(start_response, status, detail + "\n")
        return _text(start_response, "404 Not Found", "not found\n")

    return app


class _HealthCollector:
    """The probes' answers as gauges, read from :class:`Health` at every scrape."""

    def __init__(self, health: Health) -> None:
        self.health = health

    def describe(self) -> list[Any]:
        return []  # families vary with the conditions; nothing to reserve at registration

    def collect(self) -> Iterable[GaugeMetricFamily]:
        live = GaugeMetricFamily(
            "cache_indexer_worker_live", "1 while every loop of this worker makes progress"
        )
        live.add_metric((), 1 if self.health.liveness()[0] else 0)
        cond = GaugeMetricFamily(
            "cache_indexer_worker_condition",
            "1 while the readiness condition holds (e.g. redis: the last Redis call worked)",
            labels=("condition",),
        )
        for name, ok in self.health.conditions():
            cond.add_metric((name,), 1 if ok else 0)
        return [live, cond]


def serve(registry: Registry, host: str, port: int, health: Health | None = None) -> WSGIServer:
    """Serve ``/metrics``, ``/healthz`` and ``/readyz`` from daemon threads; returns the
    server (``server_address``, ``shutdown()``). Without ``health`` both probes answer 200
    and no ``cache_indexer_worker_*`` gauges are exported."""
    if health is not None:
        registry.collector.register(_HealthCollector(health))
    server = make_server(
        host, port, endpoint(registry, health), server_class=_Server, handler_class=_QuietHandler
    )
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    logger.info("metrics on http://%s:%d/metrics", host, server.server_address[1])
    return server
