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
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis
import yaml
from redis.crc import key_slot

from common.blockhash import BlockHasher, HashSettings
from common.config import Redis as RedisConfig
from common.redis_client import connect
from common.store import Store
from services.simulator.cache_model import Request
from services.simulator.engine import SimulatedVLLM
from services.simulator.workload import Workload
from tests.conftest import ROOT, reserve_port, wait_for
from tests.fake_master import FakeMaster
from tests.redis_nodes import Cluster
from tests.store_oracle import OracleStore

BLOCK = 16
MODEL = "Qwen2.5-0.5B-Instruct"


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


def _spawn(
    procs: list[subprocess.Popen[bytes]], env: dict[str, str], log: Path, *args: str
) -> None:
    out = open(log, "ab")  # noqa: SIM115 - handed to the child
    procs.append(
        subprocess.Popen(
            [sys.executable, "-m", "services.cli", *args], cwd=ROOT, env=env, stdout=out, stderr=out
        )
    )


def _write_config(
    path: Path, cluster: Cluster, api: int, pods: dict[str, tuple[int, int]], master: FakeMaster
) -> None:
    path.write_text(
        yaml.safe_dump(
            {
                "redis": {
                    "url": cluster.nodes[1].url,
                    "cluster": True,
                    "socketTimeout": "1s",
                    "connectTimeout": "1s",
                },
                "http": {"addr": f"127.0.0.1:{api}", "workers": 2},
                "discovery": {
                    "mode": "static",
                    "leaseTTL": "3s",
                    "static": {
                        "vllm": [
                            {
                                "ip": ip,
                                "zmqEndpoint": f"tcp://{ip}:{pub}",
                                "replayEndpoint": f"tcp://{ip}:{replay}",
                            }
                            for ip, (pub, replay) in pods.items()
                        ],
                        "mooncakeMasters": [{"url": master.url}],
                    },
                },
                "ingest": {
                    "l1": {
                        "topic": "kv-events",
                        "backoffInitial": "100ms",
                        "backoffMax": "1s",
                        "leaseTTL": "2s",
                        "heartbeatInterval": "500ms",
                    },
                    "l3": {"pollInterval": "200ms", "httpTimeout": "1s"},
                },
            }
        ),
        encoding="utf-8",
    )


class Fleet:
    """The simulated pods, what each served, and the blocks each put into Mooncake."""

    def __init__(self, ips: list[str], master: FakeMaster) -> None:
        self.ports = {ip: (reserve_port(), reserve_port()) for ip in ips}
        self.sims = {
            ip: SimulatedVLLM(
                f"tcp://*:{pub}",
                f"tcp://*:{rep}",
                "kv-events",
                block_size=BLOCK,
                num_blocks=96,
                bind_host=ip,
            )
            for ip, (pub, rep) in self.ports.items()
        }
        self.served: dict[str, list[Request]] = {ip: [] for ip in ips}
        self.master = master
        self.l3: dict[str, Request] = {}
        self.hasher = BlockHasher(HashSettings())

    def serve(self, seed: int, steps: int = 15) -> None:
        for i, (ip, sim) in enumerate(self.sims.items()):
            workload = Workload(
                "mixed", prompts=12, prompt_len=128, block_size=BLOCK, seed=seed + i
            )
            for _ in range(steps):
                batch = [workload.next() for _ in range(2)]
                sim.serve(batch)
                self.served[ip] += batch

    def put_l3(self) -> None:
        """Each pod puts the first half of one of its long prompts into Mooncake."""
        for ip in self.sims:
            request = max(self.served[ip], key=lambda r: len(r.token_ids))
            segment = self.master.mount(f"{ip}:12300", f"{ip}:15000")
            digests = self.hasher.digests(list(request.token_ids), BLOCK)
            for d in digests[: len(digests) // 2]:
                self.master.put(f"{MODEL}@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@{d.hex()}", segment)
            self.l3[ip] = request

    def close(self) -> None:
        for sim in self.sims.values():
            sim.close()


def _answers_match(api: int, fleet: Fleet, store: Store) -> bool:
    """Every served prompt's API ratios equal the simulators' truth and the master's."""
    for ip, sim in fleet.sims.items():
        sim.flush()
        if any(store.last_seq(ip, r) != sim.last_seq(r) for r in sim.ranks):
            return False
    url = f"http://127.0.0.1:{api}/kv-cache/hit-rate"
    ips = list(fleet.sims)
    with httpx.Client(timeout=5) as client:
        for requests in fleet.served.values():
            for request in dict.fromkeys(requests):
                n = len(request.token_ids) // BLOCK
                if n == 0:
                    continue
                body = {
                    "server_ip": ips,
                    "body": {
                        "token_ids": list(request.token_ids),
                        "block_size": BLOCK,
                        "cache_salt": request.cache_salt or "",
                    },
                }
                response = client.post(url, json=body)
                scores = response.json()["server_score_list"]
                if response.status_code != 200 or len(scores) != len(ips):
                    return False
                for ip, score in zip(ips, scores):
                    l3 = (n // 2) / n if fleet.l3.get(ip) == request else None
                    if score["l1_hit_ratio"] != fleet.sims[ip].true_prefix_len(request) / n:
                        return False
                    if l3 is not None and score["l3_hit_ratio"] != l3:
                        return False
    return True


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
        _write_config(config, cluster, api, fleet.ports, master)
        for name in ("discovery", "l1-ingest", "l3-poll", "api"):
            _spawn(procs, subprocess_env, tmp_path / f"{name}.log", name, "--config", str(config))
        wait_for(lambda: store.instance_ips() == set(ips), timeout=30, what="registration")
        wait_for(
            lambda: httpx.get(f"http://127.0.0.1:{api}/readyz", timeout=1).status_code == 200,
            timeout=30,
            what="the API to be ready",
        )
        fleet.serve(seed=100)
        fleet.put_l3()
        wait_for(
            lambda: _answers_match(api, fleet, store),
            timeout=60,
            what="API answers = simulators' caches and master's blocks",
        )
        assert any(fleet.l3.values()) and all(store.tier_members(ip) for ip in ips)

        victim = next(
            i for i, n in enumerate(cluster.nodes) if n.port != cluster.nodes[1].port
        )  # not the node in redis.url
        gens = {ip: store.get_instance(ip).gen for ip in ips}  # type: ignore[union-attr]
        cluster.restart(victim)
        fleet.serve(seed=200, steps=5)
        wait_for(
            lambda: _answers_match(api, fleet, store),
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
