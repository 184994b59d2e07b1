"""``cache_indexer_l1_unknown_removes_total``: a BlockRemoved for a hash the index does not
hold for that rank (the store script's ``unknown_removes``) is counted, as drift."""

from __future__ import annotations

import zmq

from common.events import BlockRemoved, BlockStored, Event, encode_batch
from common.store import Instance, Store
from services.l1_ingest.metrics import IngestMetrics
from services.l1_ingest.stream import RankStream
from tests.metrics_oracle import value_of

IP = "10.1.2.4"


def _payload(*events: Event) -> bytes:
    return encode_batch(list(events), ts=1.0, data_parallel_rank=0, vllm_version=(0, 28, 0))


def test_removes_of_hashes_the_index_does_not_hold_are_counted(any_store: Store) -> None:
    _, gen = any_store.upsert_instance(Instance(ip=IP, uid="pod"))
    metrics = IngestMetrics()
    stream = RankStream(
        Instance(ip=IP, uid="pod", gen=gen),
        0,
        any_store,
        zmq.Context.instance(),
        owner="",
        gap_policy="keep",
        replay_timeout=1.0,
        metrics=metrics,
    )
    stream.on_live(0, _payload(BlockStored([1], None, [1, 2], 2, medium="GPU")))
    assert value_of(metrics.unknown_removes) == 0
    stream.on_live(1, _payload(BlockRemoved([1], "GPU"), BlockRemoved([99], "GPU")))
    assert any_store.tier_members(IP) == set()
    assert value_of(metrics.unknown_removes) == 1  # 99 was never stored
    stream.on_live(2, _payload(BlockRemoved([1], "GPU")))
    assert value_of(metrics.unknown_removes) == 2  # 1 is already gone
