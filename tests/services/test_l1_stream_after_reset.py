"""An L1 rank stream whose rank was just reset (applied seq -1) and then reconnected: a
gap there is not a possible restart — there is no lifetime left to protect (issue 33, a
survivor of mutation testing: ``on_live``'s ``applied not in (None, -1)``). Driven as in
``test_l1_rank_stream`` (real redis-server, real 0.28 batches)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from common import keys
from common.event_types import BlockStored
from common.events import encode_batch
from services.l1_ingest.apply import GroupSettings
from tests.metrics_oracle import value_of
from tests.services.test_l1_rank_stream import IP, Rig, live, make_rig


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


def test_a_live_batch_writes_the_configured_group_settings(rig: Rig) -> None:
    """The stream hands its configured hash unit and chunk size to every batch it writes, so
    they reach the instance's groups hash with the first descriptor. Kills ``_write``
    decoding with no group settings (``decode_plan(…, None, …)``)."""
    rig.register()
    pub = rig.publisher()
    stream = rig.stream()
    stream.groups = GroupSettings(hash_unit=8, chunk=64, dp_size=1)
    event = BlockStored(
        [11, 12], None, list(range(8)), 4, medium="GPU", group_idx=0,
        kv_cache_spec_kind="full_attention",
    )  # fmt: skip
    data = encode_batch([event], ts=1.0, data_parallel_rank=0, vllm_version=(0, 28, 0))
    stream.on_live(pub.publish_payload(data), data)
    raw = rig.store.r.hgetall(keys.l1_groups(IP))
    fields = {(k.decode() if isinstance(k, bytes) else k): v for k, v in raw.items()}
    assert fields["h_cfg"] in ("8", b"8") and fields["chunk"] in ("64", b"64"), fields
