"""Direct tests of :class:`services.l1_ingest.stream.RankStream`: live batches, gaps, replays,
publisher restarts (seen on the live stream and at connect), duplicates and fencing.

Each test drives one rank stream from its own thread against a real redis-server and a real
ZMQ ROUTER (:class:`tests.services.vllm_replay.FakePublisher`, vLLM's replay protocol as the
spec states it) with real 0.28 batches from ``common.events.encode_batch``. The live stream is
the stream's :meth:`~RankStream.on_live` (what the subscriber calls for every live message);
the last test runs the whole :class:`~services.l1_ingest.subscriber.Subscriber` with a real
PUB socket. Replays are answered when the test serves the ROUTER, so no path depends on
timing; every wait is a poll with a deadline.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest
import redis
import zmq

from common.errors import FencedError
from common.config import GapPolicy
from common.settings import L1IngestSettings
from common.status_report import ConnState, Limits, StatusReader, build_report
from common.store import BatchStatus, Instance, Store
from services.l1_ingest.apply import GroupSettings
from services.l1_ingest.metrics import IngestMetrics
from services.l1_ingest.status import ConnRound, InstanceStatus, StatusBoard
from services.l1_ingest.stream import RankStream
from services.l1_ingest.subscriber import Subscriber
from tests.conftest import reserve_ports, wait_for
from tests.metrics_oracle import value_of
from tests.services.vllm_replay import FakePublisher
from tests.store_oracle import OracleStore

IP = "10.7.0.1"
LONG = 30.0
"""Replay timeout of the tests that are not about it: far longer than any test runs."""


@dataclass
class Rig:
    """One registered instance, its publisher(s) and the streams a test made."""

    store: Store
    ctx: zmq.Context[zmq.Socket[bytes]]
    base_port: int
    pubs: list[FakePublisher] = field(default_factory=list)
    metrics: IngestMetrics = field(default_factory=IngestMetrics)
    streams: list[RankStream] = field(default_factory=list)
    inst: Instance | None = None

    def register(self, *, replay: bool = True, dp: int = 1, uid: str = "pod-a") -> Instance:
        endpoint = f"tcp://127.0.0.1:{self.base_port}" if replay else ""
        _, gen = self.store.upsert_instance(Instance(IP, uid, replay_endpoint=endpoint, dp_size=dp))
        self.inst = self.store.get_instance(IP)
        assert self.inst is not None and self.inst.gen == gen
        return self.inst

    def publisher(
        self, rank: int = 0, *, buffer_steps: int = 10_000, framing: str = "0.26"
    ) -> FakePublisher:
        pub = FakePublisher(
            self.ctx, self.base_port + rank, rank=rank, buffer_steps=buffer_steps, framing=framing
        )
        self.pubs.append(pub)
        return pub

    def stream(
        self,
        rank: int = 0,
        *,
        gap_policy: GapPolicy = "keep",
        owner: str = "",
        replay_timeout: float = LONG,
        last_digest: tuple[int, bytes] | None = None,
        status: InstanceStatus | None = None,
        groups: GroupSettings | None = None,
    ) -> RankStream:
        assert self.inst is not None
        stream = RankStream(
            self.inst,
            rank,
            self.store,
            self.ctx,
            owner=owner,
            gap_policy=gap_policy,
            replay_timeout=replay_timeout,
            metrics=self.metrics,
            last_digest=last_digest,
            status=status,
            groups=groups,  # None: the stream's own default, the instance's DP size
        )
        self.streams.append(stream)
        return stream

    def members(self) -> set[int]:
        return self.store.tier_members(IP)

    def gap_fields(self) -> dict[str, str]:
        return {k: v for k, v in self.store.l1_state(IP).items() if k.startswith("gap:")}


@pytest.fixture()
def rig(redis_client: redis.Redis) -> Iterator[Rig]:
    yield from make_rig(redis_client)


def make_rig(redis_client: redis.Redis) -> Iterator[Rig]:
    """The ``rig`` fixture's body (other modules' fixtures yield from it)."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    r = Rig(OracleStore(redis_client), ctx, reserve_ports(2))
    yield r
    for s in r.streams:
        s.close()
    for p in r.pubs:
        p.close()
    ctx.term()


def drive(
    stream: RankStream, pub: FakePublisher | None, *, serve: bool = True, timeout: float = 15.0
) -> None:
    """Run the stream's replays (and the ones they lead to) to their end, as the subscriber
    does: serve the ROUTER, read the DEALER, finish at the end marker or the deadline."""
    deadline = time.monotonic() + timeout
    while (replay := stream.replay) is not None:
        assert time.monotonic() < deadline, "the replay never ended"
        poller = zmq.Poller()
        poller.register(replay.socket, zmq.POLLIN)
        if pub is not None:
            poller.register(pub.router, zmq.POLLIN)
        poller.poll(50)
        if pub is not None and serve:
            pub.serve()
        if replay.read() or replay.expired():
            stream.finish_replay()


def live(stream: RankStream, pub: FakePublisher, n: int = 1) -> list[int]:
    """``n`` new batches of the publisher, each delivered on the live stream."""
    seqs = []
    for _ in range(n):
        seq, data = pub.publish()
        stream.on_live(seq, data)
        seqs.append(seq)
    return seqs


# -- live ------------------------------------------------------------------------------------


def test_live_batches_that_follow_are_written_one_by_one(rig: Rig) -> None:
    rig.register()
    pub = rig.publisher()
    stream = rig.stream()
    live(stream, pub, 3)
    assert stream.replay is None and pub.requests == []  # nothing missing: no replay
    assert rig.store.last_seq(IP, 0) == 2
    assert rig.members() == {pub.hash_of(s) for s in range(3)}
    assert value_of(rig.metrics.batches, result=BatchStatus.APPLIED) == 3
    assert value_of(rig.metrics.gaps, outcome="recovered") == 0


def test_joining_mid_stream_applies_the_first_batch_seen_without_a_gap(rig: Rig) -> None:
    rig.register()
    pub = rig.publisher()
    stream = rig.stream()
    for _ in range(5):
        pub.publish()  # published before we subscribed
    live(stream, pub, 1)
    assert rig.store.last_seq(IP, 0) == 5 and pub.requests == []
    assert rig.gap_fields() == {}


# -- connect ---------------------------------------------------------------------------------


def test_a_first_connect_replays_from_zero_and_drops_the_live_copies(rig: Rig) -> None:
    rig.register()
    pub = rig.publisher()
    stream = rig.stream()
    queued = [pub.publish() for _ in range(5)]  # 0..4, also queued on the live socket
    stream.on_connected()
    assert stream.paused
    drive(stream, pub)
    assert pub.requests == [0]
    assert rig.store.last_seq(IP, 0) == 4
    assert rig.members() == {pub.hash_of(s) for s in range(5)}
    for seq, data in queued[2:]:  # the live copies of replayed batches: duplicates
        stream.on_live(seq, data)
    assert value_of(rig.metrics.batches, result=BatchStatus.DUPLICATE) == 3
    live(stream, pub, 1)
    assert rig.store.last_seq(IP, 0) == 5 and pub.requests == [0]
    assert value_of(rig.metrics.restarts) == 0 and rig.gap_fields() == {}


def test_a_first_connect_to_a_publisher_with_nothing_yet_starts_at_zero(rig: Rig) -> None:
    """An empty first replay: the stream starts at 0, so a lost first live batch (slow
    joiner) shows up as a gap on the next one and is replayed."""
    rig.register()
    pub = rig.publisher()
    stream = rig.stream()
    stream.on_connected()
    drive(stream, pub)
    assert pub.requests == [0] and rig.store.last_seq(IP, 0) is None
    pub.publish()  # seq 0, lost on the live stream
    live(stream, pub, 1)  # seq 1: a gap before it
    drive(stream, pub)
    assert pub.requests == [0, 0]
    assert rig.members() == {pub.hash_of(0), pub.hash_of(1)}
    assert value_of(rig.metrics.gaps, outcome="recovered") == 1 and rig.gap_fields() == {}


def test_joining_a_trimmed_buffer_is_an_unrecoverable_gap(rig: Rig) -> None:
    rig.register()
    pub = rig.publisher(buffer_steps=3)
    stream = rig.stream()
    for _ in range(6):
        pub.publish()  # the buffer holds 3..5 only
    stream.on_connected()
    drive(stream, pub)
    assert rig.members() == {pub.hash_of(s) for s in (3, 4, 5)}
    assert rig.gap_fields() == {"gap:0": "1"}
    assert value_of(rig.metrics.gaps, outcome="unrecoverable") == 1


# -- gaps ------------------------------------------------------------------------------------


@pytest.mark.parametrize("framing", ["0.26", "pre-0.26"])
def test_a_gap_is_replayed_from_the_applied_seq_and_recovered(rig: Rig, framing: str) -> None:
    rig.register()
    pub = rig.publisher(framing=framing)
    stream = rig.stream()
    live(stream, pub, 2)  # 0, 1
    pub.publish()
    pub.publish()  # 2, 3: lost on the live stream
    live(stream, pub, 1)  # 4 reveals the gap and waits for the replay
    assert stream.paused and rig.store.last_seq(IP, 0) == 1
    drive(stream, pub)
    assert pub.requests == [1]  # from the applied seq itself: the continuity check
    assert rig.store.last_seq(IP, 0) == 4
    assert rig.members() == {pub.hash_of(s) for s in range(5)}
    assert value_of(rig.metrics.gaps, outcome="recovered") == 1
    assert value_of(rig.metrics.gaps, outcome="unrecoverable") == 0
    assert value_of(rig.metrics.restarts) == 0 and rig.gap_fields() == {}


@pytest.mark.parametrize(
    ("policy", "replay"), [("keep", True), ("clear", True), ("keep", False), ("clear", False)]
)
def test_a_gap_replay_cannot_fill_follows_the_policy(
    rig: Rig, policy: GapPolicy, replay: bool
) -> None:
    """Replay trimmed past what is missing (or no replay endpoint): ``keep`` writes on and
    counts the gap in the state hash, ``clear`` resets the rank first."""
    rig.register(replay=replay)
    pub = rig.publisher(buffer_steps=2)
    stream = rig.stream(gap_policy=policy)
    live(stream, pub, 2)  # 0, 1
    for _ in range(3):
        pub.publish()  # 2, 3, 4 lost
    live(stream, pub, 1)  # 5; the buffer keeps 4, 5
    drive(stream, pub)
    assert pub.requests == ([1] if replay else [])
    after = {4, 5} if replay else {5}
    if policy == "keep":
        assert rig.members() == {pub.hash_of(s) for s in (0, 1, *after)}
        assert rig.gap_fields() == {"gap:0": "1"}
    else:
        assert rig.members() == {pub.hash_of(s) for s in after}
        assert rig.gap_fields() == {}
    assert rig.store.last_seq(IP, 0) == 5
    assert value_of(rig.metrics.gaps, outcome="unrecoverable") == 1
    assert value_of(rig.metrics.gaps, outcome="recovered") == 0


def test_a_replay_that_times_out_writes_the_held_batch_as_a_gap(rig: Rig) -> None:
    rig.register()
    pub = rig.publisher()
    stream = rig.stream(replay_timeout=0.2)
    live(stream, pub, 1)
    pub.publish()  # 1 lost
    live(stream, pub, 1)  # 2
    drive(stream, pub, serve=False)  # the publisher never answers: the deadline ends it
    assert value_of(rig.metrics.replays, result="timeout") == 1
    assert rig.store.last_seq(IP, 0) == 2 and rig.gap_fields() == {"gap:0": "1"}


def test_a_malformed_replay_reply_is_dropped_counted_and_the_replay_goes_on(rig: Rig) -> None:
    rig.register()
    pub = rig.publisher()
    stream = rig.stream()
    live(stream, pub, 1)  # 0
    pub.publish()  # 1 lost
    live(stream, pub, 1)  # 2: a gap, replayed
    pub.garbled = [[b"kv", b"\x00" * 4, b"x"], [b"a", b"b", b"c", b"d"]]  # 4-byte seq; 5 frames
    drive(stream, pub)
    assert value_of(rig.metrics.malformed_frames, reason="replay_framing") == 2
    assert value_of(rig.metrics.replays, result="complete") == 1
    assert rig.members() == {pub.hash_of(s) for s in range(3)}
    assert value_of(rig.metrics.gaps, outcome="recovered") == 1 and rig.gap_fields() == {}


# -- restarts --------------------------------------------------------------------------------


def test_a_restart_seen_first_on_the_live_stream_replays_the_new_lifetime_from_zero(
    rig: Rig,
) -> None:
    """Issue 21, behaviour 7: a live seq that goes back to k > 0 (replay available) resets
    the rank and replays the new lifetime from 0: batches 0..k-1 are applied, no gap."""
    rig.register()
    pub = rig.publisher()
    stream = rig.stream()
    live(stream, pub, 6)  # 0..5 of the first lifetime
    pub.restart()
    for _ in range(3):
        pub.publish()  # 0, 1, 2 of the new lifetime, lost on the live stream
    (k,) = live(stream, pub, 1)  # 3: the sequence went back
    assert k == 3 and stream.paused
    drive(stream, pub)
    assert pub.requests == [0]
    assert rig.members() == {pub.hash_of(s) for s in range(4)}  # the old lifetime is gone
    assert rig.store.last_seq(IP, 0) == 3
    assert value_of(rig.metrics.restarts) == 1
    assert value_of(rig.metrics.gaps, outcome="unrecoverable") == 0 and rig.gap_fields() == {}
    live(stream, pub, 1)
    assert rig.store.last_seq(IP, 0) == 4 and pub.requests == [0]


def test_a_restart_to_seq_zero_on_the_live_stream_resets_without_a_replay(rig: Rig) -> None:
    rig.register()
    pub = rig.publisher()
    stream = rig.stream()
    live(stream, pub, 4)
    pub.restart()
    live(stream, pub, 2)  # 0, 1 of the new lifetime
    assert pub.requests == [] and stream.replay is None
    assert rig.members() == {pub.hash_of(0), pub.hash_of(1)}
    assert value_of(rig.metrics.restarts) == 1 and rig.gap_fields() == {}


def _first_session(rig: Rig, pub: FakePublisher, n: int = 6) -> tuple[int, bytes]:
    """A session that applied 0..n-1 live and then ended; returns the digest it leaves."""
    stream = rig.stream()
    live(stream, pub, n)
    assert stream.digest is not None and stream.digest[0] == n - 1
    digest = stream.digest
    stream.close()
    return digest


def test_a_restart_while_away_shows_as_other_bytes_at_the_applied_seq(rig: Rig) -> None:
    rig.register()
    pub = rig.publisher()
    digest = _first_session(rig, pub)  # 0..5
    pub.restart()
    for _ in range(8):
        pub.publish()  # the new lifetime is already past our seq 5
    stream = rig.stream(last_digest=digest)
    stream.on_connected()
    drive(stream, pub)
    assert pub.requests == [5, 0]  # seq 5 came back with other bytes: replay from 0
    assert value_of(rig.metrics.restarts) == 1
    assert rig.members() == {pub.hash_of(s) for s in range(8)}
    assert rig.store.last_seq(IP, 0) == 7 and rig.gap_fields() == {}


@pytest.mark.parametrize("with_digest", [True, False])
def test_a_restart_while_away_shows_as_an_empty_catch_up(rig: Rig, with_digest: bool) -> None:
    """The new lifetime has not reached our seq yet: the reply from it is empty (true even
    for an ingester that restarted too and knows no digest)."""
    rig.register()
    pub = rig.publisher()
    digest = _first_session(rig, pub)
    pub.restart()
    for _ in range(3):
        pub.publish()
    stream = rig.stream(last_digest=digest if with_digest else None)
    stream.on_connected()
    drive(stream, pub)
    assert pub.requests == [5, 0]
    assert value_of(rig.metrics.restarts) == 1
    assert rig.members() == {pub.hash_of(s) for s in range(3)}
    assert rig.store.last_seq(IP, 0) == 2 and rig.gap_fields() == {}


@pytest.mark.parametrize("session", ["same", "next-with-digest", "next-without-digest"])
def test_a_reconnect_to_a_publisher_with_nothing_new_is_not_a_restart(
    rig: Rig, session: str
) -> None:
    """Issue 21, behaviour 8: the catch-up replay asks from the applied seq itself, so the
    publisher that has nothing new answers with that one batch, not an empty reply."""
    rig.register()
    pub = rig.publisher()
    if session == "same":
        stream = rig.stream()
        live(stream, pub, 6)
    else:
        digest = _first_session(rig, pub)
        stream = rig.stream(last_digest=digest if session == "next-with-digest" else None)
    before = rig.members()
    stream.on_connected()  # the SUB socket reconnected
    drive(stream, pub)
    assert pub.requests == [5]
    assert value_of(rig.metrics.restarts) == 0
    assert rig.members() == before == {pub.hash_of(s) for s in range(6)}
    assert rig.store.last_seq(IP, 0) == 5 and rig.gap_fields() == {}
    live(stream, pub, 1)
    assert rig.store.last_seq(IP, 0) == 6


def test_a_live_seq_below_the_applied_one_in_a_new_session_is_a_restart(rig: Rig) -> None:
    """A new session has applied nothing itself: a live seq at or below the store's last one
    cannot be a replay overlap, so the publisher restarted."""
    rig.register()
    pub = rig.publisher()
    _first_session(rig, pub)  # 0..5
    pub.restart()
    pub.publish()
    pub.publish()  # 0, 1 of the new lifetime, lost
    stream = rig.stream()
    live(stream, pub, 1)  # 2 <= 5
    drive(stream, pub)
    assert value_of(rig.metrics.restarts) == 1 and pub.requests == [0]
    assert rig.members() == {pub.hash_of(s) for s in range(3)}


# -- fencing ---------------------------------------------------------------------------------


def test_replayed_batches_for_a_replaced_pod_are_refused(rig: Rig) -> None:
    rig.register()
    pub = rig.publisher()
    stream = rig.stream()
    for _ in range(3):
        pub.publish()
    stream.on_connected()
    rig.register(uid="pod-b")  # a new pod took the IP while the replay was in flight
    with pytest.raises(FencedError) as caught:
        drive(stream, pub)
    assert caught.value.status is BatchStatus.STALE_GEN
    assert rig.members() == set() and rig.store.last_seq(IP, 0) is None


def test_a_restart_reset_without_the_lease_is_refused(rig: Rig) -> None:
    inst = rig.register()
    assert rig.store.claim_instance(IP, "me", 60_000)
    pub = rig.publisher()
    stream = rig.stream(owner="me")
    live(stream, pub, 4)
    assert rig.store.release_instance(IP, "me")
    assert rig.store.claim_instance(IP, "other", 60_000)
    pub.restart()
    pub.publish()
    stream.on_connected()
    with pytest.raises(FencedError) as caught:
        drive(stream, pub)  # an empty catch-up: a restart, whose reset is refused
    assert caught.value.status is BatchStatus.NOT_OWNER
    assert rig.members() == {pub.hash_of(s, lifetime=1) for s in range(4)}
    assert rig.store.get_instance(IP) == inst


# -- status: a gap on any DP rank ------------------------------------------------------------


@pytest.mark.parametrize("rank", [1, 0])
def test_an_unrecoverable_gap_on_any_rank_makes_the_instance_gap(rig: Rig, rank: int) -> None:
    """Issue 21, behaviour 6: a gap kept on DP rank >= 1 makes ``l1.state`` ``gap``, as one
    on rank 0 does (the other rank is healthy)."""
    inst = rig.register(dp=2)
    board = StatusBoard(
        rig.store, L1IngestSettings(hash_check_rate=0), rig.metrics, owner="", ingester="ing-1"
    )
    pubs = [rig.publisher(r, buffer_steps=2) for r in range(2)]
    streams = [rig.stream(r, status=board.of(inst)) for r in range(2)]
    assert streams[1].replay_endpoint == pubs[1].replay_endpoint  # port + rank
    for s, p in zip(streams, pubs, strict=True):
        live(s, p, 2)

    def state() -> dict[str, object]:
        board.write([ConnRound(inst, ConnState.CONNECTED, "tcp://127.0.0.1:1", False)])
        doc = build_report(StatusReader(rig.store.r).read(), Limits())
        return dict(doc["instances"][0]["l1"])

    assert state()["state"] == "synced"
    for _ in range(3):
        pubs[rank].publish()  # lost, and trimmed out of the replay buffer
    live(streams[rank], pubs[rank], 1)
    drive(streams[rank], pubs[rank])
    assert rig.gap_fields() == {f"gap:{rank}": "1"}
    after = state()
    assert (after["state"], after["gaps"]) == ("gap", 1)
    assert "1 unrecoverable gap" in str(after["state_detail"])


# -- the whole subscriber, with a real PUB socket --------------------------------------------


def test_the_subscriber_follows_a_publisher_through_a_restart_on_the_live_stream(
    redis_client: redis.Redis,
) -> None:
    """PUB + ROUTER, the subscriber's own poll loop (run from this thread): catch-up at
    connect, live batches, then a restart seen on the live stream at k > 0."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    store, port = OracleStore(redis_client), reserve_ports(2)
    pub = FakePublisher(ctx, port + 1, pub_port=port)
    store.upsert_instance(
        Instance(
            IP, "pod-a", zmq_endpoint=f"tcp://127.0.0.1:{port}", replay_endpoint=pub.replay_endpoint
        )
    )
    metrics = IngestMetrics()
    sub = Subscriber(
        store,
        L1IngestSettings(
            topic="kv",
            backoff_initial=0.05,
            backoff_max=0.2,
            replay_timeout=LONG,
            hash_check_rate=0,
        ),
        metrics,
        ctx=ctx,
    )

    def until(cond: Callable[[], bool], what: str) -> None:
        def step() -> bool:
            sub.run_once(timeout_ms=20)
            pub.serve()
            return cond()

        wait_for(step, timeout=20, interval=0, what=what)

    try:
        for _ in range(3):
            pub.publish()  # before anyone subscribed: only replay has them
        sub.set_instances({IP: store.get_instance(IP)})  # type: ignore[dict-item]
        until(lambda: store.last_seq(IP, 0) == 2, "the catch-up replay from 0")
        assert pub.requests[0] == 0

        def published_live(seq: int) -> bool:
            if pub.next_seq <= seq:
                pub.publish()
            return store.last_seq(IP, 0) == seq

        until(lambda: published_live(6), "live batches up to 6")
        pub.restart()
        for _ in range(2):
            pub.publish(send=False)  # 0, 1 of the new lifetime never reach the SUB socket
        until(lambda: published_live(4), "the new lifetime replayed from 0, then live")
        assert store.tier_members(IP) == {pub.hash_of(s) for s in range(5)}
        assert value_of(metrics.restarts) == 1
        assert value_of(metrics.gaps, outcome="unrecoverable") == 0
        assert 0 in pub.requests[1:]
    finally:
        sub.close()
        pub.close()
        ctx.term()
