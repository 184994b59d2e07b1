"""Every process on Redis Sentinel (1 master, 1 replica, 3 sentinels; Debian's redis-server and
redis-sentinel on loopback) while the master fails, with simulated vLLM pods publishing.

After each failure, every probe of every instance — a busy one that keeps publishing and a
quiet one that does not — must equal the publishers' truth (tests/integration/fleet.py); the
time it takes is printed by scripts/bench_failover.py, not asserted here.

* kill -9 of the master while the pods publish, then the old master coming back empty on its
  port (Sentinel makes it a replica of the new one; nobody may write to it meanwhile);
* a replica held back (SIGSTOP, its link filled) so that writes the master acknowledged are
  really lost when the master is killed and the replica promoted: the stored cursors and an
  L3 rewrite go back in time, and the writers must notice and re-sync.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from common import keys
from common.config import Duration, RedisSentinel
from common.config import Redis as RedisConfig
from common.redis_client import connect
from tests.conftest import require, wait_for
from tests.fake_master import FakeMaster
from tests.integration.fleet import Fleet, Publishing, converge, start_stack
from tests.redis_nodes import SENTINEL_MASTER, SentinelSet
from tests.store_oracle import OracleStore

IPS = ["127.0.0.31", "127.0.0.32"]
"""A busy pod and a quiet one."""
BUSY, QUIET = IPS
CONVERGE = 90.0
"""Seconds allowed to converge (generous: CI machines are slow and shared)."""


def redis_section(s: SentinelSet) -> dict[str, Any]:
    return {"sentinel": {"addresses": s.addresses, "masterName": SENTINEL_MASTER}}


@pytest.fixture()
def sentinels() -> Iterator[SentinelSet]:
    require(shutil.which("redis-sentinel"), "redis-sentinel (scripts/setup.sh installs it)")
    s = SentinelSet().start()
    yield s
    s.cleanup()


@pytest.fixture()
def fleet() -> Iterator[Fleet]:
    master = FakeMaster("0.3.13").start()
    f = Fleet(IPS, master)
    yield f
    f.close()
    master.stop()


def sentinel_store(s: SentinelSet) -> OracleStore:
    cfg = RedisConfig(
        sentinel=RedisSentinel(addresses=s.addresses, master_name=SENTINEL_MASTER),
        socket_timeout=Duration(1),
        connect_timeout=Duration(1),
    )
    return OracleStore(connect(cfg, retries=3))


def fill_replication_link(client: redis.Redis, mb: int = 48) -> None:
    """Write ``mb`` MiB the stopped replica cannot read: the kernel's socket buffers fill and
    what the master acknowledges next waits in its output buffer, lost with the master."""
    chunk = b"x" * (8 << 20)
    for i in range(mb // 8):
        client.set(f"test-filler-{i}", chunk)  # not an index key: no process reads it


def readyz(api: int) -> dict[str, Any]:
    body: dict[str, Any] = httpx.get(f"http://127.0.0.1:{api}/readyz", timeout=2).json()
    return body


def run_kill_master_while_publishing(
    s: SentinelSet, fleet: Fleet, tmp_path: Path, procs: list[Any], env: dict[str, str]
) -> dict[str, float]:
    """The first scenario; returns the seconds each phase took to converge."""
    store = sentinel_store(s)
    api = start_stack(tmp_path, procs, env, redis_section(s), fleet, store)
    fleet.serve(seed=100, steps=10)
    fleet.put_l3()
    times = {"start": converge(api, fleet, store, CONVERGE, "before the failover")}
    old = s.nodes[0].port
    assert readyz(api)["redis"] == f"master at 127.0.0.1:{old}"
    with Publishing(fleet, seed=200, only=[BUSY]):
        wait_for(lambda: len(fleet.served[BUSY]) >= len(fleet.served[QUIET]) + 6, timeout=10)
        killed = time.monotonic()
        s.kill(old)
        new = s.wait_failover(old)
        times["promotion after kill -9"] = time.monotonic() - killed
    times["kill -9 master"] = converge(api, fleet, store, CONVERGE, "after kill -9 of the master")
    wait_for(
        lambda: readyz(api).get("redis") == f"master at 127.0.0.1:{new}",
        timeout=30,
        what="the API's readiness to name the new master",
    )
    s.node(old).start()  # back empty, on its port, as a master until Sentinel demotes it
    with Publishing(fleet, seed=300, only=[BUSY]):
        s.wait_stable(new)
    fleet.put_l3(nth=1)
    times["old master back empty"] = converge(
        api, fleet, store, CONVERGE, "after the old master came back empty"
    )
    return times


def run_lost_writes(
    s: SentinelSet, fleet: Fleet, tmp_path: Path, procs: list[Any], env: dict[str, str]
) -> dict[str, float]:
    """The second scenario; returns the seconds each phase took to converge."""
    store = sentinel_store(s)
    api = start_stack(tmp_path, procs, env, redis_section(s), fleet, store)
    fleet.serve(seed=100, steps=10)
    fleet.put_l3()
    times = {"start": converge(api, fleet, store, CONVERGE, "before the failover")}
    master, replica = s.nodes[0], s.nodes[1]
    assert master.proc is not None and replica.proc is not None
    replica.proc.send_signal(signal.SIGSTOP)
    try:
        fill_replication_link(redis.Redis(port=master.port))
        fleet.serve(seed=400, steps=6)  # busy and quiet alike: both cursors move
        fleet.put_l3(nth=1)  # and every L3 set is rewritten
        converge(api, fleet, store, CONVERGE, "the writes the master acknowledged")
        s.kill(master.port)
    finally:
        replica.proc.send_signal(signal.SIGCONT)
    resumed = time.monotonic()
    lost = _lost_cursors(replica.port, fleet)
    assert lost, "the replica had every write: nothing was lost, the test proves nothing"
    s.wait_failover(master.port)
    times["promotion after the replica resumed"] = time.monotonic() - resumed
    with Publishing(fleet, seed=500, only=[BUSY]):
        wait_for(lambda: len(fleet.served[BUSY]) >= len(fleet.served[QUIET]) + 6, timeout=10)
    times["acknowledged writes lost"] = converge(
        api, fleet, store, CONVERGE, f"after a failover that lost {lost}"
    )
    return times


def _lost_cursors(port: int, fleet: Fleet) -> dict[str, tuple[int, int]]:
    """On the resumed replica, once its link to the dead master is down: the instances whose
    stored seq is behind what their publisher sent (ip → (stored, sent))."""
    client = redis.Redis(port=port, socket_timeout=2)
    wait_for(
        lambda: client.info("replication").get("master_link_status") == "down",
        timeout=20,
        what="the replica to see its master gone",
    )
    lost = {}
    for ip, sim in fleet.sims.items():
        stored = int(client.hget(keys.l1_state(ip), "seq:0") or -1)
        if stored < sim.last_seq(0):
            lost[ip] = (stored, sim.last_seq(0))
    return lost


def test_kill_master_while_publishing_then_the_old_master_back_empty(
    sentinels: SentinelSet,
    fleet: Fleet,
    tmp_path: Path,
    subprocess_env: dict[str, str],
    procs: list[subprocess.Popen[bytes]],
) -> None:
    run_kill_master_while_publishing(sentinels, fleet, tmp_path, procs, subprocess_env)
    for p in procs:
        assert p.poll() is None, f"{p.args} exited"


def test_a_failover_that_loses_acknowledged_writes_is_healed(
    sentinels: SentinelSet,
    fleet: Fleet,
    tmp_path: Path,
    subprocess_env: dict[str, str],
    procs: list[subprocess.Popen[bytes]],
) -> None:
    run_lost_writes(sentinels, fleet, tmp_path, procs, subprocess_env)
    for p in procs:
        assert p.poll() is None, f"{p.args} exited"
