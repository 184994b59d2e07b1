"""The whole L1 path with real processes, checked where routers look: over HTTP.

discovery (static mode) registers a simulated vLLM pod, an ``l1-ingest`` process indexes its
KV events, and the hit-rate API under gunicorn answers; for every prompt the simulator
served, the API's ``l1_hit_ratio`` must equal the simulator's true cached prefix / n.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import redis
import yaml

from services.simulator.engine import SimulatedVLLM
from services.simulator.workload import Workload
from tests.conftest import ROOT, RedisServer, reserve_port, wait_for
from tests.integration.l1_support import wait_quiet
from tests.store_oracle import OracleStore

IP = "127.0.0.61"
BLOCK = 16


def _spawn(
    procs: list[subprocess.Popen[bytes]], env: dict[str, str], log: Path, *args: str
) -> None:
    out = open(log, "ab")  # noqa: SIM115 - handed to the child
    procs.append(
        subprocess.Popen(
            [sys.executable, "-m", "services.cli", *args], cwd=ROOT, env=env, stdout=out, stderr=out
        )
    )


def test_api_l1_ratios_equal_the_simulated_cache(
    redis_server: RedisServer,
    redis_client: redis.Redis,
    tmp_path: Path,
    subprocess_env: dict[str, str],
    procs: list[subprocess.Popen[bytes]],
) -> None:
    pub, replay, api = reserve_port(), reserve_port(), reserve_port()
    sim = SimulatedVLLM(
        f"tcp://*:{pub}",
        f"tcp://*:{replay}",
        "kv-events",
        vllm_version="0.28.0",
        block_size=BLOCK,
        num_blocks=128,
        bind_host=IP,
    )
    try:
        config = tmp_path / "config.yaml"
        config.write_text(
            yaml.safe_dump(
                {
                    "redis": {"url": redis_server.url},
                    "http": {"addr": f"127.0.0.1:{api}", "workers": 2},
                    "discovery": {
                        "mode": "static",
                        "static": {
                            "vllm": [
                                {
                                    "ip": IP,
                                    "zmqEndpoint": f"tcp://{IP}:{pub}",
                                    "replayEndpoint": f"tcp://{IP}:{replay}",
                                }
                            ]
                        },
                    },
                    "ingest": {
                        "l1": {
                            "topic": "kv-events",
                            "backoffInitial": "100ms",
                            "backoffMax": "1s",
                            "leaseTTL": "2s",
                            "heartbeatInterval": "500ms",
                        }
                    },
                }
            ),
            encoding="utf-8",
        )
        for name in ("discovery", "l1-ingest", "api"):
            _spawn(procs, subprocess_env, tmp_path / f"{name}.log", name, "--config", str(config))
        store = OracleStore(redis_client)
        wait_for(lambda: store.get_instance(IP), timeout=20, what="discovery to register")
        wait_for(
            lambda: httpx.get(f"http://127.0.0.1:{api}/readyz", timeout=1).status_code == 200,
            timeout=30,
            what="the API to be ready",
        )

        workload = Workload("mixed", prompts=20, prompt_len=128, block_size=BLOCK, seed=11)
        served = []
        for _ in range(40):  # evictions happen: 128 blocks for prompts of up to 8 blocks
            batch = [workload.next() for _ in range(3)]
            sim.serve(batch)
            served += batch
        wait_quiet(store, IP, sim, timeout=20)

        url = f"http://127.0.0.1:{api}/kv-cache/hit-rate"
        checked, hits = 0, 0
        with httpx.Client(timeout=10) as client:
            for request in dict.fromkeys(served):
                n = len(request.token_ids) // BLOCK
                body = {
                    "server_ip": [IP, "127.0.0.99"],
                    "body": {
                        "token_ids": list(request.token_ids),
                        "block_size": BLOCK,
                        "cache_salt": request.cache_salt or "",
                    },
                }
                doc = client.post(url, json=body).json()
                want = sim.true_prefix_len(request) / n if n else 0.0
                got = doc["server_score_list"]
                assert got[0] == {"server_ip": IP, "l1_hit_ratio": want, "l3_hit_ratio": 0.0}
                assert got[1]["l1_hit_ratio"] == 0.0
                checked, hits = checked + 1, hits + (want > 0)
        assert checked > 20 and 0 < hits < checked, "the workload must have hits and misses"
    finally:
        sim.close()
