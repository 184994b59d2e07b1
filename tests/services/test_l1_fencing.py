"""A refused L1 write raises FencedError from the rank stream; the subscriber's guard drops the
instance and schedules a resubscription instead of writing on."""

from __future__ import annotations

import itertools
import logging
import threading

import pytest
import redis
import zmq

from common.errors import FencedError
from common.events import BlockStored, encode_batch
from common.settings import L1IngestSettings
from common.store import BatchStatus, Instance, Store
from services.l1_ingest.metrics import IngestMetrics
from services.l1_ingest.stream import RankStream
from services.l1_ingest.subscriber import Subscriber
from tests.conftest import reserve_port, wait_for
from tests.metrics_oracle import value_of
from tests.store_oracle import OracleStore

IP = "10.1.2.3"


def _payload(first: int) -> bytes:
    events = [BlockStored([first], None, list(range(4)), 4, medium="GPU")]
    return encode_batch(events, ts=1.0, data_parallel_rank=0, vllm_version=(0, 28, 0))


def _stream(store: Store, inst: Instance, metrics: IngestMetrics, owner: str = "") -> RankStream:
    return RankStream(
        inst,
        0,
        store,
        zmq.Context.instance(),
        owner=owner,
        gap_policy="keep",
        replay_timeout=1.0,
        metrics=metrics,
    )


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
    assert value_of(metrics.batches, result="stale_gen") == 1  # the label value is unchanged
    assert any_store.tier_members(IP) == set()


def test_a_write_without_the_lease_raises_fenced(any_store: Store) -> None:
    _, gen = any_store.upsert_instance(Instance(ip=IP, uid="pod"))
    assert any_store.claim_instance(IP, "other-ingester", 60_000)
    stream = _stream(any_store, Instance(ip=IP, uid="pod", gen=gen), IngestMetrics(), owner="me")
    with pytest.raises(FencedError) as caught:
        stream.on_live(0, _payload(1))
    assert caught.value.status is BatchStatus.NOT_OWNER
    assert any_store.tier_members(IP) == set()


def test_the_subscriber_drops_a_fenced_instance_and_resubscribes(
    redis_client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """The lease is taken away mid-stream: the refused write ends the session (logged as a
    refused write, not as a loop error), and once the lease is back the stream resumes."""
    store, port, seq = OracleStore(redis_client), reserve_port(), itertools.count()
    store.upsert_instance(Instance(ip=IP, uid="u", zmq_endpoint=f"tcp://127.0.0.1:{port}"))
    assert store.claim_instance(IP, "me", 60_000)
    pub = zmq.Context.instance().socket(zmq.PUB)
    pub.bind(f"tcp://127.0.0.1:{port}")
    settings = L1IngestSettings(topic="kv", backoff_initial=0.05, backoff_max=0.2)
    sub = Subscriber(store, settings, IngestMetrics(), owner="me")
    stop = threading.Event()
    thread = threading.Thread(target=sub.run, args=(stop,), daemon=True)

    def publish() -> int | None:
        n = next(seq)
        pub.send_multipart([b"kv", n.to_bytes(8, "big"), _payload(n + 1)])
        return store.last_seq(IP, 0)

    try:
        sub.set_instances({IP: store.get_instance(IP)})  # type: ignore[dict-item]
        thread.start()
        wait_for(lambda: publish() is not None, what="the first batch applied")
        caplog.set_level(logging.WARNING)
        store.release_instance(IP, "me")
        assert store.claim_instance(IP, "other", 60_000)
        wait_for(
            lambda: publish() is None or "writes refused (not_owner)" in caplog.text,
            what="the refused write to end the session",
        )
        assert "subscriber loop error" not in caplog.text
        stopped_at = store.last_seq(IP, 0)
        store.release_instance(IP, "other")
        assert store.claim_instance(IP, "me", 60_000)
        wait_for(lambda: (publish() or 0) > (stopped_at or 0), what="writes again")
    finally:
        stop.set()
        thread.join(5)
        pub.close(linger=0)
