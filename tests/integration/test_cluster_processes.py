"""Every process on a real 3-master Redis Cluster (``redis.cluster: true``), over HTTP.

discovery (static mode) registers three simulated vLLM pods whose keys hash to the three
masters and a Mooncake master (the in-memory fake); ``l1-ingest`` (lease mode) indexes
their KV events, ``l3-poll`` their Mooncake blocks, and the API under gunicorn answers. The
API's L1 ratios must equal each simulator's true cached prefix and the L3 ratios what the
master holds — before and after one master is restarted (it comes back empty: discovery
re-registers its instances under new generations, the ingester re-syncs them from the
replay buffers, the poller rewrites their L3 sets).
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis
from redis.crc import key_slot

from common.config import Redis as RedisConfig
from common.redis_client import connect
from tests.conftest import reserve_port, wait_for
from tests.fake_master import FakeMaster
from tests.integration.fleet import PROCESSES, Fleet, answers_match, spawn, write_config
from tests.redis_nodes import Cluster
from tests.store_oracle import OracleStore


def _ips_on_every_master() -> list[str]:
    """One pod IP per third of the slot space (redis-cli gives 3 masters one third each)."""
    chosen: dict[int, str] = {}
    for last in range(70, 250):
        ip = f"127.0.0.{last}"
        chosen.setdefault(key_slot(ip.encode()) * 3 // 16384, ip)
    return [chosen[i] for i in range(3)]


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    c = Cluster(3).start()
    yield c
    c.cleanup()


def _status_synced(api: int, ips: list[str]) -> bool:
    """The API's status view on the cluster: 200, every instance ``synced``, and the same in
    the per-instance state gauge."""
    doc = httpx.get(f"http://127.0.0.1:{api}/kv-cache/instances", timeout=5)
    if doc.status_code != 200:
        return False
    states = {i["server_ip"]: i["l1"]["state"] for i in doc.json()["instances"]}
    metrics = httpx.get(f"http://127.0.0.1:{api}/metrics", timeout=5).text
    return states == dict.fromkeys(ips, "synced") and all(
        f'cache_indexer_instance_l1_state{{server_ip="{ip}",state="synced"}} 1.0' in metrics
        for ip in ips
    )


def test_every_process_on_a_cluster_survives_a_node_restart(
    cluster: Cluster,
    tmp_path: Path,
    subprocess_env: dict[str, str],
    procs: list[subprocess.Popen[bytes]],
) -> None:
    ips = _ips_on_every_master()
    master = FakeMaster("0.3.13").start()
    fleet = Fleet(ips, master)
    api = reserve_port()
    client = connect(RedisConfig(url=cluster.url, cluster=True), retries=3)
    client.flushall()
    store = OracleStore(client)
    try:
        config = tmp_path / "config.yaml"
        redis_section = {"url": cluster.nodes[1].url, "cluster": True}
        write_config(config, redis_section, api, fleet.ports, master)
        for name in PROCESSES:
            spawn(procs, subprocess_env, tmp_path / f"{name}.log", name, "--config", str(config))
        wait_for(lambda: store.instance_ips() == set(ips), timeout=30, what="registration")
        wait_for(
            lambda: httpx.get(f"http://127.0.0.1:{api}/readyz", timeout=1).status_code == 200,
            timeout=30,
            what="the API to be ready",
        )
        fleet.serve(seed=100)
        fleet.put_l3()
        wait_for(
            lambda: answers_match(api, fleet, store),
            timeout=60,
            what="API answers = simulators' caches and master's blocks",
        )
        assert any(fleet.l3.values()) and all(store.tier_members(ip) for ip in ips)
        wait_for(
            lambda: _status_synced(api, ips),
            timeout=30,
            what="/kv-cache/instances and /metrics: every instance synced (its ingester's "
            "status written on the cluster)",
        )

        victim = next(
            i for i, n in enumerate(cluster.nodes) if n.port != cluster.nodes[1].port
        )  # not the node in redis.url
        gens = {ip: store.get_instance(ip).gen for ip in ips}  # type: ignore[union-attr]
        cluster.restart(victim)
        fleet.serve(seed=200, steps=5)
        wait_for(
            lambda: answers_match(api, fleet, store),
            timeout=90,
            what="the same answers after a master restarted empty",
        )
        regs = {ip: store.get_instance(ip) for ip in ips}
        assert any(r is not None and r.gen > gens[ip] for ip, r in regs.items()), (
            "the restarted master's instances were re-registered under new generations"
        )
        for p in procs:
            assert p.poll() is None, f"{p.args} exited"
    finally:
        fleet.close()
        master.stop()
        try:
            client.close()
        except redis.RedisError:
            pass
