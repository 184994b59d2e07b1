"""Prometheus text metrics without a client library: counters, gauges, histograms.

One :class:`Registry` per process. Workers expose it with :func:`serve` on their metrics
port (``metrics.port``; 0 = off). Processes that share a port (gunicorn workers) merge
their :meth:`Registry.snapshot` dicts with :func:`merge_snapshots` before rendering.
"""

from __future__ import annotations

import logging
import threading
from bisect import bisect_left
from collections.abc import Iterable, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

logger = logging.getLogger(__name__)

LabelValues = tuple[str, ...]
DEFAULT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class _Metric:
    kind = "untyped"

    def __init__(self, name: str, doc: str, labels: Sequence[str] = ()) -> None:
        self.name, self.doc, self.labels = name, doc, tuple(labels)
        self._lock = threading.Lock()
        self._values: dict[LabelValues, Any] = {}

    def _key(self, labels: dict[str, str]) -> LabelValues:
        return tuple(str(labels.get(n, "")) for n in self.labels)


class Counter(_Metric):
    kind = "counter"

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        key = self._key(labels)
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount

    def value(self, **labels: str) -> float:
        return float(self._values.get(self._key(labels), 0.0))


class Gauge(Counter):
    kind = "gauge"

    def set(self, value: float, **labels: str) -> None:
        with self._lock:
            self._values[self._key(labels)] = float(value)


class Histogram(_Metric):
    kind = "histogram"

    def __init__(self, name: str, doc: str, labels: Sequence[str] = (),
                 buckets: Sequence[float] = DEFAULT_BUCKETS) -> None:
        super().__init__(name, doc, labels)
        self.buckets = tuple(sorted(buckets))

    def observe(self, value: float, **labels: str) -> None:
        key = self._key(labels)
        with self._lock:
            state = self._values.setdefault(key, [[0] * (len(self.buckets) + 1), 0.0])
            state[0][bisect_left(self.buckets, value)] += 1
            state[1] += value


class Registry:
    def __init__(self) -> None:
        self._metrics: dict[str, _Metric] = {}

    def _add(self, metric: _Metric) -> Any:
        self._metrics[metric.name] = metric
        return metric

    def counter(self, name: str, doc: str, labels: Sequence[str] = ()) -> Counter:
        return self._add(Counter(name, doc, labels))  # type: ignore[no-any-return]

    def gauge(self, name: str, doc: str, labels: Sequence[str] = ()) -> Gauge:
        return self._add(Gauge(name, doc, labels))  # type: ignore[no-any-return]

    def histogram(self, name: str, doc: str, labels: Sequence[str] = (),
                  buckets: Sequence[float] = DEFAULT_BUCKETS) -> Histogram:
        return self._add(Histogram(name, doc, labels, buckets))  # type: ignore[no-any-return]

    def snapshot(self) -> dict[str, Any]:
        """A JSON-able copy: name → {kind, doc, labels, buckets?, values: [[labels, v], …]}."""
        out: dict[str, Any] = {}
        for m in self._metrics.values():
            with m._lock:
                values = [[list(k), _copy(v)] for k, v in m._values.items()]
            out[m.name] = {"kind": m.kind, "doc": m.doc, "labels": list(m.labels),
                           "buckets": list(getattr(m, "buckets", ())), "values": values}
        return out

    def render(self) -> str:
        return render(self.snapshot())


def _copy(v: Any) -> Any:
    return [list(v[0]), v[1]] if isinstance(v, list) else v


def merge_snapshots(snaps: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """Sum counters and histograms across processes; gauges are summed too (per-process sizes)."""
    merged: dict[str, Any] = {}
    for snap in snaps:
        for name, m in snap.items():
            into = merged.setdefault(name, {**m, "values": []})
            index = {tuple(lv): i for i, (lv, _) in enumerate(into["values"])}
            for lv, v in m["values"]:
                i = index.get(tuple(lv))
                if i is None:
                    into["values"].append([lv, _copy(v)])
                    index[tuple(lv)] = len(into["values"]) - 1
                elif isinstance(v, list):
                    cur = into["values"][i][1]
                    cur[0] = [a + b for a, b in zip(cur[0], v[0])]
                    cur[1] += v[1]
                else:
                    into["values"][i][1] += v
    return merged


def _labels(names: Sequence[str], values: Sequence[str], extra: str = "") -> str:
    parts = [f'{n}="{_escape(v)}"' for n, v in zip(names, values)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def render(snapshot: dict[str, Any]) -> str:
    lines: list[str] = []
    for name, m in snapshot.items():
        lines += [f"# HELP {name} {m['doc']}", f"# TYPE {name} {m['kind']}"]
        for lv, v in m["values"]:
            if m["kind"] != "histogram":
                lines.append(f"{name}{_labels(m['labels'], lv)} {_num(v)}")
                continue
            counts, total, cum = v[0], v[1], 0
            for bound, c in zip([*m["buckets"], float("inf")], counts):
                cum += c
                le = "+Inf" if bound == float("inf") else repr(float(bound))
                le_label = 'le="' + le + '"'
                lines.append(f"{name}_bucket{_labels(m['labels'], lv, le_label)} {cum}")
            lines.append(f"{name}_sum{_labels(m['labels'], lv)} {_num(total)}")
            lines.append(f"{name}_count{_labels(m['labels'], lv)} {cum}")
    return "\n".join(lines) + "\n"


def _num(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else repr(float(v))


def serve(registry: Registry, host: str, port: int) -> ThreadingHTTPServer:
    """Serve ``GET /metrics`` (and ``/healthz``) from a daemon thread; returns the server."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server API)
            if self.path.split("?")[0] == "/metrics":
                body, ctype = registry.render().encode(), "text/plain; version=0.0.4"
                code = 200
            elif self.path == "/healthz":
                body, ctype, code = b"ok\n", "text/plain", 200
            else:
                body, ctype, code = b"not found\n", "text/plain", 404
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_args: Any) -> None:
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    logger.info("metrics on http://%s:%d/metrics", host, server.server_address[1])
    return server
