"""L1 ingester against real ZMQ publishers (the simulator) and a real redis-server.

The ingester runs in-process here (threads) so its metrics can be read; process-level
behaviour (SIGKILL, lease handover, the CLI) is in test_l1_ingest_processes.py.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Iterator

import msgpack
import pytest
import redis
import zmq

from common.events import AllBlocksCleared, BlockRemoved, BlockStored
from common.store import Instance
from services.l1_ingest.metrics import IngestMetrics
from services.l1_ingest.subscriber import Subscriber
from services.simulator.cache_model import Request
from services.simulator.engine import SimulatedVLLM
from services.simulator.publisher import Publisher
from services.simulator.workload import Workload
from tests.conftest import DATA, RedisServer, reserve_ports, wait_for
from tests.integration.l1_support import (
    InProcessIngester,
    emit,
    assert_exact,
    l1_config,
    register,
    true_counts,
    wait_quiet,
    warm_up,
)
from tests.metrics_oracle import value_of
from tests.store_oracle import OracleStore

IP = "127.0.0.11"
SimFactory = Callable[..., SimulatedVLLM]


@pytest.fixture()
def make_sim() -> Iterator[SimFactory]:
    sims: list[SimulatedVLLM] = []

    def make(
        version: str = "0.28.0", *, replay: bool = True, dp: int = 1, **kw: object
    ) -> SimulatedVLLM:
        port = reserve_ports(dp)
        rport = reserve_ports(dp) if replay else 0
        kw.setdefault("num_blocks", 64)
        sim = SimulatedVLLM(
            f"tcp://*:{port}",
            f"tcp://*:{rport}" if replay else "",
            "kv-events",
            vllm_version=version,
            ranks=range(dp),
            **kw,
        )  # type: ignore[arg-type]
        sims.append(sim)
        return sim

    yield make
    for sim in sims:
        sim.close()


def drive(
    sim: SimulatedVLLM, steps: int, seed: int = 1, per_step: int = 3, drop_every: int = 0
) -> list[Request]:
    workload = Workload("mixed", prompts=12, prompt_len=96, block_size=sim.block_size, seed=seed)
    served = []
    for i in range(1, steps + 1):
        requests = [workload.next() for _ in range(per_step * len(sim.ranks))]
        sim.serve(requests, drop=bool(drop_every) and i % drop_every == 0)
        served += requests
    if drop_every and steps % drop_every == 0:
        # The last step was dropped: nothing later reveals that gap unless a batch follows
        # (as vLLM's next step would), so send each rank an empty live batch.
        for rank in sim.ranks:
            emit(sim, [], rank=rank)
    return served


@pytest.mark.parametrize("version", ["0.23.0", "0.28.0", "0.34.0"])
def test_both_encodings_index_exactly(
    redis_client: redis.Redis,
    make_sim: SimFactory,
    ingester: Callable[..., InProcessIngester],
    version: str,
) -> None:
    store = OracleStore(redis_client)
    sim = make_sim(version, replay=False, cpu_blocks=16)
    ing = ingester()
    register(store, IP, sim)
    warm_up(store, IP, sim)
    served = drive(sim, 40)
    twin = Request(tuple(range(1000, 1048)))  # same new prompt twice in one step: two copies
    sim.serve([twin, twin])
    assert_exact(store, IP, sim)
    assert [store.tier_counts(IP)[h] for h in sim.models[0].hashes(twin)] == [2, 2, 2]
    assert sim.models[0].cpu_hashes(), "workload must offload to CPU (tier l2)"
    assert ing.count("events", type="BlockStored", outcome="l2") > 0
    assert ing.count("skipped_media", medium="CPU") > 0
    for request in served:
        got = store.prefix_lengths([IP], sim.member_keys(request))[0][0]
        assert got == sim.true_prefix_len(request)


def test_event_semantics_copies_media_groups_and_bad_input(
    redis_client: redis.Redis, make_sim: SimFactory, ingester: Callable[..., InProcessIngester]
) -> None:
    store = OracleStore(redis_client)
    sim = make_sim(replay=False)
    ing = ingester()
    register(store, IP, sim)
    warm_up(store, IP, sim)

    def stored(h: int, **kw: object) -> BlockStored:
        kw.setdefault("medium", "GPU")
        return BlockStored([h], None, list(range(16)), 16, **kw)  # type: ignore[arg-type]

    emit(
        sim,
        [
            stored(1),
            stored(1),
            stored(2, medium=None),
            stored(3, medium="cpu"),
            stored(4, group_idx=1),
            stored(
                5, group_idx=2, kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=64
            ),
            BlockStored([6], None, [], 0, medium="GPU"),
            BlockRemoved([1], medium="GPU"),
        ],
    )
    wait_quiet(store, IP, sim)
    assert store.tier_counts(IP, "l1") == {1: 1, 2: 1}  # stored twice, removed once: held
    assert store.tier_members(IP, "l1", 1) == {4}  # other KV-cache groups: their own sets
    assert store.tier_members(IP, "l1", 2) == {5}
    assert store.groups(IP)["2"] == "sliding_window,16,64,16"
    assert store.tier_members(IP, "l2") == {3}
    # An unknown event between good ones is skipped; the rest of the batch still applies.
    good = msgpack.packb(
        [
            1.0,
            [
                {
                    "type": "BlockStored",
                    "block_hashes": [7],
                    "parent_block_hash": None,
                    "token_ids": [1],
                    "block_size": 1,
                    "lora_id": None,
                    "medium": "GPU",
                },
                {"type": "Snapshot", "x": 1},
                ["BlockRemoved", [1], "GPU"],
            ],
            0,
        ]
    )
    sim.publishers[0].publish_payload(good)
    not_a_batch = sim.publishers[0].publish_payload(b"\xc1garbage")
    emit(sim, [BlockRemoved([2], medium="GPU")])
    wait_quiet(store, IP, sim)
    assert store.tier_members(IP, "l1") == {7}
    assert ing.count("events", type="unknown", outcome="skipped:unknown_type") == 1
    assert ing.count("malformed_frames", reason="not_a_batch") == 1
    assert store.l1_state(IP).get("gap:0") is None, f"seq {not_a_batch} must not be a gap"
    emit(sim, [AllBlocksCleared()])
    wait_quiet(store, IP, sim)
    assert store.tier_members(IP, "l1") == set() and store.tier_members(IP, "l2") == {3}


@pytest.mark.parametrize("version", ["0.23.0", "0.28.0"])  # replay without / with topic frame
def test_gaps_are_filled_by_replay(
    redis_client: redis.Redis,
    make_sim: SimFactory,
    ingester: Callable[..., InProcessIngester],
    version: str,
) -> None:
    store = OracleStore(redis_client)
    sim = make_sim(version)
    ing = ingester()
    register(store, IP, sim)
    warm_up(store, IP, sim)
    drive(sim, 30, drop_every=4)
    assert_exact(store, IP, sim)
    assert ing.count("gaps", outcome="recovered") >= 1
    assert ing.count("gaps", outcome="unrecoverable") == 0
    assert "gap:0" not in store.l1_state(IP)


@pytest.mark.parametrize("policy", ["keep", "clear"])
def test_unrecoverable_gaps_follow_the_policy(
    redis_client: redis.Redis,
    make_sim: SimFactory,
    ingester: Callable[..., InProcessIngester],
    policy: str,
) -> None:
    store = OracleStore(redis_client)
    # keep: replay exists but its buffer (2 batches) no longer holds the first lost one;
    # clear: no replay endpoint at all.
    sim = make_sim(replay=policy == "keep", buffer_steps=2)
    ing = ingester(onUnrecoverableGap=policy)
    register(store, IP, sim)
    warm_up(store, IP, sim)
    gaps_before = ing.count("gaps", outcome="unrecoverable")
    flagged_before = int(store.l1_state(IP).get("gap:0", 0))
    emit(sim, [BlockStored([11], None, [1] * 16, 16, medium="GPU")])
    wait_quiet(store, IP, sim)
    for h in (12, 13, 14):
        emit(sim, [BlockStored([h], None, [1] * 16, 16, medium="GPU")], drop=True)
    emit(sim, [BlockStored([15], None, [1] * 16, 16, medium="GPU")])
    wait_quiet(store, IP, sim)
    assert ing.count("gaps", outcome="unrecoverable") == gaps_before + 1
    if policy == "keep":  # kept and flagged; replay still delivered what it had (14)
        assert store.tier_members(IP, "l1") == {11, 14, 15}
        assert int(store.l1_state(IP)["gap:0"]) == flagged_before + 1
    else:  # cleared, then the batch after the gap applied
        assert store.tier_members(IP, "l1") == {15}


@pytest.mark.parametrize("replay", [True, False])
def test_publisher_restart_drops_the_old_index(
    redis_client: redis.Redis,
    make_sim: SimFactory,
    ingester: Callable[..., InProcessIngester],
    replay: bool,
) -> None:
    store = OracleStore(redis_client)
    sim = make_sim(replay=replay)
    ing = ingester()
    register(store, IP, sim)
    if not replay:
        warm_up(store, IP, sim)
    drive(sim, 15, seed=2)
    assert_exact(store, IP, sim)
    before = set(true_counts(sim))
    sim.restart()
    if not replay:  # the first batches after a reconnect may be lost; send no-ops first

        def detected() -> bool:
            if ing.count("restarts") >= 1:
                return True
            emit(sim, [AllBlocksCleared()])
            return False

        wait_for(detected, interval=0.05, what="the restart to be detected")
    drive(sim, 10, seed=3)
    assert_exact(store, IP, sim)
    assert ing.count("restarts") == 1
    stale = before - set(true_counts(sim))
    assert stale and not stale & store.tier_members(IP, "l1")


def test_dp_ranks_are_separate_streams(
    redis_client: redis.Redis, make_sim: SimFactory, ingester: Callable[..., InProcessIngester]
) -> None:
    store = OracleStore(redis_client)
    sim = make_sim(dp=2)
    ingester()
    register(store, IP, sim)
    warm_up(store, IP, sim)
    served = drive(sim, 20, seed=4, per_step=2, drop_every=5)
    assert_exact(store, IP, sim)
    assert {store.last_seq(IP, 0), store.last_seq(IP, 1)} == {sim.last_seq(0), sim.last_seq(1)}
    assert sim.models[0].gpu_counts() and sim.models[1].gpu_counts()
    sim.reset_prefix_cache(rank=1)  # AllBlocksCleared empties rank 1 only
    wait_quiet(store, IP, sim)
    assert store.tier_counts(IP, "l1") == sim.models[0].gpu_counts()
    for request in served:
        assert store.prefix_lengths([IP], sim.member_keys(request))[0][0] == sim.true_prefix_len(
            request
        )


def test_registry_changes_take_effect_without_restart(
    redis_client: redis.Redis, make_sim: SimFactory, ingester: Callable[..., InProcessIngester]
) -> None:
    store = OracleStore(redis_client)
    first, second = make_sim(), make_sim()
    ing = ingester()
    register(store, IP, first)
    drive(first, 5)
    assert_exact(store, IP, first)
    # The pod on this IP is replaced (new uid → new generation, data dropped by discovery):
    # the ingester resubscribes to the new endpoint with fresh state.
    register(store, IP, second, uid="uid-2")
    drive(second, 5, seed=9)
    assert_exact(store, IP, second)
    store.remove_instance(IP)
    wait_for(lambda: value_of(ing.metrics.subscribed) == 0, what="the ingester to unsubscribe")
    drive(second, 3, seed=10)
    second.flush()
    assert store.last_seq(IP, 0) is None and store.tier_members(IP, "l1") == set()


def _capture(name: str) -> dict[str, object]:
    doc = json.loads((DATA / "vllm_golden.json").read_text())
    return doc["versions"]["0.28.0"]["zmq_capture"][name]  # type: ignore[no-any-return]


@pytest.mark.parametrize("name", ["topic_kv_events_dp0", "topic_empty_dp1"])
def test_real_vllm_frames(
    redis_client: redis.Redis, ingester: Callable[..., InProcessIngester], name: str
) -> None:
    """Frames captured from a real vLLM 0.28.0 publisher, re-sent through a real PUB socket.

    The capture's endpoint was the subscriber's (vLLM connects its PUB when the endpoint is
    not a wildcard); here the PUB binds a free port and the ingester connects, the usual
    deployment. The frames on the wire are byte-identical to the capture.
    """
    cap = _capture(name)
    rank, topic = int(cap["data_parallel_rank"]), str(cap["topic"])  # type: ignore[call-overload]
    port, rport = reserve_ports(2), reserve_ports(2)
    pub = Publisher(
        f"tcp://*:{port}",
        f"tcp://*:{rport}",
        topic,
        dp_rank=rank,
        vllm_version=(0, 28, 0),
        buffer_steps=int(cap["buffer_steps"]),
    )  # type: ignore[call-overload]
    store = OracleStore(redis_client)
    try:
        ing = ingester(topic=topic)
        store.upsert_instance(
            Instance(
                ip=IP,
                uid="u",
                zmq_endpoint=f"tcp://127.0.0.1:{port}",
                replay_endpoint=f"tcp://127.0.0.1:{rport}",
                dp_size=rank + 1,
            )
        )
        wait_for(lambda: ing.count("replays", result="complete") >= 1, what="connect + replay")
        held: Counter[int] = Counter()
        for frame in cap["live_frames"]:  # type: ignore[attr-defined]
            topic_hex, seq_hex, payload_hex = frame["frames_hex"]
            assert bytes.fromhex(topic_hex) == topic.encode()
            seq = pub.publish_payload(bytes.fromhex(payload_hex))
            assert seq == int(seq_hex, 16) == frame["seq"]
            for event in frame["payload_decoded_plain_msgpack"][1]:
                if event["type"] == "AllBlocksCleared":
                    held.clear()
                for h in event.get("block_hashes", []):
                    held[h] += 1 if event["type"] == "BlockStored" else -1
            wait_for(lambda s=seq: store.last_seq(IP, rank) == s, what=f"seq {seq}")
            assert store.tier_counts(IP) == {h: n for h, n in held.items() if n > 0}
        # The simulator's replay answers byte for byte like the captured vLLM DEALER replay.
        replay = cap["replay_dealer"]
        dealer = pub.ctx.socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{rport + rank}")
        dealer.send_multipart([bytes.fromhex(h) for h in replay["request_frames_hex"]])  # type: ignore[index]
        for expected in replay["replies_frames_hex"]:  # type: ignore[index]
            assert dealer.poll(5000)
            assert dealer.recv_multipart() == [bytes.fromhex(h) for h in expected]
        dealer.close(linger=0)
    finally:
        pub.close()


# -- review fixes: idle loop, unconnectable replay, restarts while away, trimmed joins ---------


class _FakeClock:
    """Stands in for the subscriber's ``time`` module and for its stop event: ``wait``
    records the wait and advances the clock by it, so no real time passes."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.waits: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def wait(self, timeout: float | None = None) -> bool:
        assert timeout is not None and timeout >= 0
        self.waits.append(timeout)
        self.now += timeout
        return False

    def is_set(self) -> bool:
        return False


def test_idle_subscriber_waits_instead_of_spinning(
    redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With no socket to poll (nothing assigned, or every instance waiting to retry) a
    loop round must block for the poll timeout or until the next retry is due, never
    return at once. Counted with an injected clock: loop rounds per (fake) second."""
    from services.l1_ingest import subscriber as subscriber_mod

    clock = _FakeClock()
    monkeypatch.setattr(subscriber_mod, "time", clock)
    sub = Subscriber(
        OracleStore(redis_client), l1_config(), IngestMetrics(), ctx=zmq.Context.instance()
    )
    rounds: list[int] = []
    for instances in ({}, {IP: Instance(ip=IP, uid="u", gen=1)}):  # the 2nd has no endpoint
        sub.set_instances(instances)
        start, n = clock.now, 0
        while clock.now - start < 2.0 and n < 1000:  # 2 s of fake time
            sub.run_once(stop=clock)  # type: ignore[arg-type]
            n += 1
        rounds.append(n)
    sub.close()
    assert rounds[0] == 8, rounds  # one 250 ms wait per round
    # Retries back off 20 ms .. 200 ms (jittered): at least ~10 rounds, never a spin.
    assert 8 <= rounds[1] <= 2.0 / 0.01, rounds
    assert all(w > 0 for w in clock.waits), "a round that waited for nothing is a spin"


@pytest.mark.parametrize("bad", ["tcp://*:5558", "tcp://127.0.0.1"])
def test_unconnectable_replay_endpoint_applies_the_gap_policy(
    redis_client: redis.Redis,
    make_sim: SimFactory,
    ingester: Callable[..., InProcessIngester],
    caplog: pytest.LogCaptureFixture,
    bad: str,
) -> None:
    store = OracleStore(redis_client)
    broken, good = make_sim(replay=False), make_sim()
    ing = ingester()
    store.upsert_instance(
        Instance(
            ip=IP,
            uid="u",
            zmq_endpoint=broken.endpoint.replace("*", "127.0.0.1"),
            replay_endpoint=bad,
        )
    )
    register(store, "127.0.0.12", good)
    warm_up(store, IP, broken)
    caplog.set_level("ERROR", logger="services.l1_ingest.stream")

    def stored(h: int) -> list[BlockStored]:
        return [BlockStored([h], None, [1] * 16, 16, medium="GPU")]

    for first in (11, 21):  # two gaps: each applied by the policy, replay reported once
        emit(broken, stored(first))
        emit(broken, stored(first + 1), drop=True)
        emit(broken, stored(first + 2))
        drive(good, 4, drop_every=2)
        wait_quiet(store, IP, broken)
    assert store.tier_members(IP, "l1") == {11, 13, 21, 23}
    assert int(store.l1_state(IP)["gap:0"]) == 2
    assert ing.count("gaps", outcome="unrecoverable") == 2
    assert_exact(store, "127.0.0.12", good)  # the other instance was not held up
    unavailable = [r for r in caplog.records if "unavailable" in r.getMessage()]
    assert len(unavailable) == 1, [r.getMessage() for r in unavailable]


def test_vllm_restart_while_the_ingester_was_away(
    redis_client: redis.Redis, make_sim: SimFactory, ingester: Callable[..., InProcessIngester]
) -> None:
    """The new vLLM published more batches than we had applied: the replay from our last
    sequence is not empty, but its batch there is not the one we applied."""
    store = OracleStore(redis_client)
    sim = make_sim()
    ing = ingester()
    register(store, IP, sim)
    drive(sim, 6, seed=2)
    assert_exact(store, IP, sim)
    applied = store.last_seq(IP, 0)
    before = set(true_counts(sim))
    ing.pause()
    sim.restart()
    drive(sim, 12, seed=3)
    sim.flush()
    assert applied is not None and sim.last_seq(0) > applied
    ing.resume()
    assert_exact(store, IP, sim)
    assert ing.count("restarts") == 1
    stale = before - set(true_counts(sim))
    assert stale and not stale & store.tier_members(IP, "l1")


@pytest.mark.parametrize("policy", ["keep", "clear"])
def test_joining_a_trimmed_replay_buffer_is_an_unrecoverable_gap(
    redis_client: redis.Redis,
    make_sim: SimFactory,
    ingester: Callable[..., InProcessIngester],
    policy: str,
) -> None:
    store = OracleStore(redis_client)
    sim = make_sim(buffer_steps=3)
    for h in range(1, 7):  # seqs 0..5 before anyone listens; replay keeps 3..5
        emit(sim, [BlockStored([h], None, [h] * 16, 16, medium="GPU")])
    sim.flush()
    ing = ingester(onUnrecoverableGap=policy)
    register(store, IP, sim)
    wait_quiet(store, IP, sim)
    assert store.tier_members(IP, "l1") == {4, 5, 6}
    assert ing.count("gaps", outcome="unrecoverable") == 1
    assert store.l1_state(IP).get("gap:0") == ("1" if policy == "keep" else None)


# -- Redis outages ------------------------------------------------------------------------


@pytest.fixture()
def own_redis() -> Iterator[tuple[RedisServer, redis.Redis]]:
    server = RedisServer().start()
    client = redis.Redis.from_url(server.url, socket_timeout=2, socket_connect_timeout=1)
    yield server, client
    client.close()
    server.cleanup()


def test_redis_outage_with_data_kept_converges(
    own_redis: tuple[RedisServer, redis.Redis], make_sim: SimFactory
) -> None:
    server, client = own_redis
    store = OracleStore(client)
    sim = make_sim()
    ing = InProcessIngester(client)
    try:
        register(store, IP, sim)
        drive(sim, 8, seed=5)
        assert_exact(store, IP, sim)
        client.save()  # persistence is off; this snapshot is what the restart loads
        server.stop()
        drive(sim, 6, seed=6, drop_every=2)  # published while Redis is down
        wait_for(
            lambda: value_of(ing.metrics.subscribed) == 0,
            what="the failed write to close the subscription",
        )
        server.start()
        drive(sim, 3, seed=7)
        assert_exact(store, IP, sim)
        assert "gap:0" not in store.l1_state(IP)
        assert ing.count("restarts") == 0
    finally:
        ing.close()


def test_redis_data_loss_then_reregistration_converges(
    own_redis: tuple[RedisServer, redis.Redis], make_sim: SimFactory
) -> None:
    """Redis restarts empty while nothing is published (the ingester keeps its cursor) and
    discovery registers the instance again."""
    server, client = own_redis
    store = OracleStore(client)
    sim = make_sim()
    ing = InProcessIngester(client)
    try:
        old_gen = register(store, IP, sim)
        drive(sim, 8, seed=5)
        assert_exact(store, IP, sim)
        server.stop()
        server.start()
        # Same pod, same uid: only a generation that differs although Redis lost its
        # counter fences the ingester's in-memory cursor (from before the loss).
        assert register(store, IP, sim) != old_gen
        drive(sim, 4, seed=6)
        assert_exact(store, IP, sim)
    finally:
        ing.close()
