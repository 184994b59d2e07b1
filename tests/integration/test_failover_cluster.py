"""Every process on a Redis Cluster with replicas (3 masters, 3 replicas, loopback) while a
master is killed (kill -9, a pod publishing meanwhile) with its replica behind: writes the
master acknowledged are really lost when the replica takes over. A busy pod and a quiet
one, both kept by that master, must come back to the publishers' truth in every probe
(tests/integration/fleet.py); then the old master comes back empty (it rejoins as a
replica). The convergence times are printed by scripts/bench_failover.py, not asserted here.
"""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from redis.crc import key_slot

from common import keys
from common.config import Duration
from common.config import Redis as RedisConfig
from common.redis_client import connect
from tests.conftest import Node, wait_for
from tests.fake_master import FakeMaster
from tests.integration.fleet import Fleet, Publishing, converge, start_stack
from tests.redis_nodes import Cluster
from tests.store_oracle import OracleStore

CONVERGE = 90.0
CLUSTER_ARGS = ["--cluster-replica-validity-factor", "0"]
"""A replica held back for as long as a slow machine needs is still allowed to take over (the
default refuses one whose data is older than 10 node timeouts: the cluster would stay down)."""


@pytest.fixture()
def cluster() -> Iterator[Cluster]:
    c = Cluster(6, replicas=1, extra=CLUSTER_ARGS).start()
    yield c
    c.cleanup()


def _slots_of(client: redis.Redis) -> list[tuple[int, int, int, int]]:
    """(first slot, last slot, master port, replica port) per slot range."""
    out = []
    for first, last, master, *replicas in client.execute_command("CLUSTER SLOTS"):
        if not replicas:
            return []  # a replica not attached yet
        out.append((int(first), int(last), int(master[1]), int(replicas[0][1])))
    return out


def pick(cluster: Cluster) -> tuple[list[str], int, int]:
    """Two pod IPs kept by the same master, that master's port and its replica's."""
    client = redis.Redis(port=cluster.nodes[0].port)
    ranges = wait_for(lambda: _slots_of(client), timeout=30, what="every master's replica")
    first, last, master, replica = ranges[0]
    wait_for(
        lambda: redis.Redis(port=replica).info("replication")["master_link_status"] == "up",
        timeout=30,
        what="the replica's link up",
    )
    ips = [
        ip
        for ip in (f"127.0.0.{n}" for n in range(40, 250))
        if first <= key_slot(ip.encode()) <= last
    ][:2]
    return ips, master, replica


def node(cluster: Cluster, port: int) -> Node:
    return next(n for n in cluster.nodes if n.port == port)


def fill_link(port: int, tag: str, mb: int = 48) -> None:
    """``mb`` MiB on the master, in its slots (hash tag ``tag``), that the stopped replica
    cannot read: what the master acknowledges next is lost with it."""
    client = redis.Redis(port=port)
    chunk = b"x" * (8 << 20)
    for i in range(mb // 8):
        client.set(f"test-filler-{{{tag}}}-{i}", chunk)  # not an index key


def lost_cursors(port: int, fleet: Fleet) -> dict[str, tuple[int, int]]:
    """On the resumed replica once its master link is down: ip → (stored seq, sent seq)
    for the instances it holds behind their publisher."""
    client = redis.Redis(port=port, socket_timeout=2)
    client.execute_command("READONLY")  # a cluster replica answers reads only after this
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


def run_cluster_lost_writes(
    cluster: Cluster, tmp_path: Path, procs: list[Any], env: dict[str, str]
) -> dict[str, float]:
    """The scenario; returns the seconds each phase took to converge."""
    ips, master_port, replica_port = pick(cluster)
    busy, quiet = ips
    url = next(n.url for n in cluster.nodes if n.port not in (master_port, replica_port))
    cfg = RedisConfig(url=url, cluster=True, socket_timeout=Duration(1))
    store = OracleStore(connect(cfg, retries=3))
    mooncake = FakeMaster("0.3.13").start()
    fleet = Fleet(ips, mooncake)
    try:
        redis_section = {"url": url, "cluster": True}
        api = start_stack(tmp_path, procs, env, redis_section, fleet, store)
        fleet.serve(seed=100, steps=10)
        fleet.put_l3()
        times = {"start": converge(api, fleet, store, CONVERGE, "before the failover")}
        master, replica = node(cluster, master_port), node(cluster, replica_port)
        assert master.proc is not None and replica.proc is not None
        replica.proc.send_signal(signal.SIGSTOP)
        try:
            fill_link(master_port, busy)
            fleet.serve(seed=400, steps=6)
            fleet.put_l3(nth=1)
            converge(api, fleet, store, CONVERGE, "the writes the master acknowledged")
            with Publishing(fleet, seed=500, only=[busy]):  # kill -9 while it publishes
                sent = len(fleet.served[busy])
                wait_for(lambda: len(fleet.served[busy]) >= sent + 6, timeout=10)
                master.proc.kill()
                master.proc.wait()
                master.proc = None
                replica.proc.send_signal(signal.SIGCONT)
                resumed = time.monotonic()
                lost = lost_cursors(replica_port, fleet)
                wait_for(
                    lambda: redis.Redis(port=replica_port).role()[0] == b"master",
                    timeout=60,
                    what="the replica to take over its master's slots",
                )
                times["promotion after the replica resumed"] = time.monotonic() - resumed
        finally:
            replica.proc.send_signal(signal.SIGCONT)
        assert lost, "the replica had every write: nothing was lost, the test proves nothing"
        times["acknowledged writes lost"] = converge(
            api, fleet, store, CONVERGE, f"after a failover that lost {lost}"
        )
        master.start()  # back empty; nodes.conf makes it a replica of its successor
        cluster.wait_ok()
        fleet.serve(seed=600, steps=4, only=[busy])
        times["old master back empty"] = converge(
            api, fleet, store, CONVERGE, "after the old master came back empty"
        )
        assert redis.Redis(port=master_port).role()[0] == b"slave"
        assert quiet in lost or busy in lost
        return times
    finally:
        fleet.close()
        mooncake.stop()


def test_a_cluster_failover_that_loses_acknowledged_writes_is_healed(
    cluster: Cluster,
    tmp_path: Path,
    subprocess_env: dict[str, str],
    procs: list[subprocess.Popen[bytes]],
) -> None:
    run_cluster_lost_writes(cluster, tmp_path, procs, subprocess_env)
    for p in procs:
        assert p.poll() is None, f"{p.args} exited"
