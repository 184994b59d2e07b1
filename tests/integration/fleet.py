"""Every cache-indexer process against simulated vLLM pods and a fake Mooncake master, for the
tests that break Redis under a running stack (tests/integration/test_cluster_processes.py,
test_failover_*.py) and scripts/bench_failover.py.

:class:`Fleet` holds the simulated pods (each on its own loopback address), what each served
and the blocks each put into Mooncake: the publishers' truth. :func:`mismatches` compares
every probe of every instance with it through the API.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from common.blockhash import BlockHasher, HashSettings
from services.simulator.cache_model import Request
from services.simulator.engine import SimulatedVLLM
from services.simulator.workload import Workload
from tests.conftest import ROOT, reserve_port, wait_for
from tests.fake_master import FakeMaster
from tests.store_oracle import OracleStore

BLOCK = 16
MODEL = "Qwen2.5-0.5B-Instruct"
PROCESSES = ("discovery", "l1-ingest", "l3-poll", "api")


def spawn(procs: list[subprocess.Popen[bytes]], env: dict[str, str], log: Path, *args: str) -> None:
    """Start ``cache-indexer <args>`` (this tree's code), output appended to ``log``."""
    out = open(log, "ab")  # noqa: SIM115 - handed to the child
    procs.append(
        subprocess.Popen(
            [sys.executable, "-m", "services.cli", *args], cwd=ROOT, env=env, stdout=out, stderr=out
        )
    )


def write_config(
    path: Path,
    redis: dict[str, Any],
    api: int,
    pods: dict[str, tuple[int, int]],
    master: FakeMaster,
) -> None:
    """A config for every process: ``redis`` as given, static discovery of ``pods`` (ip →
    (publisher port, replay port)) and ``master``, short leases and intervals."""
    path.write_text(
        yaml.safe_dump(
            {
                "redis": {"socketTimeout": "1s", "connectTimeout": "1s", **redis},
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

    def serve(self, seed: int, steps: int = 15, only: list[str] | None = None) -> None:
        """``steps`` engine steps of two requests on every pod (or the pods in ``only``);
        a small cache (96 blocks) makes them evict."""
        for i, (ip, sim) in enumerate(self.sims.items()):
            if only is not None and ip not in only:
                continue
            workload = Workload(
                "mixed", prompts=12, prompt_len=128, block_size=BLOCK, seed=seed + i
            )
            for _ in range(steps):
                batch = [workload.next() for _ in range(2)]
                sim.serve(batch)
                self.served[ip] += batch

    def put_l3(self, nth: int = 0) -> None:
        """Each pod puts the first half of one of its long prompts into Mooncake (``nth``
        longest: a later call moves every instance's L3 content)."""
        for ip in self.sims:
            by_length = sorted(set(self.served[ip]), key=lambda r: (-len(r.token_ids), r.token_ids))
            request = by_length[nth % len(by_length)]
            segment = self.master.mount(f"{ip}:12300", f"{ip}:15000")
            digests = self.hasher.digests(list(request.token_ids), BLOCK)
            for d in digests[: len(digests) // 2]:
                self.master.put(f"{MODEL}@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@{d.hex()}", segment)
            self.l3[ip] = request

    def close(self) -> None:
        for sim in self.sims.values():
            sim.close()


def mismatches(api: int, fleet: Fleet, store: OracleStore, limit: int = 5) -> list[str]:
    """What differs from the publishers' truth (empty: every probe of every instance equals
    it): each rank's stored sequence, then every served prompt's L1 and L3 ratio as the API
    answers them. ``store`` must reach the current master."""
    wrong: list[str] = []
    for ip, sim in fleet.sims.items():
        sim.flush()
        for r in sim.ranks:
            if store.last_seq(ip, r) != sim.last_seq(r):
                wrong.append(f"{ip} rank {r}: seq {store.last_seq(ip, r)} != {sim.last_seq(r)}")
    if wrong:
        return wrong
    url = f"http://127.0.0.1:{api}/kv-cache/hit-rate"
    ips = list(fleet.sims)
    with httpx.Client(timeout=5) as client:
        for requests in fleet.served.values():
            for request in dict.fromkeys(requests):
                wrong += _probe(client, url, ips, fleet, request)
                if len(wrong) >= limit:
                    return wrong
    return wrong


def _probe(
    client: httpx.Client, url: str, ips: list[str], fleet: Fleet, request: Request
) -> list[str]:
    n = len(request.token_ids) // BLOCK
    if n == 0:
        return []
    body = {
        "server_ip": ips,
        "body": {
            "token_ids": list(request.token_ids),
            "block_size": BLOCK,
            "cache_salt": request.cache_salt or "",
        },
    }
    response = client.post(url, json=body)
    if response.status_code != 200:
        return [f"HTTP {response.status_code}: {response.text[:200]}"]
    scores = response.json()["server_score_list"]
    if len(scores) != len(ips):
        return [f"{len(scores)} scores for {len(ips)} instances"]
    wrong = []
    for ip, score in zip(ips, scores):
        l1 = fleet.sims[ip].true_prefix_len(request) / n
        if score["l1_hit_ratio"] != l1:
            wrong.append(f"{ip} L1 {score['l1_hit_ratio']} != {l1}")
        l3 = (n // 2) / n if fleet.l3.get(ip) == request else None
        if l3 is not None and score["l3_hit_ratio"] != l3:
            wrong.append(f"{ip} L3 {score['l3_hit_ratio']} != {l3}")
    return wrong


def answers_match(api: int, fleet: Fleet, store: OracleStore) -> bool:
    """Every probe of every instance equals the publishers' truth (see :func:`mismatches`)."""
    return not mismatches(api, fleet, store, limit=1)


def start_stack(
    tmp_path: Path,
    procs: list[subprocess.Popen[bytes]],
    env: dict[str, str],
    redis: dict[str, Any],
    fleet: Fleet,
    store: OracleStore,
) -> int:
    """Every process on ``redis`` for ``fleet``; returns the API's port once it is ready and
    every pod is registered."""
    api = reserve_port()
    config = tmp_path / "config.yaml"
    write_config(config, redis, api, fleet.ports, fleet.master)
    for name in PROCESSES:
        spawn(procs, env, tmp_path / f"{name}.log", name, "--config", str(config))
    wait_for(lambda: store.instance_ips() == set(fleet.sims), timeout=30, what="registration")
    wait_for(
        lambda: httpx.get(f"http://127.0.0.1:{api}/readyz", timeout=1).status_code == 200,
        timeout=30,
        what="the API to be ready",
    )
    return api


def converge(api: int, fleet: Fleet, store: OracleStore, timeout: float, what: str) -> float:
    """Poll until every probe of every instance equals the truth; the seconds it took (for
    scripts/bench_failover.py to print: tests never assert a time). Fails after ``timeout``
    naming what still differs."""
    start = time.monotonic()
    wrong: list[str] = []
    while time.monotonic() - start < timeout:
        try:
            wrong = mismatches(api, fleet, store)
        except Exception as exc:  # noqa: BLE001 - Redis or the API may be failing over
            wrong = [repr(exc)]
        if not wrong:
            return time.monotonic() - start
        time.sleep(0.1)
    raise AssertionError(f"{what}: not converged after {timeout}s: {wrong}")


class Publishing:
    """Serve on every pod (or ``only``) from a thread until the ``with`` block ends: the
    publishers keep running while the test breaks Redis."""

    def __init__(self, fleet: Fleet, seed: int, only: list[str] | None = None) -> None:
        self.fleet, self.seed, self.only = fleet, seed, only
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        ips = [ip for ip in self.fleet.sims if self.only is None or ip in self.only]
        workloads = {
            ip: Workload("mixed", prompts=12, prompt_len=128, block_size=BLOCK, seed=self.seed + i)
            for i, ip in enumerate(ips)
        }
        while not self._stop.is_set():
            for ip, workload in workloads.items():
                batch = [workload.next() for _ in range(2)]
                self.fleet.sims[ip].serve(batch)
                self.fleet.served[ip] += batch
            self._stop.wait(0.1)

    def __enter__(self) -> Publishing:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)
