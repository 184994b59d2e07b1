"""The L3 poller's metrics, registered once on the process's :class:`Registry`."""

from __future__ import annotations

from dataclasses import dataclass, field

from common.metrics import Counter, Gauge, Histogram, Registry

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
        p = "cache_indexer_l3_"
        return cls(
            keys_seen=r.counter(p + "keys_seen_total", "lines of /get_all_keys read", ["master"]),
            keys_parsed=r.counter(p + "keys_parsed_total", "vLLM store keys parsed", ["master"]),
            keys_skipped=r.counter(
                p + "keys_skipped_total",
                "keys skipped: unparsed (other connector/tenant), unquotable (cannot go raw "
                "into a URL)",
                ["master", "reason"],
            ),
            keys_located=r.counter(
                p + "keys_located_total", "keys whose replicas were queried", ["master"]
            ),
            locate_calls=r.counter(
                p + "locate_calls_total", "replica lookups by endpoint", ["master", "endpoint"]
            ),
            poll_seconds=r.histogram(
                p + "poll_seconds",
                "duration of one successful poll",
                ["master"],
                buckets=_POLL_BUCKETS,
            ),
            write_seconds=r.histogram(
                p + "write_seconds", "Redis write of all instances' sets", buckets=_POLL_BUCKETS
            ),
            sets_written=r.counter(
                p + "sets_written_total", "instance L3 sets rewritten (unchanged ones are skipped)"
            ),
            sets_lost=r.counter(
                p + "sets_lost_total",
                "unchanged instance L3 sets found not as written (a write Redis lost, or a new "
                "generation) and rewritten",
            ),
            errors=r.counter(
                p + "errors_total", "failed polls and writes by reason", ["master", "reason"]
            ),
            master_keys=r.gauge(p + "master_keys", "parsed keys in the last good poll", ["master"]),
            master_blocks=r.gauge(
                p + "master_blocks", "complete blocks in the last good poll", ["master"]
            ),
            master_stale=r.gauge(
                p + "master_stale", "1 once a master's state was dropped", ["master"]
            ),
            keys_unparsed=r.gauge(
                p + "keys_unparsed",
                "keys of the last good poll in no known key family "
                "(another connector or tenant, or a key format this version does not know)",
                ["master"],
            ),
            keys_unmappable_group=r.gauge(
                p + "keys_unmappable_group",
                "keys of the last good poll in KV-cache groups "
                "whose hashes are not vLLM block hashes (vllm-ascend v0.21-v0.24 grouped "
                "rehash): parsed, but in no L3 set",
                ["master"],
            ),
            registry=r,
        )
