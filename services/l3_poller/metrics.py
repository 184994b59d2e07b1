"""The L3 poller's metrics, registered once on the process's :class:`Registry`."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

from common.metrics import Counter, Gauge, Histogram, Registry

_PREFIX = "cache_indexer_l3_"
_POLL_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


@dataclass(frozen=True)
class PollerMetrics:
    keys_seen: Counter
    keys_parsed: Counter
    keys_skipped: Counter
    keys_located: Counter
    locate_calls: Counter
    poll_seconds: Histogram
    write_seconds: Histogram
    sets_written: Counter
    sets_lost: Counter
    errors: Counter
    master_keys: Gauge
    master_blocks: Gauge
    master_stale: Gauge
    keys_unparsed: Gauge
    keys_unmappable_group: Gauge
    registry: Registry = field(default_factory=Registry)

    @classmethod
    def register(cls, registry: Registry | None = None) -> PollerMetrics:
        r = registry or Registry()
        counter, gauge = partial(_counter, r), partial(_gauge, r)
        histogram = partial(r.histogram, buckets=_POLL_BUCKETS)
        return cls(
            keys_seen=counter("keys_seen_total", "lines of /get_all_keys read"),
            keys_parsed=counter("keys_parsed_total", "vLLM store keys parsed"),
            keys_skipped=counter(
                "keys_skipped_total",
                "keys skipped: unparsed (other connector/tenant), unquotable (cannot go raw "
                "into a URL)",
                "reason",
            ),
            keys_located=counter("keys_located_total", "keys whose replicas were queried"),
            locate_calls=counter("locate_calls_total", "replica lookups by endpoint", "endpoint"),
            poll_seconds=histogram(
                _PREFIX + "poll_seconds", "duration of one successful poll", ["master"]
            ),
            write_seconds=histogram(
                _PREFIX + "write_seconds", "Redis write of all instances' sets"
            ),
            sets_written=r.counter(
                _PREFIX + "sets_written_total",
                "instance L3 sets rewritten (unchanged ones are skipped)",
            ),
            sets_lost=r.counter(
                _PREFIX + "sets_lost_total",
                "unchanged instance L3 sets found not as written (a write Redis lost, or a new "
                "generation) and rewritten",
            ),
            errors=counter("errors_total", "failed polls and writes by reason", "reason"),
            master_keys=gauge("master_keys", "parsed keys in the last good poll"),
            master_blocks=gauge("master_blocks", "complete blocks in the last good poll"),
            master_stale=gauge("master_stale", "1 once a master's state was dropped"),
            keys_unparsed=gauge(
                "keys_unparsed",
                "keys of the last good poll in no known key family "
                "(another connector or tenant, or a key format this version does not know)",
            ),
            keys_unmappable_group=gauge(
                "keys_unmappable_group",
                "keys of the last good poll in KV-cache groups "
                "whose hashes are not vLLM block hashes (vllm-ascend v0.21-v0.24 grouped "
                "rehash): parsed, but in no L3 set",
            ),
            registry=r,
        )


def _counter(r: Registry, name: str, doc: str, *labels: str) -> Counter:
    """A counter labelled by master (and ``labels``)."""
    return r.counter(_PREFIX + name, doc, ["master", *labels])


def _gauge(r: Registry, name: str, doc: str) -> Gauge:
    """A gauge labelled by master."""
    return r.gauge(_PREFIX + name, doc, ["master"])
