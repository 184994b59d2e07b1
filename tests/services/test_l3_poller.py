"""The L3 poller against in-memory masters (tests/fake_master.py) and a real redis-server."""

from __future__ import annotations

import functools
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import httpx
import pytest
import redis

from common import keys
from common.blockhash import BlockHasher, HashSettings
from common.settings import L3PollerSettings
from common.store import Instance
from services.l3_poller.metrics import PollerMetrics
from services.l3_poller import client as client_mod
from services.l3_poller import poller as poller_mod
from services.l3_poller.poller import L3Poller
from tests.conftest import reserve_port, wait_for
from tests.fake_master import FakeMaster
from tests.metrics_oracle import value_of
from tests.store_oracle import OracleStore

HASHER = BlockHasher(HashSettings())
TOKENS = list(range(100, 100 + 16 * 8))
DIGESTS = HASHER.digests(TOKENS, 16)
INTS = HASHER.event_ints(TOKENS, 16)
POD_A, POD_B, POD_C = "10.0.0.1", "10.0.0.2", "10.0.0.3"


def vkey(block: int, tp: int = 0, model: str = "Qwen2.5-0.5B-Instruct") -> str:
    return f"{model}@tp_rank:{tp}@pcp0@dcp0@pp_rank:0@group:0@{DIGESTS[block].hex()}"


def l3cfg(**kw: object) -> L3PollerSettings:
    base: dict[str, object] = {
        "poll_interval": 0.1,
        "http_timeout": 0.5,
        "segments_timeout": 0.5,
        "stale_after": 1.0,
        "batch_size": 3,
    }
    base.update(kw)
    return L3PollerSettings(**base)  # type: ignore[arg-type]


class Harness:
    def __init__(self, client: redis.Redis, cfg: L3PollerSettings) -> None:
        self.store = OracleStore(client)
        self.metrics = PollerMetrics.register()
        self.poller = L3Poller(cfg, self.store, self.metrics)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.poller.run, args=(self.stop,), daemon=True)

    def register(self, *ips: str) -> None:
        for ip in ips:
            self.store.upsert_instance(Instance(ip=ip, uid=f"uid-{ip}"))

    def start(self, *masters: FakeMaster) -> Harness:
        self.store.set_masters({m.url: "{}" for m in masters})
        self.thread.start()
        return self

    def members(self, ip: str) -> set[int]:
        return self.store.l3_members(ip)

    def wait_members(self, ip: str, expected: set[int], what: str = "") -> None:
        wait_for(
            lambda: self.members(ip) == expected,
            timeout=10,
            what=what or f"L3 set of {ip} == {len(expected)} blocks",
        )

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)


def populate(m: FakeMaster) -> tuple[str, str]:
    """Pods A and B mounted (P2P style endpoints); blocks 0-3 on A, 4-5 on B."""
    ep_a = m.mount(f"{POD_A}:12300", f"{POD_A}:15000")
    ep_b = m.mount(f"{POD_B}:12301", f"{POD_B}:15001")
    for b in range(6):
        m.put(vkey(b), ep_a if b < 4 else ep_b)
    return ep_a, ep_b


def test_segment_scope_sets_and_steady_state(
    harness_factory: Callable[..., Harness], master: FakeMaster
) -> None:
    ep_a, _ = populate(master)
    master.put("lmcache-key@1@0@abc@bfloat16")  # another connector: skipped
    h = harness_factory()
    h.register(POD_A, POD_B, POD_C)
    h.start(master)
    h.wait_members(POD_A, set(INTS[:4]))
    h.wait_members(POD_B, set(INTS[4:6]))
    # The writer writes instance by instance: C's state may land just after B's set.
    wait_for(lambda: h.store.l3_state(POD_C).get("blocks") == "0", what="C's state: 0 blocks")
    assert h.members(POD_C) == set()
    state = h.store.l3_state(POD_A)
    assert state["master"] == master.url and state["stale"] == "0" and state["blocks"] == "4"
    # keys go out raw, never percent-encoded, and in bounded batches (batchSize 3)
    queries = [p for p in master.requests if p.startswith("/batch_query_keys")]
    assert queries and all("@tp_rank:" in p and "%" not in p for p in queries)
    assert max(p.count(",") + 1 for p in queries) == 3
    # steady state: more polls, no more locate calls
    calls = master.calls["/batch_query_keys"]
    polls = master.calls["/get_all_keys"]
    wait_for(lambda: master.calls["/get_all_keys"] >= polls + 3, what="3 more polls")
    assert master.calls["/batch_query_keys"] == calls
    # a new block is located alone; a removed one is gone after the next poll
    master.put(vkey(6), ep_a)
    h.wait_members(POD_A, {*INTS[:4], INTS[6]})
    assert [p for p in master.requests if vkey(6) in p] == [f"/batch_query_keys?keys={vkey(6)}"]
    master.remove(vkey(0))
    h.wait_members(POD_A, {*INTS[1:4], INTS[6]})
    assert value_of(h.metrics.keys_skipped, master=master.url, reason="unparsed") >= 1
    assert value_of(h.metrics.locate_calls, master=master.url, endpoint="query_key") == 0


@pytest.mark.parametrize("metrics", [True, False])
def test_a_key_put_again_on_another_pod_between_two_polls_moves_at_the_next_poll(
    harness_factory: Callable[..., Harness], master: FakeMaster, metrics: bool
) -> None:
    """Issue 20 item 2: evicted on A and put again on B between two polls, the same key is
    listed both times; the master's removal count moved, so every key is located again.
    A master without ``/metrics`` gets every key located on every poll (slower, never
    wrong)."""
    master.metrics = metrics
    ep_a, ep_b = populate(master)
    h = harness_factory()
    h.register(POD_A, POD_B)
    h.start(master)
    h.wait_members(POD_A, set(INTS[:4]))
    calls = master.calls["/batch_query_keys"]
    polls = master.calls["/get_all_keys"]
    wait_for(lambda: master.calls["/get_all_keys"] >= polls + 2, what="2 more polls")
    assert (master.calls["/batch_query_keys"] > calls) is not metrics  # steady: none
    for b in (1, 2):
        master.put(vkey(b), ep_b)  # removed from A, put again on B: one listing to the next
    h.wait_members(POD_A, {INTS[0], INTS[3]})
    assert h.members(POD_B) == {INTS[1], INTS[2], *INTS[4:6]}
    if metrics:  # a key that is only removed is accounted for by the listing: no re-location
        calls = master.calls["/batch_query_keys"]
        master.remove(vkey(5))
        h.wait_members(POD_B, {INTS[1], INTS[2], INTS[4]})
        polls = master.calls["/get_all_keys"]
        wait_for(lambda: master.calls["/get_all_keys"] >= polls + 2, what="2 more polls")
        assert master.calls["/batch_query_keys"] == calls


def test_unmounted_segment_takes_its_blocks_away(
    harness_factory: Callable[..., Harness], master: FakeMaster
) -> None:
    populate(master)
    h = harness_factory()
    h.register(POD_A, POD_B)
    h.start(master)
    h.wait_members(POD_B, set(INTS[4:6]))
    master.unmount(f"{POD_B}:12301")
    h.wait_members(POD_B, set())
    assert h.members(POD_A) == set(INTS[:4])


@pytest.mark.parametrize("version", ["0.3.10", "0.3.8"])
def test_old_masters(harness_factory: Callable[..., Harness], version: str) -> None:
    """0.3.10: no segments detail (map by host); 0.3.8: no batch endpoint (query_key, text)."""
    m = FakeMaster(version).start()
    try:
        populate(m)
        h = harness_factory()
        h.register(POD_A, POD_B)
        h.start(m)
        h.wait_members(POD_A, set(INTS[:4]))
        h.wait_members(POD_B, set(INTS[4:6]))
        by = "query_key" if version == "0.3.8" else "batch_query_keys"
        assert value_of(h.metrics.locate_calls, master=m.url, endpoint=by) > 0
        assert all("%" not in p for p in m.requests)
    finally:
        m.stop()


def test_tp2_block_missing_one_rank(
    harness_factory: Callable[..., Harness], master: FakeMaster
) -> None:
    ep_a = master.mount(f"{POD_A}:12300", f"{POD_A}:15000")
    ep_b = master.mount(f"{POD_B}:12300", f"{POD_B}:15000")
    for b in range(4):
        master.put(vkey(b, 0, "TP2"), ep_a)
        master.put(vkey(b, 1, "TP2"), ep_b)
    h = harness_factory()
    h.register(POD_A, POD_B)
    h.start(master)
    h.wait_members(POD_A, set(INTS[:4]))
    master.remove(vkey(2, 1, "TP2"))
    h.wait_members(POD_A, {INTS[0], INTS[1], INTS[3]})
    assert h.members(POD_B) == {INTS[0], INTS[1], INTS[3]}


def gkey(block: int, tp: int, group: int) -> str:
    return f"Hybrid@tp_rank:{tp}@pcp0@dcp0@pp_rank:0@group:{group}@{DIGESTS[block].hex()}"


def test_hybrid_groups_are_separate_sets(
    harness_factory: Callable[..., Harness], master: FakeMaster
) -> None:
    """vLLM in-tree TP2 hybrid: full-attention group 0 at every block, sliding-window group 1
    at the tails only (blocks 3 and 5). Each group is its own set in Redis."""
    ep_a = master.mount(f"{POD_A}:12300", f"{POD_A}:15000")
    ep_b = master.mount(f"{POD_A}:12301", f"{POD_A}:15001")
    for b in range(6):
        for tp, ep in ((0, ep_a), (1, ep_b)):
            master.put(gkey(b, tp, 0), ep)
            if b in (3, 5):
                master.put(gkey(b, tp, 1), ep)
    h = harness_factory()
    h.register(POD_A, POD_B)
    h.start(master)
    h.wait_members(POD_A, set(INTS[:6]))
    wait_for(lambda: h.store.l3_members(POD_A, 1) == {INTS[3], INTS[5]}, what="group 1")
    state = h.store.l3_state(POD_A)
    assert state["groups"] == "0,1" and state["blocks"] == "8"
    master.remove(gkey(5, 1, 1))  # block 5 loses one rank in group 1: group 1 only
    wait_for(lambda: h.store.l3_members(POD_A, 1) == {INTS[3]}, what="group 1 without 5")
    assert h.members(POD_A) == set(INTS[:6])
    master.remove(gkey(3, 0, 1))  # group 1 empty: its set goes
    wait_for(lambda: h.store.l3_state(POD_A).get("groups") == "0", what="group 1 gone")
    assert not h.store.r.exists(keys.l3_group_set(POD_A, 1))
    assert h.members(POD_A) == set(INTS[:6])
    assert h.store.l3_state(POD_B)["groups"] == "0" and h.members(POD_B) == set()


def test_pool_scope_and_standalone_fallback(
    harness_factory: Callable[..., Harness], master: FakeMaster
) -> None:
    populate(master)
    h = harness_factory(scope="pool")
    h.register(POD_A, POD_B, POD_C)
    h.start(master)
    h.wait_members(POD_A, set(INTS[:6]))
    h.wait_members(POD_B, set(INTS[:6]))
    assert h.members(POD_C) == set()  # no segment on this master: not attached
    assert master.calls["/batch_query_keys"] == 0  # pool scope locates nothing
    # standalone-store: the only master has no segment of a registered instance
    master.unmount(f"{POD_A}:12300")
    master.unmount(f"{POD_B}:12301")
    ep = master.mount("127.0.0.1:50053")
    master.put(vkey(7), ep)
    h.wait_members(POD_C, {INTS[7]})
    assert h.members(POD_A) == {INTS[7]}


class FrozenClock:
    """The ``time`` of the poller and client modules: ``monotonic`` stands still until the
    test advances it, so "younger than staleAfter" does not depend on how fast a loaded
    machine polls. (HTTP timeouts are httpx's own, on the real clock.)"""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    @staticmethod
    def time() -> float:
        return time.time()


@pytest.mark.parametrize("fault", ["503", "garbage", "binary", "truncated", "slow", "down"])
def test_faults_keep_state_then_drop_it(
    harness_factory: Callable[..., Harness], monkeypatch: pytest.MonkeyPatch, fault: str
) -> None:
    clock = FrozenClock()
    monkeypatch.setattr(poller_mod, "time", clock)
    monkeypatch.setattr(client_mod, "time", clock)  # the body deadline is on the same clock
    port = reserve_port()
    master = FakeMaster("0.3.13", port=port).start()
    populate(master)
    h = harness_factory(stale_after=1.5, http_timeout=0.3)
    h.register(POD_A, POD_B)
    h.start(master)
    h.wait_members(POD_A, set(INTS[:4]))
    errors = functools.partial(value_of, h.metrics.errors)
    if fault == "down":
        master.stop()
    else:
        master.slow_seconds = 1.0
        master.fault = fault
    wait_for(
        lambda: (
            sum(
                errors(master=master.url, reason=r)
                for r in ("status_503", "garbage", "truncated", "timeout", "down")
            )
            >= 2
        ),
        what=f"failed polls ({fault})",
    )
    assert h.members(POD_A) == set(INTS[:4])  # kept while younger than staleAfter
    assert h.store.l3_state(POD_A)["stale"] == "0"
    clock.now += 1.5  # staleAfter has passed since the last good poll
    h.wait_members(POD_A, set(), what="state dropped after staleAfter")
    assert h.store.l3_state(POD_A)["stale"] == "1"
    assert value_of(h.metrics.master_stale, master=master.url) == 1
    if fault == "down":
        revived = FakeMaster("0.3.13", port=port).start()
        revived.set_keys(master.keys)
        revived.segments = master.segments
        master = revived
    master.fault = None
    h.wait_members(POD_A, set(INTS[:4]), what="recovery")
    assert h.store.l3_state(POD_A)["stale"] == "0"
    master.stop()


def test_masters_are_independent_and_removal_clears(
    harness_factory: Callable[..., Harness], master: FakeMaster
) -> None:
    other = FakeMaster("0.3.13").start()
    try:
        ep_a = master.mount(f"{POD_A}:12300", f"{POD_A}:15000")
        master.put(vkey(0), ep_a)
        ep_b = other.mount(f"{POD_B}:12300", f"{POD_B}:15000")
        ep_a2 = other.mount(f"{POD_A}:12301", f"{POD_A}:15001")  # A on both masters
        other.put(vkey(1), ep_b)
        other.put(vkey(2), ep_a2)
        h = harness_factory(stale_after=30)
        h.register(POD_A, POD_B)
        h.start(master, other)
        h.wait_members(POD_A, {INTS[0], INTS[2]})
        h.wait_members(POD_B, {INTS[1]})
        assert set(h.store.l3_state(POD_A)["master"].split(",")) == {master.url, other.url}
        master.fault = "503"
        other.put(vkey(3), ep_b)
        h.wait_members(POD_B, {INTS[1], INTS[3]})  # the healthy master keeps going
        assert h.members(POD_A) == {INTS[0], INTS[2]}  # the failing one's part is kept
        h.store.set_masters({other.url: "{}"})
        h.wait_members(POD_A, {INTS[2]}, what="removed master's blocks gone")
    finally:
        other.stop()


def test_ipv6_instance(harness_factory: Callable[..., Harness], master: FakeMaster) -> None:
    ep = master.mount("[fd00::a]:12300", "[fd00::a]:15000")
    master.put(vkey(0), ep)
    h = harness_factory()
    h.register("fd00:0:0::a")
    h.start(master)
    h.wait_members("fd00:0:0::a", {INTS[0]})


def test_command_exposes_metrics(
    redis_server: object, master: FakeMaster, tmp_path: object, subprocess_env: dict[str, str]
) -> None:
    url = redis_server.url  # type: ignore[attr-defined]
    store = OracleStore(redis.Redis.from_url(url))
    store.r.flushall()
    populate(master)
    store.upsert_instance(Instance(ip=POD_A, uid="a"))
    store.set_masters({master.url: "{}"})
    cfg = tmp_path / "c.yaml"  # type: ignore[operator]
    cfg.write_text(f"redis:\n  url: {url}\ningest:\n  l3:\n    pollInterval: 100ms\n")
    port = reserve_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.cli",
            "l3-poll",
            "--config",
            str(cfg),
            "--metrics-port",
            str(port),
        ],
        env=subprocess_env,
        stderr=subprocess.PIPE,
    )
    try:
        wait_for(lambda: store.l3_members(POD_A) == set(INTS[:4]), what="l3-poll writes")
        text = wait_for(lambda: httpx.get(f"http://127.0.0.1:{port}/metrics").text)
        for name in (
            "keys_seen_total",
            "keys_parsed_total",
            "keys_skipped_total",
            "locate_calls_total",
            "poll_seconds_count",
            "errors_total",
        ):
            assert f"cache_indexer_l3_{name}" in text
        assert f'cache_indexer_l3_keys_parsed_total{{master="{master.url}"}}' in text
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=10)
    assert proc.returncode == 0, err.decode()[-2000:]


@pytest.mark.parametrize("version", ["0.3.13", "0.3.8"])
def test_overlong_lines_and_malformed_locate_bodies(
    harness_factory: Callable[..., Harness], version: str
) -> None:
    """A 1 MiB key line is skipped and counted; a body that is one 16 MiB line fails the
    poll as truncated, a malformed ``/batch_query_keys`` or ``/query_key`` body as garbage
    (0.3.8 has no batch endpoint: ``/query_key`` per key)."""
    master = FakeMaster(version).start()
    try:
        populate(master)
        master.put("x" * (1 << 20))
        h = harness_factory(stale_after=30)
        h.register(POD_A, POD_B)
        h.start(master)
        h.wait_members(POD_A, set(INTS[:4]))
        assert value_of(h.metrics.keys_skipped, master=master.url, reason="too_long") >= 1
        errors = functools.partial(value_of, h.metrics.errors)
        master.fault = "one_line"
        wait_for(lambda: errors(master=master.url, reason="truncated") >= 1, what="truncated")
        master.fault = "bad_locate"
        master.put(vkey(6), master.segments[f"{POD_A}:12300"])  # must be located: bad answer
        wait_for(lambda: errors(master=master.url, reason="garbage") >= 1, what="garbage")
        assert h.members(POD_A) == set(INTS[:4])  # failed polls change nothing
        assert errors(master=master.url, reason="KeyError") == 0
        master.fault = None
        h.wait_members(POD_A, {*INTS[:4], INTS[6]})
    finally:
        master.stop()
