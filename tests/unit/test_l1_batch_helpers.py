"""services.l1_ingest.batch's helpers, in-process (found open by mutation testing, issue 33):
what an applied write counts (the L1 metrics operators read), the payload digest a restarted
ingester compares with the stored one, and how a stored cursor is shown. Each test names the
wrong versions it kills, applied by hand and seen to fail (docs/testing.md, "Issue 33")."""

from __future__ import annotations

import hashlib
from collections import Counter

from common.event_types import BlockStored
from common.events import encode_batch
from common.store import ApplyResult, BatchStatus, StoredCursor
from services.l1_ingest.apply import GroupSettings, Plan, Step
from services.l1_ingest.batch import count_applied, decode_plan, payload_digest, show_cursor
from services.l1_ingest.metrics import IngestMetrics
from tests.metrics_oracle import value_of


def test_an_applied_write_counts_each_outcome_medium_and_tier_by_its_own_labels() -> None:
    """Kills any count's amount (``inc()`` counts 1) or label dropped or replaced."""
    metrics = IngestMetrics()
    plan = Plan(
        outcomes=Counter({("BlockStored", "l1"): 3, ("BlockRemoved", "l2"): 2}),
        other_media=Counter({"cpu": 4}),
        hash_updates=Counter({"l1": 5, "l2": 6}),
    )
    count_applied(metrics, plan, ApplyResult(BatchStatus.APPLIED, unknown_removes=7))
    assert value_of(metrics.events, type="BlockStored", outcome="l1") == 3
    assert value_of(metrics.events, type="BlockRemoved", outcome="l2") == 2
    assert value_of(metrics.skipped_media, medium="cpu") == 4
    assert value_of(metrics.hash_updates, tier="l1") == 5
    assert value_of(metrics.hash_updates, tier="l2") == 6
    assert value_of(metrics.unknown_removes) == 7


def test_the_payload_digest_is_eight_bytes_of_blake2b() -> None:
    """The digest is stored next to the applied seq and compared, after an ingester restart
    or a failover, with the replayed batch at that seq: another size or function would take
    every stored digest of a rolling upgrade for a vLLM restart. Kills ``digest_size`` 9 or
    the default 64."""
    assert payload_digest(b"batch") == hashlib.blake2b(b"batch", digest_size=8).digest()
    assert len(payload_digest(b"")) == 8


def test_a_stored_cursor_is_shown_with_its_seq_and_digest() -> None:
    """Seq 0 is a cursor like any other (only a missing or negative one is "none"); the
    digest is shown when there is one. Kills ``seq <= 0`` / ``< 1``, the texts, and the
    digest's condition forced either way."""
    assert show_cursor(StoredCursor(0)) == "seq 0"
    assert show_cursor(StoredCursor(5, "00ab")) == "seq 5 (00ab)"
    assert show_cursor(StoredCursor(5)) == "seq 5"
    assert show_cursor(StoredCursor(-1)) == show_cursor(StoredCursor(None)) == "none"


def test_a_decoded_batch_carries_the_configured_group_settings() -> None:
    """The config's hash unit, chunk size and DP size go with the batch's group descriptors
    into the store; without them a configured ``prefixMatchUnit`` or chunk never reaches the
    index. Kills ``plan_ops(batch, None)`` and ``plan_ops(batch)`` in ``decode_plan``."""
    event = BlockStored(
        [1, 2], None, list(range(8)), 4, medium="GPU", group_idx=0,
        kv_cache_spec_kind="full_attention",
    )  # fmt: skip
    payload = encode_batch([event], ts=1.0, data_parallel_rank=0, vllm_version=(0, 28))
    plan, events = decode_plan("pod", Step(7, payload), GroupSettings(16, 64, 2), IngestMetrics())
    assert events == [event]
    assert ("H", "", 0, [16, 64, 2]) in plan.ops.ops
