"""An L1 stream that has applied only sequence 0 and then (re)connects (issue 33): with a
replay endpoint the lifetime is verified at seq 0 like at any other seq; without one, a gap
right after the (re)connect is a possible restart and resets the rank. Sequence 0 is the
corner where a falsy ``0`` is easily taken for "nothing applied" and the old lifetime's
block trusted.

Each case runs in the same session (the SUB socket reconnected), in a next session that
reads the stored cursor and digest (an ingester restart), and — where it matters — in a next
session that also got the previous session's digest. Real redis-server, real ZMQ ROUTER
(``tests.services.vllm_replay.FakePublisher``), real batches; see test_l1_rank_stream.py.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from common import keys
from services.l1_ingest.stream import RankStream
from tests.metrics_oracle import value_of
from tests.services.test_l1_rank_stream import IP, Rig, drive, live, make_rig
from tests.services.vllm_replay import FakePublisher

SESSIONS = ["same", "next", "next-with-digest", "next-legacy"]
"""``next-legacy``: the store holds seq 0 without its digest (written before digests were
stored); the previous session's digest is what verifies the lifetime."""


@pytest.fixture()
def rig(redis_client: redis.Redis) -> Iterator[Rig]:
    yield from make_rig(redis_client)


def _seq0_then_reconnect(rig: Rig, pub: FakePublisher, session: str) -> RankStream:
    """Apply only seq 0 live; return the stream that sees the (re)connect."""
    stream = rig.stream()
    live(stream, pub, 1)
    assert rig.store.last_seq(IP, 0) == 0 and rig.members() == {pub.hash_of(0)}
    assert stream.digest is not None and stream.digest[0] == 0
    if session == "same":
        return stream
    digest = stream.digest
    stream.close()
    if session == "next-legacy":
        rig.store.r.hdel(keys.l1_state(IP), "dig:0")
    return rig.stream(last_digest=digest if session.startswith("next-") else None)


# -- with a replay endpoint: the lifetime is verified at seq 0 --------------------------------


@pytest.mark.parametrize("session", SESSIONS)
def test_other_bytes_at_seq_0_are_a_restart(rig: Rig, session: str) -> None:
    rig.register()
    pub = rig.publisher()
    stream = _seq0_then_reconnect(rig, pub, session)
    pub.restart()
    for _ in range(3):
        pub.publish()  # the new lifetime's 0..2; its seq 0 has other bytes
    stream.on_connected()
    drive(stream, pub)
    assert pub.requests == [0, 0]  # the check at 0, then the new lifetime from 0
    assert value_of(rig.metrics.restarts) == 1
    assert rig.members() == {pub.hash_of(s) for s in range(3)}  # the old seq 0 is gone
    assert rig.store.last_seq(IP, 0) == 2 and rig.gap_fields() == {}


@pytest.mark.parametrize("session", SESSIONS)
def test_an_empty_reply_at_seq_0_is_a_restart(rig: Rig, session: str) -> None:
    """The new lifetime has published nothing yet: the reply lacks seq 0."""
    rig.register()
    pub = rig.publisher()
    stream = _seq0_then_reconnect(rig, pub, session)
    pub.restart()
    stream.on_connected()
    drive(stream, pub)
    assert value_of(rig.metrics.restarts) == 1
    assert rig.members() == set()
    live(stream, pub, 2)  # the new lifetime's 0, 1 follow the reset
    assert rig.members() == {pub.hash_of(0), pub.hash_of(1)}
    assert rig.store.last_seq(IP, 0) == 1 and rig.gap_fields() == {}


@pytest.mark.parametrize("session", SESSIONS)
@pytest.mark.parametrize("new", [0, 3])
def test_the_same_seq_0_is_not_a_restart(rig: Rig, session: str, new: int) -> None:
    rig.register()
    pub = rig.publisher()
    stream = _seq0_then_reconnect(rig, pub, session)
    for _ in range(new):
        pub.publish()  # 1..new, missed while away
    stream.on_connected()
    drive(stream, pub)
    assert pub.requests == [0]
    assert value_of(rig.metrics.restarts) == 0
    assert rig.members() == {pub.hash_of(s) for s in range(new + 1)}
    live(stream, pub, 1)
    assert rig.store.last_seq(IP, 0) == new + 1 and rig.gap_fields() == {}


def test_the_live_copy_of_a_replayed_seq_0_is_a_duplicate(rig: Rig) -> None:
    """A first connect replays only seq 0; its copy on the live stream is not a restart."""
    rig.register()
    pub = rig.publisher()
    stream = rig.stream()
    seq, data = pub.publish()  # 0, also queued on the live socket
    stream.on_connected()
    drive(stream, pub)
    assert pub.requests == [0] and rig.members() == {pub.hash_of(0)}
    stream.on_live(seq, data)
    assert value_of(rig.metrics.restarts) == 0 and rig.members() == {pub.hash_of(0)}
    live(stream, pub, 1)
    assert rig.members() == {pub.hash_of(0), pub.hash_of(1)} and pub.requests == [0]


# -- without a replay endpoint: a gap right after the (re)connect resets ----------------------


@pytest.mark.parametrize("session", ["same", "next"])
def test_without_replay_a_gap_after_seq_0_is_a_possible_restart(rig: Rig, session: str) -> None:
    rig.register(replay=False)
    pub = rig.publisher()
    stream = _seq0_then_reconnect(rig, pub, session)
    pub.restart()
    pub.publish()
    pub.publish()  # the new lifetime's 0, 1: lost (slow joiner)
    stream.on_connected()
    live(stream, pub, 1)  # seq 2 after our 0: a gap right after the reconnect
    assert stream.replay is None and pub.requests == []
    assert value_of(rig.metrics.restarts) == 1
    assert rig.members() == {pub.hash_of(2)}  # the old lifetime's seq 0 is not trusted
    assert rig.store.last_seq(IP, 0) == 2


@pytest.mark.parametrize("session", ["same", "next"])
def test_without_replay_seq_0_again_after_seq_0_is_a_restart(rig: Rig, session: str) -> None:
    rig.register(replay=False)
    pub = rig.publisher()
    stream = _seq0_then_reconnect(rig, pub, session)
    pub.restart()
    stream.on_connected()
    live(stream, pub, 1)  # the new lifetime's seq 0: not a duplicate of ours
    assert value_of(rig.metrics.restarts) == 1
    assert rig.members() == {pub.hash_of(0)} and pub.hash_of(0) != pub.hash_of(0, lifetime=1)
    assert rig.store.last_seq(IP, 0) == 0


@pytest.mark.parametrize("session", ["same", "next"])
def test_without_replay_seq_1_after_seq_0_follows(rig: Rig, session: str) -> None:
    rig.register(replay=False)
    pub = rig.publisher()
    stream = _seq0_then_reconnect(rig, pub, session)
    stream.on_connected()
    live(stream, pub, 2)  # 1, 2
    assert value_of(rig.metrics.restarts) == 0
    assert rig.members() == {pub.hash_of(s) for s in range(3)}
    assert rig.store.last_seq(IP, 0) == 2 and rig.gap_fields() == {}


@pytest.mark.parametrize("session", ["same", "next"])
def test_without_replay_a_gap_later_in_the_session_follows_the_policy(
    rig: Rig, session: str
) -> None:
    """Once a batch was seen after the (re)connect, a gap is a gap (kept and flagged), not a
    possible restart."""
    rig.register(replay=False)
    pub = rig.publisher()
    stream = _seq0_then_reconnect(rig, pub, session)
    stream.on_connected()
    live(stream, pub, 1)  # 1
    pub.publish()  # 2, lost
    live(stream, pub, 1)  # 3
    assert value_of(rig.metrics.restarts) == 0
    assert rig.members() == {pub.hash_of(s) for s in (0, 1, 3)}
    assert rig.gap_fields() == {"gap:0": "1"}
