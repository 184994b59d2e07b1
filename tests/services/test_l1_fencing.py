"""A refused L1 write raises FencedError from the rank stream; the subscriber's guard drops the
instance and schedules a resubscription instead of writing on."""

from __future__ import annotations

import pytest
import zmq

from common.errors import FencedError
from common.events import BlockStored, encode_batch
from common.store import BatchStatus, Instance, Store
from services.l1_ingest.metrics import IngestMetrics
from services.l1_ingest.stream import RankStream

IP = "10.1.2.3"


def _payload(first: int) -> bytes:
    events = [BlockStored([first], None, list(range(4)), 4, medium="GPU")]
    return encode_batch(events, ts=1.0, data_parallel_rank=0, vllm_version=(0, 28, 0))


def _stream(store: Store, inst: Instance, metrics: IngestMetrics, owner: str = "") -> RankStream:
    return RankStream(inst, 0, store, zmq.Context.instance(), owner=owner, gap_policy="keep",
                      replay_timeout=1.0, metrics=metrics)


def test_a_write_for_a_stale_generation_raises_fenced(any_store: Store) -> None:
    _, gen = any_store.upsert_instance(Instance(ip=IP, uid="old-pod"))
    inst = Instance(ip=IP, uid="old-pod", gen=gen)
    metrics = IngestMetrics()
    stream = _stream(any_store, inst, metrics)
    stream.on_live(0, _payload(1))
    assert any_store.tier_members(IP) == {1}
    any_store.upsert_instance(Instance(ip=IP, uid="new-pod"))  # a new pod took the IP
    with pytest.raises(FencedError) as caught:
        stream.on_live(1, _payload(2))
    assert caught.value.status == BatchStatus.STALE_GEN == "stale_gen"
    assert metrics.batches.value(result="stale_gen") == 1  # the label value is unchanged
    assert any_store.tier_members(IP) == set()


def test_a_write_without_the_lease_raises_fenced(any_store: Store) -> None:
    _, gen = any_store.upsert_instance(Instance(ip=IP, uid="pod"))
    assert any_store.claim_instance(IP, "other-ingester", 60_000)
    stream = _stream(any_store, Instance(ip=IP, uid="pod", gen=gen), IngestMetrics(),
                     owner="me")
    with pytest.raises(FencedError) as caught:
        stream.on_live(0, _payload(1))
    assert caught.value.status is BatchStatus.NOT_OWNER
    assert any_store.tier_members(IP) == set()
