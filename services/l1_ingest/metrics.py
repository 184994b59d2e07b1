"""The L1 ingester's Prometheus metrics (one :class:`IngestMetrics` per process)."""

from __future__ import annotations

from common.metrics import Counter, Gauge, Histogram, Registry

_LATENCY_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


class IngestMetrics:
    """Counters by outcome; label values are small fixed sets (never hashes or payloads)."""

    events: Counter
    hash_updates: Counter
    batches: Counter
    unknown_removes: Counter
    gaps: Counter
    restarts: Counter
    resyncs: Counter
    replays: Counter
    malformed_frames: Counter
    skipped_media: Counter
    apply_seconds: Histogram
    connected: Gauge
    subscribed: Gauge
    hash_checks: Counter
    hash_check_unchecked: Counter
    hash_check_hints: Counter
    status_writes: Counter

    def __init__(self, registry: Registry | None = None) -> None:
        self.registry = registry or Registry()
        self._event_metrics(self.registry)
        self._sequence_metrics(self.registry)
        self._process_metrics(self.registry)

    def _event_metrics(self, r: Registry) -> None:
        """What the events of applied batches did."""
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
        self.skipped_media = r.counter(
            "cache_indexer_l1_skipped_media_events_total",
            "events kept out of L1 because of their medium",
            ("medium",),
        )
        self.unknown_removes = r.counter(
            "cache_indexer_l1_unknown_removes_total",
            "removed hashes the index did not hold for that rank (drift: a store never seen)",
        )
        self.malformed_frames = r.counter(
            "cache_indexer_l1_malformed_frames_total",
            "ZMQ messages dropped unapplied, by reason (framing, replay_framing, not_a_batch)",
            ("reason",),
        )

    def _sequence_metrics(self, r: Registry) -> None:
        """The batches' writes and the rank's sequence: gaps, restarts, re-syncs, replays."""
        self.batches = r.counter(
            "cache_indexer_l1_batches_total",
            "batches by result (BatchStatus: applied, duplicate, stale_gen, not_owner, …)",
            ("result",),
        )
        self.apply_seconds = r.histogram(
            "cache_indexer_l1_apply_seconds",
            "time of one Store.apply_batch round trip",
            (),
            _LATENCY_BUCKETS,
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

    def _process_metrics(self, r: Registry) -> None:
        """The sockets, the block-hash self-check and the status writes."""
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
