"""The API's Prometheus metrics; under gunicorn, summed over all workers of one server.

Workers cannot see each other's memory, so they use prometheus_client's multiprocess mode:
the gunicorn master creates an empty directory and exports it as ``PROMETHEUS_MULTIPROC_DIR``
before it forks (``on_starting`` in :mod:`services.api.gunicorn_conf`); every worker keeps
its values in per-process mmap files there, and ``GET /metrics`` on any worker sums all the
files (:func:`common.metrics.render_multiprocess`). A dead worker's counter and histogram
files stay, so its counts keep counting (a counter never goes down); the master's
``child_exit`` calls ``mark_process_dead``, which drops only live-gauge files.

A request's counts are buffered in memory and flushed into the files every second, before
this worker renders ``/metrics`` and in gunicorn's ``worker_exit``
(:mod:`common.metrics_buffer`): the per-request cost stays that of an in-memory add. So
another worker's scrape lags by up to a second, and a worker killed with SIGKILL loses at
most its last second of counts.

prometheus_client reads ``PROMETHEUS_MULTIPROC_DIR`` once, when it is first imported. The
master must therefore not import it (nor :mod:`common.metrics`) before ``on_starting``:
this module imports :mod:`common.metrics` only when an :class:`ApiMetrics` is built, which
happens in the workers, and a worker whose prometheus_client was imported too early refuses
to start instead of silently reporting only its own counts.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from common.metrics import Counter, Histogram, Registry

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
_RATIO_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.99, 1.0)
_TOKEN_BUCKETS = (0, 1, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 65536)
_LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class ApiMetrics:
    """The metrics one API worker records, and the text ``GET /metrics`` answers with.

    ``multiprocess_dir``: the gunicorn master's shared directory (render the sum over all
    workers); ``None``: this process's own registry (tests, a plain single process)."""

    def __init__(self, multiprocess_dir: str | os.PathLike[str] | None = None) -> None:
        from common import metrics

        if multiprocess_dir is not None and not metrics.multiprocess_enabled():
            raise RuntimeError(
                f"prometheus_client was imported before {MULTIPROC_ENV} was set; "
                "the workers' metrics could not be summed"
            )
        self.multiprocess_dir = None if multiprocess_dir is None else str(multiprocess_dir)
        self._render_all = metrics.render_multiprocess
        # Buffered in multiprocess mode: a request costs in-memory adds, not mmap writes.
        self.registry: Registry = metrics.Registry(buffered=self.multiprocess_dir is not None)
        r = self.registry
        self.requests: Counter = r.counter(
            "cache_indexer_api_requests_total",
            "HTTP requests answered, by route and status.",
            ("path", "status"),
        )
        self.latency: Histogram = r.histogram(
            "cache_indexer_api_request_duration_seconds",
            "Time to answer an HTTP request.",
            ("path",),
            _LATENCY_BUCKETS,
        )
        self.redis_errors: Counter = r.counter(
            "cache_indexer_api_redis_errors_total",
            "Redis calls that failed, by operation.",
            ("op",),
        )
        self._register_hit_rate(r)
        self._register_audit(r)
        if self.registry.buffers is not None:
            self.registry.buffers.start()

    def _register_hit_rate(self, r: Registry) -> None:
        """What the hit-rate path counts besides requests and errors."""
        self.hashed_blocks: Counter = r.counter(
            "cache_indexer_api_hashed_blocks_total", "Prompt blocks hashed for hit-rate requests."
        )
        self.inexact: Counter = r.counter(
            "cache_indexer_api_inexact_answers_total",
            "Hit ratios that are only a lower bound of what vLLM reuses, by tier and reason "
            "(one per candidate and tier).",
            ("tier", "reason"),
        )
        self.best_hit_ratio: Histogram = r.histogram(
            "cache_indexer_api_best_hit_ratio",
            "Per hit-rate request and tier, the highest hit ratio among its candidates.",
            ("tier",),
            _RATIO_BUCKETS,
        )
        self.group_rereads: Counter = r.counter(
            "cache_indexer_api_group_rereads_total",
            "Candidates read a second time in one request because their KV-cache groups "
            "changed since the worker last saw them.",
        )

    def _register_audit(self, r: Registry) -> None:
        """The prediction audit's metrics (issue 30)."""
        self.audit_records: Counter = r.counter(
            "cache_indexer_api_audit_records_total",
            "Hit-rate answers with a request_id offered to the audit, by what became of them "
            "(recorded, rate_limited, queue_full, redis_error).",
            ("result",),
        )
        self.audit_outcomes: Counter = r.counter(
            "cache_indexer_api_audit_outcomes_total",
            "Outcome reports compared with the answer given at routing time, by verdict "
            "(exact, under, over), source (router, probe) and whether a difference is explained.",
            ("verdict", "source", "explained"),
        )
        self.audit_difference: Histogram = r.histogram(
            "cache_indexer_api_audit_difference_tokens",
            "Per outcome report, |realized - predicted| cached tokens, by verdict and source.",
            ("verdict", "source"),
            _TOKEN_BUCKETS,
        )

    def render(self) -> bytes:
        """Prometheus text: the sum over all workers, or this process's own metrics."""
        if self.multiprocess_dir is None:
            return self.registry.render().encode()
        self.registry.flush()  # this worker's own counts up to now; the others' lag ≤ 1 s
        return self._render_all(self.multiprocess_dir)


def from_environment() -> ApiMetrics:
    """The metrics of a worker: multiprocess when the master exported the directory."""
    return ApiMetrics(os.environ.get(MULTIPROC_ENV) or None)
