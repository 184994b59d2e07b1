"""Corners of an L1 rank stream's lifetime logic that mutation testing (issue 33) found
unpinned: a re-sync that finds the publisher restarted, a failover that undoes a reset, the
gap left before a possible restart's batch, and what a refused reset says.

Driven as in ``test_l1_rank_stream`` (real redis-server, real ZMQ ROUTER answering vLLM's
replay protocol, real 0.28 batches); lost writes are simulated as in
``test_l1_cursor_fence`` (the state hash and set put back in Redis).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import pytest
import redis
import zmq

from common import keys
from common.config import GapPolicy
from common.errors import FencedError
from common.store import BatchStatus, Instance
from services.l1_ingest.status import InstanceStatus
from services.l1_ingest.stream import RankStream
from tests.metrics_oracle import value_of
from tests.services.test_l1_cursor_fence import roll_back
from tests.services.test_l1_rank_stream import IP, Rig, drive, live, make_rig
from tests.services.vllm_replay import FakePublisher, payload


@pytest.fixture(name="rig")
def rig_fixture(redis_client: redis.Redis) -> Iterator[Rig]:
    yield from make_rig(redis_client)


def drive_one(stream: RankStream, pub: FakePublisher, timeout: float = 15.0) -> None:
    """Serve and finish the replay in flight only (not the ones it leads to)."""
    replay = stream.replay
    assert replay is not None, "no replay in flight"
    deadline = time.monotonic() + timeout
    while stream.replay is replay:
        assert time.monotonic() < deadline, "the replay never ended"
        poller = zmq.Poller()
        poller.register(replay.socket, zmq.POLLIN)
        poller.register(pub.router, zmq.POLLIN)
        poller.poll(50)
        pub.serve()
        if replay.read() or replay.expired():
            stream.finish_replay()


# -- a re-sync that finds a new lifetime ------------------------------------------------------


def test_a_quiet_resync_whose_replay_no_longer_has_the_stored_seq_is_a_restart(rig: Rig) -> None:
    """The periodic cursor check re-syncs a quiet rank from the stored seq; the publisher
    restarted and has not reached it: the old lifetime's blocks are dropped, the new one's
    replayed from 0 — not kept as if nothing happened."""
    rig.register()
    pub = rig.publisher()
    stream = rig.stream()
    live(stream, pub, 6)  # 0..5
    pub.restart()
    pub.publish()
    pub.publish()  # 0, 1 of the new lifetime, not seen live
    stream.resync("the stored cursor moved", [])
    drive(stream, pub)
    assert pub.requests == [5, 0]
    assert value_of(rig.metrics.restarts) == 1
    assert rig.members() == {pub.hash_of(0), pub.hash_of(1)}
    assert rig.store.last_seq(IP, 0) == 1 and not stream.resyncing


def test_a_resync_from_nothing_to_a_publisher_with_nothing_ends(rig: Rig) -> None:
    """The state hash was emptied and the publisher has published nothing yet: the rank is
    reset, the replay from 0 is empty, and the re-sync is over (the status stops saying
    ``resyncing``); the next batch is written."""
    rig.register()
    pub = rig.publisher()
    stream = rig.stream()
    live(stream, pub, 3)
    pub.restart()
    rig.store.r.delete(keys.l1_state(IP))
    stream.resync("the stored cursor moved", [])
    assert stream.resyncing
    drive(stream, pub)
    assert pub.requests == [0] and rig.members() == set()
    assert not stream.resyncing
    live(stream, pub, 1)
    assert rig.members() == {pub.hash_of(0)} and rig.gap_fields() == {}


def test_a_resync_that_finds_a_restart_and_a_trimmed_buffer_resets_without_a_gap_flag(
    rig: Rig,
) -> None:
    """While re-syncing, what replay cannot give back resets the rank whatever the policy
    (the module docstring, "Cursor fence"), also once the replay from the stored seq showed
    a new lifetime: the rank holds what the buffer still has, no gap is flagged or counted."""
    rig.register()
    pub = rig.publisher(buffer_steps=2)
    stream = rig.stream(gap_policy="keep")
    live(stream, pub, 6)  # 0..5
    pub.restart()
    for _ in range(3):
        pub.publish()  # 0, 1, 2 of the new lifetime; the buffer keeps 1, 2
    stream.resync("the stored cursor moved", [])
    drive(stream, pub)
    assert pub.requests == [5, 0] and value_of(rig.metrics.restarts) == 1
    assert rig.members() == {pub.hash_of(1), pub.hash_of(2)}
    assert rig.gap_fields() == {}
    assert value_of(rig.metrics.gaps, outcome="unrecoverable") == 0
    assert not stream.resyncing


# -- a failover that undoes a reset -----------------------------------------------------------


def test_a_failover_that_loses_a_reset_refuses_the_next_write_and_the_rank_is_reset_again(
    rig: Rig,
) -> None:
    """The writes after a reset are fenced by the reset cursor: if Redis loses the reset
    (the old lifetime's seq, digest and blocks are back), the next write is refused and the
    rank re-synced, so the old lifetime's blocks never stay next to the new one's."""
    rig.register()
    pub = rig.publisher()
    first = rig.stream()
    live(first, pub, 6)  # 0..5
    first.close()
    old_cursor, old_members = rig.store.cursor(IP, 0), rig.members()
    pub.restart()
    for _ in range(8):
        pub.publish()  # the new lifetime, past our 5
    stream = rig.stream()
    stream.on_connected()
    drive_one(stream, pub)  # seq 5 holds other bytes: reset, replay from 0 in flight
    assert pub.requests == [5] and stream.paused and rig.members() == set()
    roll_back(rig.store, old_cursor, old_members)  # the failover lost the reset
    drive(stream, pub)
    assert value_of(rig.metrics.batches, result=BatchStatus.CURSOR_MOVED) == 1
    assert value_of(rig.metrics.resyncs) == 1
    assert rig.members() == {pub.hash_of(s) for s in range(8)}
    assert rig.store.last_seq(IP, 0) == 7


# -- without replay: the batches lost before a possible restart's batch --------------------


@pytest.mark.parametrize("policy", ["keep", "clear"])
def test_a_possible_restart_without_replay_follows_the_policy_for_what_came_before(
    rig: Rig, policy: GapPolicy
) -> None:
    """A gap right after a reconnect without replay resets the rank (a possible restart);
    the batch written next still follows sequences nobody saw, so ``keep`` flags that gap
    (the index under-reports) and ``clear`` leaves the rank cleared, unflagged."""
    rig.register(replay=False)
    pub = rig.publisher()
    stream = rig.stream(gap_policy=policy)
    live(stream, pub, 3)  # 0..2
    for _ in range(2):
        pub.publish()  # 3, 4: lost while disconnected
    stream.on_connected()
    live(stream, pub, 1)  # 5
    assert value_of(rig.metrics.restarts) == 1
    assert rig.members() == {pub.hash_of(5)} and rig.store.last_seq(IP, 0) == 5
    assert value_of(rig.metrics.gaps, outcome="unrecoverable") == 1
    assert rig.gap_fields() == ({"gap:0": "1"} if policy == "keep" else {})


# -- what a refused reset says ----------------------------------------------------------------


def _lease_lost(rig: Rig, *, replay: bool = False) -> tuple[RankStream, FakePublisher]:
    """A stream that applied seqs 0..3 as the lease's holder, then lost the lease."""
    rig.register(replay=replay)
    assert rig.store.claim_instance(IP, "me", 60_000)
    pub = rig.publisher()
    stream = rig.stream(owner="me")
    live(stream, pub, 4)
    assert rig.store.release_instance(IP, "me")
    assert rig.store.claim_instance(IP, "other", 60_000)
    return stream, pub


def test_a_refused_restart_reset_names_the_evidence(rig: Rig) -> None:
    stream, pub = _lease_lost(rig, replay=True)
    pub.restart()
    pub.publish()
    stream.on_connected()
    with pytest.raises(FencedError) as caught:
        drive(stream, pub)
    assert str(caught.value) == (
        f"{IP}/r0: the reset (replay: it no longer has seq 3) was refused (not_owner)"
    )


@pytest.mark.parametrize(
    ("emptied", "why"),
    [(True, "nothing to verify a replay against"), (False, "no replay to re-sync from")],
)
def test_a_refused_resync_reset_names_why(rig: Rig, emptied: bool, why: str) -> None:
    stream, _ = _lease_lost(rig)
    if emptied:
        rig.store.r.delete(keys.l1_state(IP))
    with pytest.raises(FencedError) as caught:
        stream.resync("the stored cursor moved", [])
    assert caught.value.status is BatchStatus.NOT_OWNER
    assert str(caught.value) == (
        f"{IP}/r0: the reset (the stored cursor moved: {why}) was refused (not_owner)"
    )


# -- replies: their order, their first sequence, a trimmed buffer joined ----------------------


def test_a_replay_is_read_in_sequence_order_whatever_the_payload_bytes(rig: Rig) -> None:
    """The continuity check compares the replay's batch at the applied seq, so the reply is
    put in sequence order (not in payload byte order) before it is looked at."""
    rig.register()
    pub = rig.publisher()
    digest = _first_session_digest(rig, pub)  # 0..5
    pub.restart()
    for _ in range(6):
        pub.publish()  # 0..5 of the new lifetime (5 holds other bytes than ours)
    pub.publish_payload(payload([pub.hash_of(6)], ts=1.0))  # 6: bytes that sort first
    assert pub.buffer[-1][1] < pub.buffer[-2][1]
    stream = rig.stream(last_digest=digest)
    stream.on_connected()
    drive(stream, pub)
    assert pub.requests == [5, 0] and value_of(rig.metrics.restarts) == 1
    assert rig.members() == {pub.hash_of(s) for s in range(7)}


def _first_session_digest(rig: Rig, pub: FakePublisher, n: int = 6) -> tuple[int, bytes]:
    stream = rig.stream()
    live(stream, pub, n)
    assert stream.digest is not None
    digest = stream.digest
    stream.close()
    return digest


def test_a_gap_replay_that_starts_right_after_the_applied_seq_recovers_the_gap(rig: Rig) -> None:
    """The buffer no longer holds the applied seq but holds every one after it: nothing is
    missing, so nothing is flagged."""
    rig.register()
    pub = rig.publisher(buffer_steps=4)
    stream = rig.stream()
    live(stream, pub, 2)  # 0, 1
    for _ in range(3):
        pub.publish()  # 2, 3, 4 lost
    live(stream, pub, 1)  # 5; the buffer keeps 2..5
    drive(stream, pub)
    assert pub.requests == [1]
    assert rig.members() == {pub.hash_of(s) for s in range(6)}
    assert value_of(rig.metrics.gaps, outcome="recovered") == 1
    assert value_of(rig.metrics.gaps, outcome="unrecoverable") == 0 and rig.gap_fields() == {}


@pytest.mark.parametrize("first", [1, 2])
def test_joining_a_buffer_trimmed_by_one_or_two_is_an_unrecoverable_gap(
    rig: Rig, first: int
) -> None:
    """A first join from 0 whose reply starts at 1 or 2: batch 0 (and 1) are lost."""
    rig.register()
    pub = rig.publisher(buffer_steps=6 - first)
    stream = rig.stream()
    for _ in range(6):
        pub.publish()  # the buffer holds first..5
    stream.on_connected()
    drive(stream, pub)
    assert pub.requests == [0]
    assert rig.members() == {pub.hash_of(s) for s in range(first, 6)}
    assert rig.gap_fields() == {"gap:0": "1"}
    assert value_of(rig.metrics.gaps, outcome="unrecoverable") == 1


# -- the instance status: batches received, the lifetime's evidence ---------------------------


def test_replayed_batches_count_as_received_and_the_evidence_of_a_restart_is_kept(
    rig: Rig,
) -> None:
    inst = rig.register()
    pub = rig.publisher()
    digest = _first_session_digest(rig, pub)  # 0..5
    pub.restart()
    for _ in range(8):
        pub.publish()
    status = InstanceStatus(inst, None)
    stream = rig.stream(last_digest=digest, status=status)
    first = status.update("", "ing-1", "connected", "", False)
    assert "last_event_ms" not in first.fields  # nothing received yet
    stream.on_connected()
    drive(stream, pub)
    assert pub.requests == [5, 0]
    assert status.batches == 3 + 8  # 5..7 of the new lifetime, then 0..7
    fields = status.update("", "ing-1", "connected", "", False).fields
    assert "last_event_ms" in fields
    assert fields["lifetime_detail"] == "r0: replay: its batch 5 is not the one applied"


# -- a re-sync without replay: no gap was there, none is counted ------------------------------


def test_a_refused_seq_0_re_synced_without_replay_counts_no_recovered_gap(rig: Rig) -> None:
    """Without replay nothing is ever recovered. A quiet re-sync without replay resets the
    rank; a failover loses that reset (the old lifetime's cursor is back), so the new
    lifetime's seq 0 is refused and re-synced again: the rank is reset and seq 0 written
    after it. Nothing was missing before seq 0 and nothing was replayed: no gap is counted,
    neither recovered nor unrecoverable."""
    rig.register(replay=False)
    pub = rig.publisher()
    stream = rig.stream(gap_policy="keep")
    live(stream, pub, 3)  # 0..2
    after_2, members_2 = rig.store.cursor(IP, 0), rig.members()
    stream.resync("the stored cursor moved", [])  # no replay: the rank is reset
    assert rig.members() == set() and not stream.resyncing
    roll_back(rig.store, after_2, members_2)  # the failover lost the reset
    pub.restart()
    live(stream, pub, 1)  # the new lifetime's 0: refused, re-synced, written after a reset
    assert value_of(rig.metrics.batches, result=BatchStatus.CURSOR_MOVED) == 1
    assert value_of(rig.metrics.resyncs) == 2
    assert rig.members() == {pub.hash_of(0)} and rig.store.last_seq(IP, 0) == 0
    assert value_of(rig.metrics.gaps, outcome="recovered") == 0
    assert value_of(rig.metrics.gaps, outcome="unrecoverable") == 0
    assert rig.gap_fields() == {} and not stream.resyncing


# -- a replay endpoint ZMQ refuses --------------------------------------------------------------


@pytest.mark.parametrize("endpoint", ["tcp://*:5558", "tcp://127.0.0.1"])
def test_a_replay_endpoint_zmq_refuses_sends_every_gap_to_the_policy_and_is_logged_once(
    rig: Rig, endpoint: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The module docstring: replay is unavailable for the session, logged once (an error),
    and every gap goes to the gap policy; no batch is lost waiting for a replay."""
    _, gen = rig.store.upsert_instance(Instance(IP, "pod-a", replay_endpoint=endpoint))
    rig.inst = rig.store.get_instance(IP)
    assert rig.inst is not None and rig.inst.gen == gen
    pub = rig.publisher()
    stream = rig.stream(gap_policy="keep")
    caplog.set_level(logging.INFO, logger="services.l1_ingest.stream")
    live(stream, pub, 2)  # 0, 1
    for _ in range(2):
        pub.publish()  # lost
        live(stream, pub, 1)  # a gap each time: 3, then 5
        assert not stream.paused and stream.replay is None
    assert rig.members() == {pub.hash_of(s) for s in (0, 1, 3, 5)}
    assert rig.store.last_seq(IP, 0) == 5 and rig.gap_fields() == {"gap:0": "2"}
    assert value_of(rig.metrics.gaps, outcome="unrecoverable") == 2
    said = [r for r in caplog.records if "replay at" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.ERROR
    text = said[0].getMessage()
    assert f"replay at {endpoint!r}: unavailable (" in text
    assert text.endswith("; gaps cannot be filled)")


def test_a_replay_endpoint_that_works_is_not_logged(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    """Only a change of the endpoint's state is logged; it starts as available."""
    rig.register()
    pub = rig.publisher()
    stream = rig.stream()
    caplog.set_level(logging.DEBUG, logger="services.l1_ingest.stream")
    stream.on_connected()
    drive(stream, pub)
    assert pub.requests == [0]
    assert not [r for r in caplog.records if "replay at" in r.getMessage()]


def test_every_live_batch_counts_as_received_and_moves_the_last_event(rig: Rig) -> None:
    """``InstanceStatus.batches`` counts every batch received (duplicates too); the status
    write's ``last_event_ms`` moves whenever it changed since the last write."""
    inst = rig.register()
    pub = rig.publisher()
    status = InstanceStatus(inst, None)
    stream = rig.stream(status=status)
    live(stream, pub, 1)
    first = status.update("", "ing-1", "connected", "", False).fields["last_event_ms"]
    live(stream, pub, 2)
    stream.on_live(*pub.buffer[-1])  # a duplicate is received too
    assert status.batches == 4
    time.sleep(0.01)
    second = status.update("", "ing-1", "connected", "", False).fields["last_event_ms"]
    assert int(second) > int(first)


def test_the_replayed_batches_already_applied_count_as_duplicates(rig: Rig) -> None:
    """A gap replay holds the applied seq (the continuity check) and the held live batch:
    both are dropped and counted as duplicates, each one."""
    rig.register()
    pub = rig.publisher()
    stream = rig.stream()
    live(stream, pub, 2)  # 0, 1
    pub.publish()  # 2 lost
    live(stream, pub, 1)  # 3, held; the replay from 1 returns 1, 2, 3
    drive(stream, pub)
    assert rig.members() == {pub.hash_of(s) for s in range(4)}
    assert value_of(rig.metrics.batches, result=BatchStatus.DUPLICATE) == 2


# -- a payload that is not a batch; a refused write ---------------------------------------------


def test_a_payload_that_is_not_a_batch_is_counted_and_its_seq_recorded(rig: Rig) -> None:
    """The module docstring: dropped and counted, but its sequence is still recorded (an
    empty write), so the next batch follows without a gap."""
    rig.register()
    pub = rig.publisher()
    stream = rig.stream()
    live(stream, pub, 1)  # 0
    stream.on_live(pub.publish_payload(b"\xc1 not msgpack"), pub.buffer[-1][1])  # 1
    assert rig.store.last_seq(IP, 0) == 1
    assert value_of(rig.metrics.malformed_frames, reason="not_a_batch") == 1
    live(stream, pub, 1)  # 2
    assert rig.members() == {pub.hash_of(0), pub.hash_of(2)}
    assert rig.gap_fields() == {} and pub.requests == []


def test_a_refused_write_names_its_seq(rig: Rig) -> None:
    rig.register()
    pub = rig.publisher()
    stream = rig.stream()
    live(stream, pub, 2)
    rig.register(uid="pod-b")  # a new pod took the IP
    with pytest.raises(FencedError) as caught:
        live(stream, pub, 1)
    assert str(caught.value) == f"{IP}/r0: the write of seq 2 was refused (stale_gen)"
