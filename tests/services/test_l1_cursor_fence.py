"""The L1 cursor fence (issue 19 item 2, L1 half): writes a Redis failover lost are noticed
and the rank re-syncs, busy or quiet.

A lost write is simulated the way a failover leaves it: the l1 state hash (``seq:<rank>``,
``dig:<rank>``) and the rank's set are put back to what they were after an earlier batch, or
the state hash is emptied, directly in a real redis-server. Rank streams are driven as in
``test_l1_rank_stream`` (real ZMQ ROUTER, real 0.28 batches); the quiet-instance test runs
the whole :class:`~services.l1_ingest.subscriber.Subscriber` with a real PUB socket.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

import redis
import zmq

from common import keys
from common.events import BlockRemoved, encode_batch
from common.settings import L1IngestSettings
from common.status_report import InstanceState, Limits, StatusReader, build_report
from common.store import BatchStatus, Instance, Store, StoredCursor
from services.l1_ingest.metrics import IngestMetrics
from services.l1_ingest.subscriber import Subscriber
from tests.conftest import reserve_ports, wait_for
from tests.metrics_oracle import value_of
from tests.services.test_l1_rank_stream import IP, LONG, Rig, drive, live, make_rig
from tests.services.vllm_replay import FakePublisher
from tests.store_oracle import OracleStore


@pytest.fixture(name="rig")
def rig_fixture(redis_client: redis.Redis) -> Iterator[Rig]:
    yield from make_rig(redis_client)


def removal(pub: FakePublisher, seq: int) -> bytes:
    """A real 0.28 batch removing the block batch ``seq`` stored (vLLM evicted it)."""
    return encode_batch(
        [BlockRemoved([pub.hash_of(seq)], medium="GPU")],
        ts=5000.0,
        data_parallel_rank=0,
        vllm_version=(0, 28, 0),
    )


def roll_back(store: Store, to: StoredCursor, members: set[int]) -> None:
    """What a failover that lost every write after ``to`` leaves in Redis."""
    state = keys.l1_state(IP)
    store.r.hset(state, mapping={"seq:0": str(to.seq), "dig:0": to.digest})
    store.r.delete(keys.tier_set(IP, "l1"))
    if members:
        store.r.sadd(keys.tier_set(IP, "l1"), *members)


def test_a_lost_write_refuses_the_next_batch_and_the_rank_is_replayed_from_the_stored_seq(
    rig: Rig,
) -> None:
    rig.register()
    pub = rig.publisher()
    stream = rig.stream()
    live(stream, pub, 4)  # 0..3
    after_3, members_3 = rig.store.cursor(IP, 0), rig.members()
    stream.on_live(pub.publish_payload(removal(pub, 1)), pub.buffer[-1][1])  # 4 removes 1
    live(stream, pub, 1)  # 5
    roll_back(rig.store, after_3, members_3)  # 4 and 5 lost: 1 is back (an over-report)
    live(stream, pub, 1)  # 6: refused (the cursor moved), the rank re-syncs from 3
    assert value_of(rig.metrics.batches, result=BatchStatus.CURSOR_MOVED) == 1
    assert stream.paused and stream.resyncing
    drive(stream, pub)
    assert pub.requests == [3]
    assert rig.members() == {pub.hash_of(s) for s in (0, 2, 3, 5, 6)}
    assert rig.store.cursor(IP, 0).seq == 6 and not stream.resyncing
    assert value_of(rig.metrics.resyncs) == 1 and value_of(rig.metrics.restarts) == 0
    assert rig.gap_fields() == {}


def test_a_lost_write_without_replay_resets_the_rank_whatever_the_gap_policy(rig: Rig) -> None:
    """Nothing can give the lost batches back: the rank is rebuilt from what comes next
    (an under-report until vLLM stores again), never kept with a lost removal in it."""
    rig.register(replay=False)
    pub = rig.publisher()
    stream = rig.stream(gap_policy="keep")
    live(stream, pub, 4)
    after_3, members_3 = rig.store.cursor(IP, 0), rig.members()
    stream.on_live(pub.publish_payload(removal(pub, 1)), pub.buffer[-1][1])
    roll_back(rig.store, after_3, members_3)
    live(stream, pub, 1)  # 5
    assert rig.members() == {pub.hash_of(5)}
    assert rig.store.cursor(IP, 0).seq == 5 and rig.gap_fields() == {}
    assert value_of(rig.metrics.resyncs) == 1 and not stream.resyncing


def test_an_emptied_state_hash_resets_the_rank_and_replays_it_from_zero(rig: Rig) -> None:
    rig.register()
    pub = rig.publisher()
    stream = rig.stream()
    live(stream, pub, 4)
    rig.store.r.delete(keys.l1_state(IP))  # the cursor is gone, the sets are not
    live(stream, pub, 1)  # 4
    drive(stream, pub)
    assert pub.requests == [0]
    assert rig.members() == {pub.hash_of(s) for s in range(5)}
    assert rig.store.cursor(IP, 0).seq == 4 and value_of(rig.metrics.resyncs) == 1


def test_a_lost_write_the_replay_buffer_no_longer_covers_resets_the_rank(rig: Rig) -> None:
    rig.register()
    pub = rig.publisher(buffer_steps=3)
    stream = rig.stream(gap_policy="keep")
    live(stream, pub, 3)  # 0..2
    after_2, members_2 = rig.store.cursor(IP, 0), rig.members()
    stream.on_live(pub.publish_payload(removal(pub, 1)), pub.buffer[-1][1])  # 3
    live(stream, pub, 2)  # 4, 5; the buffer keeps 3..5, then 4..6
    roll_back(rig.store, after_2, members_2)
    live(stream, pub, 1)  # 6: refused; replay from 2 starts at 4
    drive(stream, pub)
    assert pub.requests == [2]
    assert rig.members() == {pub.hash_of(s) for s in (4, 5, 6)}  # 1 is not kept
    assert rig.gap_fields() == {} and rig.store.cursor(IP, 0).seq == 6


def test_a_quiet_instance_notices_a_lost_write_and_re_syncs(redis_client: redis.Redis) -> None:
    """No batch after the failover: the subscriber's periodic cursor check sees the stored
    cursor go back, the rank re-syncs through replay, and the state says ``resyncing``
    while it does (the replay is held back to observe it)."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    store, port = OracleStore(redis_client), reserve_ports(2)
    pub = FakePublisher(ctx, port + 1, pub_port=port)
    store.upsert_instance(
        Instance(
            IP, "pod-a", zmq_endpoint=f"tcp://127.0.0.1:{port}", replay_endpoint=pub.replay_endpoint
        )
    )
    metrics = IngestMetrics()
    cfg = L1IngestSettings(
        topic="kv", backoff_initial=0.05, backoff_max=0.2, replay_timeout=LONG, hash_check_rate=0
    )
    sub = Subscriber(store, cfg, metrics, ctx=ctx)

    def until(cond: Callable[[], bool], what: str, serve: bool = True) -> None:
        def step() -> bool:
            sub.run_once(timeout_ms=20)
            if serve:
                pub.serve()
            return cond()

        wait_for(step, timeout=20, interval=0, what=what)

    def state() -> dict[str, object]:
        doc = build_report(StatusReader(store.r).read(), Limits())
        return dict(doc["instances"][0]["l1"])

    try:
        sub.set_instances({IP: store.get_instance(IP)})  # type: ignore[dict-item]
        until(lambda: value_of(metrics.connected) == 1, "the SUB socket connected")

        def published_live(seq: int) -> bool:
            if pub.next_seq <= seq:
                pub.publish()
            return store.last_seq(IP, 0) == seq

        until(lambda: published_live(3), "live batches up to 3")
        after_3, members_3 = store.cursor(IP, 0), store.tier_members(IP)
        pub.publish_payload(removal(pub, 1))
        until(lambda: store.last_seq(IP, 0) == 4, "the removal applied")
        roll_back(store, after_3, members_3)
        until(lambda: state()["state"] == InstanceState.RESYNCING, "resyncing", serve=False)
        assert "the stored cursor moved" in str(state()["resync_detail"])
        until(lambda: store.last_seq(IP, 0) == 4, "re-synced from the stored seq 3")
        assert store.tier_members(IP) == {pub.hash_of(s) for s in (0, 2, 3)}
        until(lambda: state()["state"] == InstanceState.SYNCED, "synced again")
        assert state()["resyncs"] == 1 and value_of(metrics.restarts) == 0
    finally:
        sub.close()
        pub.close()
        ctx.term()
