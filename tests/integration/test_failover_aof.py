"""Every process on one redis-server with ``appendonly yes`` / ``appendfsync everysec`` that
crashes: what was acknowledged but not yet fsynced (up to a second of writes) is lost.

kill -9 of the process alone loses nothing (the appended bytes are in the page cache); the
machine crashing loses the unsynced tail of the file. The test does that part by hand: the
append-only file is cut back to its length of a moment before the last writes, then the
server restarts from it. A busy pod and a quiet one must come back to the publishers'
truth in every probe (tests/integration/fleet.py); scripts/bench_failover.py prints the time.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from common import keys
from common.config import Duration
from common.config import Redis as RedisConfig
from common.redis_client import connect
from tests.conftest import Node
from tests.fake_master import FakeMaster
from tests.integration.fleet import Fleet, converge, start_stack
from tests.store_oracle import OracleStore

IPS = ["127.0.0.51", "127.0.0.52"]
BUSY, QUIET = IPS
CONVERGE = 90.0
AOF = ["--appendonly", "yes", "--appendfsync", "everysec", "--aof-use-rdb-preamble", "no"]


@pytest.fixture()
def aof_redis() -> Iterator[Node]:
    node = Node("redis-server", AOF).start()
    yield node
    node.cleanup()


def _incr_file(node: Node) -> Path:
    """Redis 7's multi-part AOF: the file commands are appended to now."""
    (path,) = (Path(node.dir) / "appendonlydir").glob("*.incr.aof")
    return path


def _stored_seqs(node: Node, fleet: Fleet) -> dict[str, int]:
    """What a server started from ``node``'s files (on another port) holds: ip → seq:0."""
    probe = Node("redis-server", AOF, workdir=node.dir).start()
    try:
        client = redis.Redis(port=probe.port)
        return {ip: int(client.hget(keys.l1_state(ip), "seq:0") or -1) for ip in fleet.sims}
    finally:
        probe.stop()


def run_aof_crash(
    node: Node, tmp_path: Path, procs: list[Any], env: dict[str, str]
) -> dict[str, float]:
    """The scenario; returns the seconds each phase took to converge."""
    cfg = RedisConfig(url=node.url, socket_timeout=Duration(1))
    store = OracleStore(connect(cfg, retries=3))
    mooncake = FakeMaster("0.3.13").start()
    fleet = Fleet(IPS, mooncake)
    try:
        api = start_stack(tmp_path, procs, env, {"url": node.url}, fleet, store)
        fleet.serve(seed=100, steps=10)
        fleet.put_l3()
        times = {"start": converge(api, fleet, store, CONVERGE, "before the crash")}
        synced = _incr_file(node).stat().st_size  # "fsynced up to here"
        fleet.serve(seed=400, steps=6)
        fleet.put_l3(nth=1)
        converge(api, fleet, store, CONVERGE, "the writes Redis acknowledged")
        assert node.proc is not None
        node.proc.kill()
        node.proc.wait()
        node.proc = None
        os.truncate(_incr_file(node), synced)  # the crash: the unsynced tail is gone
        stored = _stored_seqs(node, fleet)
        lost = {ip: s for ip, s in stored.items() if s < fleet.sims[ip].last_seq(0)}
        assert lost, f"nothing lost ({stored}): the test proves nothing"
        node.start()
        fleet.serve(seed=500, steps=4, only=[BUSY])
        times["AOF everysec crash"] = converge(
            api, fleet, store, CONVERGE, f"after a crash that lost the cursors {lost}"
        )
        return times
    finally:
        fleet.close()
        mooncake.stop()


def test_a_crash_that_loses_the_unsynced_aof_tail_is_healed(
    aof_redis: Node,
    tmp_path: Path,
    subprocess_env: dict[str, str],
    procs: list[subprocess.Popen[bytes]],
) -> None:
    run_aof_crash(aof_redis, tmp_path, procs, subprocess_env)
    for p in procs:
        assert p.poll() is None, f"{p.args} exited"
