"""The audit prober's metrics, registered once on the process's :class:`Registry`.

No label names an instance: a fleet of thousands of pods must not become thousands of
series. Which instance a bad outcome came from is in the prober's log and in the API's
audit view (the probe's report is recorded there like a router's).
"""

from __future__ import annotations

from dataclasses import dataclass

from common.metrics import Counter, Gauge, Histogram, Registry
from services.prober.probe import Outcome

_PROBE_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0)


@dataclass(frozen=True)
class ProberMetrics:
    outcomes: Counter
    probe_seconds: Histogram
    instances: Gauge
    in_flight: Gauge
    errors: Counter

    @classmethod
    def register(cls, registry: Registry | None = None) -> ProberMetrics:
        r = registry or Registry()
        p = "cache_indexer_probe_"
        metrics = cls(
            outcomes=r.counter(
                p + "outcomes_total",
                "finished probes by outcome: exact, under, over (the API's verdict), "
                "events_missing, no_cached_tokens, engine_error, api_error, timeout, "
                "no_endpoint (docs/operations.md 'Audit probes')",
                ["outcome"],
            ),
            probe_seconds=r.histogram(
                p + "seconds", "duration of one probe, any outcome", buckets=_PROBE_BUCKETS
            ),
            instances=r.gauge(p + "instances", "instances in the last registry read"),
            in_flight=r.gauge(p + "in_flight", "probes running now"),
            errors=r.counter(
                p + "errors_total",
                "registry reads (GET /kv-cache/instances) that failed",
                ["kind"],
            ),
        )
        for outcome in Outcome:  # every series from the start: rate() and alerts see zeros
            metrics.outcomes.inc(0, outcome=outcome.value)
        metrics.errors.inc(0, kind="instances")
        return metrics
