"""Corners of an L1 rank stream's writes that mutation testing (issue 33) found unpinned: a
rank just reset (applied seq -1) and then reconnected (a gap there is not a possible
restart: there is no lifetime left to protect), the configured group settings, a re-sync
whose own replay write is refused again, and a write the store answers as a duplicate.
Driven as in ``test_l1_rank_stream`` (real redis-server, real ZMQ ROUTER answering vLLM's
replay protocol, real 0.28 batches)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import redis

from common import keys
from common.event_types import BlockStored
from common.events import encode_batch
from common.store import BatchStatus
from services.l1_ingest.apply import GroupSettings
from tests.metrics_oracle import count_of, sum_of, value_of
from tests.services.test_l1_cursor_fence import roll_back
from tests.services.test_l1_rank_stream import IP, Rig, drive, live, make_rig
from tests.services.test_l1_stream_resync_corners import drive_one


@pytest.fixture(name="rig")
def rig_fixture(redis_client: redis.Redis) -> Iterator[Rig]:
    yield from make_rig(redis_client)


def test_a_gap_after_a_reset_and_a_reconnect_is_written_not_taken_for_a_restart(
    rig: Rig,
) -> None:
    """Without replay, a re-sync resets the rank (applied -1); batches are lost while the
    stream reconnects; the next one is written after the gap. Kills the exclusion of -1
    written as ``(None, +1)`` or ``(None, -2)`` (a second reset and a restart counted for a
    rank that holds nothing)."""
    rig.register(replay=False)
    pub = rig.publisher()
    stream = rig.stream()
    live(stream, pub, 3)  # 0..2
    stream.resync("the stored cursor moved", [])  # no replay: the rank is reset, applied -1
    assert rig.members() == set() and rig.store.last_seq(IP, 0) == -1
    for _ in range(2):
        pub.publish()  # 3, 4: lost while disconnected
    stream.on_connected()
    live(stream, pub, 1)  # 5
    assert value_of(rig.metrics.restarts) == 0
    assert rig.members() == {pub.hash_of(5)} and rig.store.last_seq(IP, 0) == 5


def _groups_written(rig: Rig, groups: GroupSettings | None) -> dict[str, str]:
    """The instance's groups hash after one batch written by a stream given ``groups``."""
    rig.register()
    pub = rig.publisher()
    stream = rig.stream(groups=groups)
    event = BlockStored(
        [11, 12], None, list(range(8)), 4, medium="GPU", group_idx=0,
        kv_cache_spec_kind="full_attention",
    )  # fmt: skip
    data = encode_batch([event], ts=1.0, data_parallel_rank=0, vllm_version=(0, 28, 0))
    stream.on_live(pub.publish_payload(data), data)
    raw = rig.store.r.hgetall(keys.l1_groups(IP))
    return {k.decode(): v.decode() for k, v in raw.items()}


def test_a_live_batch_writes_the_configured_group_settings(rig: Rig) -> None:
    """The stream hands the hash unit and chunk size it was given to every batch it writes,
    so they reach the instance's groups hash with the first descriptor. Kills ``_write``
    decoding with no group settings (``decode_plan(…, None, …)``) and ``__init__`` dropping
    the settings it was given (``self.groups = None``, ``groups and …``)."""
    fields = _groups_written(rig, GroupSettings(hash_unit=8, chunk=64, dp_size=1))
    assert (fields["h_cfg"], fields["chunk"], fields["dp"]) == ("8", "64", "1"), fields


def test_a_stream_given_no_group_settings_writes_the_instances_dp_size(rig: Rig) -> None:
    """Without settings: no configured unit or chunk, and the registered DP size (1 here).
    Kills ``max(2, inst.dp_size)`` in ``__init__``'s default."""
    fields = _groups_written(rig, None)
    assert (fields["h_cfg"], fields["chunk"], fields["dp"]) == ("0", "0", "1"), fields


def test_the_stored_digest_wins_over_a_previous_sessions(rig: Rig) -> None:
    """A new stream compares replays with the store's digest of its applied seq; a previous
    session's (``last_digest``) only stands in when the store has none. Kills ``or`` for
    ``and`` in ``__init__`` (a stale digest of the same seq taken over the store's)."""
    rig.register()
    pub = rig.publisher()
    live(rig.stream(), pub, 3)  # 0..2
    stored = rig.store.cursor(IP, 0)
    stream = rig.stream(last_digest=(2, b"previous"))
    assert stream.digest == (2, bytes.fromhex(stored.digest)) != (2, b"previous")


def test_closing_a_stream_ends_its_replay(rig: Rig) -> None:
    """A closed stream holds no replay and is not paused. Kills ``close`` leaving a value
    that is not None (``self.replay = ""``: paused for ever, every live batch held)."""
    rig.register()
    rig.publisher()
    stream = rig.stream()
    stream.on_connected()  # the catch-up replay from 0, in flight
    assert stream.paused and stream.replay is not None
    stream.close()
    assert stream.replay is None and not stream.paused


def test_a_resync_whose_replayed_write_is_refused_again_stays_resyncing(rig: Rig) -> None:
    """A failover undoes writes 2 and 3: batch 4 is refused and the rank re-syncs from 1; a
    second failover, while that replay is in flight, takes the stored cursor back to 0. The
    replay's first write (2) is refused: the stream re-syncs again, from 0, and says so — it
    must not call the re-sync finished. Kills ``_write_run`` returning True after a re-sync
    (``resyncing`` cleared while the new replay is in flight) and its ``resync(None, …)``
    (the status without the refused seq)."""
    rig.register()
    pub = rig.publisher()
    stream = rig.stream()
    live(stream, pub, 1)  # 0
    after_0, members_0 = rig.store.cursor(IP, 0), rig.members()
    live(stream, pub, 1)  # 1
    after_1, members_1 = rig.store.cursor(IP, 0), rig.members()
    live(stream, pub, 2)  # 2, 3
    roll_back(rig.store, after_1, members_1)  # 2 and 3 lost
    live(stream, pub, 1)  # 4: refused, re-sync from 1 (replay in flight)
    assert stream.resyncing and stream.replay is not None and pub.requests == []
    roll_back(rig.store, after_0, members_0)  # 1 lost too, while the replay is in flight
    drive_one(stream, pub)
    assert stream.resyncing.startswith("the write of seq 2 was refused; stored cursor seq 0 (")
    assert stream.replay is not None and stream.replay.start_seq == 0
    assert value_of(rig.metrics.resyncs) == 2
    drive(stream, pub)
    assert pub.requests == [1, 0] and not stream.resyncing
    assert rig.members() == {pub.hash_of(s) for s in range(5)}
    assert rig.store.last_seq(IP, 0) == 4


def test_a_write_the_store_has_already_is_a_duplicate_and_the_stored_cursor_is_followed(
    rig: Rig,
) -> None:
    """The store answers ``duplicate`` when a write is not above its last seq although it
    follows the stored cursor: the stream's own count lagged the store (only a write fenced
    by the cursor it re-read can meet this). The stream re-reads the stored cursor and goes
    on from it. Kills the re-read's arguments (the cursor of another instance or rank) and
    ``applied = None`` (6 survivors of ``_write``)."""
    rig.register()
    pub = rig.publisher()
    stream = rig.stream()
    live(stream, pub, 6)  # 0..5
    stored_5 = rig.store.cursor(IP, 0)
    assert stream.stored == stored_5
    stream.cursor.applied = 2  # behind the cursor it follows
    seq, data = pub.buffer[3]
    stream.on_live(seq, data)
    assert value_of(rig.metrics.batches, result=BatchStatus.DUPLICATE) == 1
    assert stream.cursor.applied == 5 and stream.stored == stored_5 and not stream.resyncing
    live(stream, pub, 1)  # 6 follows 5
    assert value_of(rig.metrics.resyncs) == 0 and value_of(rig.metrics.restarts) == 0
    assert rig.store.last_seq(IP, 0) == 6
    assert rig.members() == {pub.hash_of(s) for s in range(7)}


def test_each_write_records_how_long_its_round_trip_took(rig: Rig) -> None:
    """``cache_indexer_l1_apply_seconds`` observes one duration per write, each inside the
    time the writes took together. Kills ``perf_counter() + started`` (a survivor of
    ``_write``: the histogram filled with twice the process clock)."""
    rig.register()
    pub = rig.publisher()
    stream = rig.stream()
    started = time.perf_counter()
    live(stream, pub, 3)
    elapsed = time.perf_counter() - started
    assert count_of(rig.metrics.apply_seconds) == 3
    assert 0 < sum_of(rig.metrics.apply_seconds) <= elapsed
