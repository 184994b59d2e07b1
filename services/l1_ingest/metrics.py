"""The L1 ingester's Prometheus metrics (one :class:`IngestMetrics` per process)."""

from __future__ import annotations

from common.metrics import Registry

_LATENCY_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


class IngestMetrics:
    """Counters by outcome; label values are small fixed sets (never hashes or payloads)."""

    def __init__(self, registry: Registry | None = None) -> None:
        r = self.registry = registry or Registry()
        self.events = r.counter(
            "cache_indexer_l1_events_total",
            "KV events by type and outcome (l1, l2, placeholder, skipped:<reason>)",
            ("type", "outcome"),
        )
        self.hash_updates = r.counter(
            "cache_indexer_l1_hash_updates_total",
            "block hashes stored or removed, by tier",
            ("tier",),
        )
        self.batches = r.counter(
            "cache_indexer_l1_batches_total",
            "batches by result (BatchStatus: applied, duplicate, stale_gen, not_owner, …)",
            ("result",),
        )
        self.unknown_removes = r.counter(
            "cache_indexer_l1_unknown_removes_total",
            "removed hashes the index did not hold for that rank (drift: a store never seen)",
        )
        self.gaps = r.counter(
            "cache_indexer_l1_gaps_total",
            "sequence gaps by outcome (recovered, unrecoverable)",
            ("outcome",),
        )
        self.restarts = r.counter(
            "cache_indexer_l1_publisher_restarts_total",
            "vLLM publisher restarts detected (seq went back)",
        )
        self.resyncs = r.counter(
            "cache_indexer_l1_resyncs_total",
            "rank re-syncs because the stored cursor was not the one applied (lost writes)",
        )
        self.replays = r.counter(
            "cache_indexer_l1_replays_total",
            "replay requests by result (complete, timeout)",
            ("result",),
        )
        self.malformed_frames = r.counter(
            "cache_indexer_l1_malformed_frames_total",
            "ZMQ messages dropped unapplied, by reason (framing, replay_framing, not_a_batch)",
            ("reason",),
        )
        self.skipped_media = r.counter(
            "cache_indexer_l1_skipped_media_events_total",
            "events kept out of L1 because of their medium",
            ("medium",),
        )
        self.apply_seconds = r.histogram(
            "cache_indexer_l1_apply_seconds",
            "time of one Store.apply_batch round trip",
            (),
            _LATENCY_BUCKETS,
        )
        self.connected = r.gauge(
            "cache_indexer_l1_connected_sockets", "SUB sockets currently connected to a publisher"
        )
        self.subscribed = r.gauge(
            "cache_indexer_l1_subscribed_ranks", "instance ranks this ingester subscribes to"
        )
        self.hash_checks = r.counter(
            "cache_indexer_l1_hash_check_total",
            "blocks whose hash was recomputed by the self-check, by result (ok, mismatch)",
            ("result",),
        )
        self.hash_check_unchecked = r.counter(
            "cache_indexer_l1_hash_check_unchecked_total",
            "sampled events the self-check could not verify, by reason",
            ("reason",),
        )
        self.hash_check_hints = r.counter(
            "cache_indexer_l1_hash_check_hint_total",
            "mismatches explained by another setting (counted once per change and instance)",
            ("seed", "algo", "extra_keys"),
        )
        self.status_writes = r.counter(
            "cache_indexer_l1_status_writes_total",
            "per-instance status writes to Redis, by result (ok, refused, error)",
            ("result",),
        )
