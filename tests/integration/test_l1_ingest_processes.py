"""The ``cache-indexer l1-ingest`` and ``simulate-vllm`` processes: SIGKILL and restart,
lease handover between two ingesters, and an end-to-end check of the prefix lengths the
API reads against the simulator's true cache."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import redis
import zmq

from common.store import Instance, TierOps
from services.l1_ingest.sharding import rendezvous_owner
from services.simulator.engine import SimulatedVLLM
from services.simulator.workload import Workload
from tests.conftest import ROOT, RedisServer, reserve_ports, wait_for
from tests.integration.l1_support import (
    assert_exact,
    register,
    spawn_ingester,
    wait_quiet,
    warm_up,
    write_config,
)
from tests.store_oracle import OracleStore


@pytest.fixture()
def sims() -> Iterator[Callable[..., SimulatedVLLM]]:
    made: list[SimulatedVLLM] = []

    def make(version: str = "0.28.0", **kw: object) -> SimulatedVLLM:
        sim = SimulatedVLLM(
            f"tcp://*:{reserve_ports()}",
            f"tcp://*:{reserve_ports()}",
            "kv-events",
            vllm_version=version,
            **kw,
        )  # type: ignore[arg-type]
        made.append(sim)
        return sim

    yield make
    for sim in made:
        sim.close()


def drive(sim: SimulatedVLLM, steps: int, workload: Workload, drop_every: int = 0) -> None:
    for i in range(1, steps + 1):
        drop = bool(drop_every) and i % drop_every == 0
        sim.serve([workload.next() for _ in range(3)], drop=drop)


def test_sigkilled_ingester_restarts_without_losing_anything(
    redis_server: RedisServer,
    redis_client: redis.Redis,
    tmp_path: Path,
    subprocess_env: dict[str, str],
    procs: list[subprocess.Popen[bytes]],
    sims: Callable[..., SimulatedVLLM],
) -> None:
    store, ip = OracleStore(redis_client), "127.0.0.31"
    sim = sims(num_blocks=48)
    workload = Workload("mixed", prompts=10, prompt_len=80, block_size=16, seed=5)
    config = write_config(tmp_path / "c.yaml", redis_server.url)
    procs.append(
        spawn_ingester(
            config, subprocess_env, "--shard", "0", "--shards", "1", log=tmp_path / "ingester.log"
        )
    )
    register(store, ip, sim)
    warm_up(store, ip, sim)
    drive(sim, 10, workload)
    assert_exact(store, ip, sim)
    procs[0].send_signal(signal.SIGKILL)
    procs[0].wait(5)
    drive(sim, 12, workload, drop_every=3)  # published while no ingester runs
    sim.flush()
    assert store.last_seq(ip, 0) != sim.last_seq(0)
    procs.append(
        spawn_ingester(
            config, subprocess_env, "--shard", "0", "--shards", "1", log=tmp_path / "ingester.log"
        )
    )
    drive(sim, 5, workload)
    assert_exact(store, ip, sim)
    assert "gap:0" not in store.l1_state(ip)


def test_lease_handover_after_sigkill(
    redis_server: RedisServer,
    redis_client: redis.Redis,
    tmp_path: Path,
    subprocess_env: dict[str, str],
    procs: list[subprocess.Popen[bytes]],
    sims: Callable[..., SimulatedVLLM],
) -> None:
    store = OracleStore(redis_client)
    ids = ["ing-a", "ing-b"]
    ips = [f"127.0.0.{40 + i}" for i in range(12)]
    owners = {ip: rendezvous_owner(ip, ids) for ip in ips}
    chosen = [next(ip for ip in ips if owners[ip] == who) for who in ids]  # one each
    chosen.append(next(ip for ip in ips if ip not in chosen))
    config = write_config(tmp_path / "c.yaml", redis_server.url)
    for ingester_id in ids:
        procs.append(
            spawn_ingester(
                config, subprocess_env, "--id", ingester_id, log=tmp_path / "ingester.log"
            )
        )
    fleet = {ip: sims(num_blocks=32) for ip in chosen}
    workload = Workload("mixed", prompts=8, prompt_len=64, block_size=16, seed=6)
    for ip, sim in fleet.items():
        register(store, ip, sim)
    for ip, sim in fleet.items():
        warm_up(store, ip, sim)
        drive(sim, 5, workload)
        assert_exact(store, ip, sim)

    def holder_is(ip: str, owner: str) -> bool:
        # An owner-checked write at the current sequence is a no-op "duplicate" for the
        # lease holder and "not_owner" for anyone else.
        gen = store.get_instance(ip).gen  # type: ignore[union-attr]
        seq = store.last_seq(ip, 0)
        return store.apply_batch(ip, gen, 0, seq or 0, TierOps(), owner=owner).status == "duplicate"

    victim, survivor_own = chosen[0], chosen[1]
    wait_for(
        lambda: holder_is(survivor_own, "ing-b") and holder_is(victim, "ing-a"),
        what="each ingester to hold its rendezvous share",
    )
    assert not holder_is(victim, "ing-b")
    procs[0].send_signal(signal.SIGKILL)  # ing-a dies holding its leases
    procs[0].wait(5)
    for sim in fleet.values():
        drive(sim, 5, workload)
    for ip, sim in fleet.items():  # each polls (generous deadline) until ing-b caught up
        assert_exact(store, ip, sim)
    # The dead ingester's owner id is fenced: its late write is refused.
    assert holder_is(victim, "ing-b")
    gen = store.get_instance(victim).gen  # type: ignore[union-attr]
    ops = TierOps()
    ops.store("l1", [4242])
    result = store.apply_batch(
        victim, gen, 0, (store.last_seq(victim, 0) or 0) + 1, ops, owner="ing-a"
    )
    assert result.status == "not_owner"
    assert 4242 not in store.tier_members(victim)


def test_end_to_end_prefix_lengths_match_the_simulator(
    redis_server: RedisServer,
    redis_client: redis.Redis,
    tmp_path: Path,
    subprocess_env: dict[str, str],
    procs: list[subprocess.Popen[bytes]],
    sims: Callable[..., SimulatedVLLM],
) -> None:
    store, ip = OracleStore(redis_client), "127.0.0.51"
    config = write_config(tmp_path / "c.yaml", redis_server.url)
    metrics_port = reserve_ports()
    procs.append(
        spawn_ingester(
            config,
            subprocess_env,
            "--metrics-port",
            str(metrics_port),
            log=tmp_path / "ingester.log",
        )
    )
    sim = sims("0.34.0", num_blocks=96, cpu_blocks=32, ranks=[0, 1])
    register(store, ip, sim)  # registered after the ingester started: picked up live
    warm_up(store, ip, sim)
    workload = Workload("mixed", prompts=24, prompt_len=160, block_size=16, seed=7)
    served = []
    for i in range(1, 61):
        requests = [workload.next() for _ in range(4)]
        sim.serve(requests, drop=i % 9 == 0)
        served += requests
        if i == 30:
            sim.reset_prefix_cache(rank=0)
    wait_quiet(store, ip, sim)
    assert_exact(store, ip, sim)
    assert store.tier_members(ip, "l2"), "the workload must exercise the CPU tier"
    mismatches = [
        (r, store.prefix_lengths([ip], sim.member_keys(r))[0][0], sim.true_prefix_len(r))
        for r in served
    ]
    assert [m for m in mismatches if m[1] != m[2]] == []
    assert any(m[2] > 0 for m in mismatches) and any(m[2] == 0 for m in mismatches)
    text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).text
    assert "cache_indexer_l1_connected_sockets 2.0\n" in text
    assert 'cache_indexer_l1_events_total{outcome="l2",type="BlockStored"}' in text  # sorted
    assert 'cache_indexer_l1_gaps_total{outcome="recovered"}' in text
    # Warm shutdown: exit 0 and hand the lease back at once (no waiting for its TTL).
    procs[0].send_signal(signal.SIGTERM)
    assert procs[0].wait(10) == 0
    assert store.claim_instance(ip, "next-ingester", 1000)


def test_simulate_vllm_cli_state_file_matches_the_index(
    redis_server: RedisServer,
    redis_client: redis.Redis,
    tmp_path: Path,
    subprocess_env: dict[str, str],
    procs: list[subprocess.Popen[bytes]],
) -> None:
    store, ip = OracleStore(redis_client), "127.0.0.61"
    port, rport = reserve_ports(), reserve_ports()
    config = write_config(tmp_path / "c.yaml", redis_server.url)
    procs.append(
        spawn_ingester(
            config, subprocess_env, "--shard", "0", "--shards", "1", log=tmp_path / "ingester.log"
        )
    )
    store.upsert_instance(
        Instance(
            ip=ip,
            uid="u",
            zmq_endpoint=f"tcp://127.0.0.1:{port}",
            replay_endpoint=f"tcp://127.0.0.1:{rport}",
        )
    )
    state = tmp_path / "sim.json"
    sim = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.cli",
            "simulate-vllm",
            "--endpoint",
            f"tcp://*:{port}",
            "--replay-endpoint",
            f"tcp://*:{rport}",
            "--topic",
            "kv-events",
            "--vllm-version",
            "0.23.0",
            "--num-blocks",
            "40",
            "--rate",
            "100",
            "--duration",
            "1.5",
            "--drop-every",
            "7",
            "--restart-after",
            "60",
            "--state-file",
            str(state),
            "--linger",
            "120",
        ],
        cwd=ROOT,
        env=subprocess_env,
        stderr=(tmp_path / "sim.log").open("wb"),
    )
    procs.append(sim)

    def finished() -> dict[str, object] | None:
        data = json.loads(state.read_text())  # written atomically
        return data if data["finished"] else None

    truth = wait_for(finished, timeout=60, what="the simulator's run to end")["ranks"]["0"]
    assert truth["last_seq"] >= 20
    # The simulator lingers, serving replay, so the gaps it left can be filled.
    wait_for(
        lambda: store.last_seq(ip, 0) == truth["last_seq"],
        timeout=60,
        what="the ingester to catch up",
    )
    assert store.tier_counts(ip) == {int(h): n for h, n in truth["gpu"].items()}
    sim.send_signal(signal.SIGTERM)
    assert sim.wait(10) == 0
    assert b"run over; serving replay" in (tmp_path / "sim.log").read_bytes()


def test_simulate_vllm_ends_a_run_on_a_live_batch(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    """--drop-every 1 drops every step; the run still ends with one batch sent live."""
    port, state = reserve_ports(), tmp_path / "sim.json"
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(f"tcp://127.0.0.1:{port}")
    try:
        sim = subprocess.run(
            [
                sys.executable,
                "-m",
                "services.cli",
                "simulate-vllm",
                "--endpoint",
                f"tcp://*:{port}",
                "--rate",
                "50",
                "--duration",
                "1.0",
                "--drop-every",
                "1",
                "--linger",
                "0.5",
                "--state-file",
                str(state),
            ],
            check=False,
            cwd=ROOT,
            env=subprocess_env,
            capture_output=True,
            timeout=30,
        )
        assert sim.returncode == 0, sim.stderr.decode()[-2000:]
        data = json.loads(state.read_text())
        assert data["finished"] is True
        received = []
        while sub.poll(0):
            received.append(int.from_bytes(sub.recv_multipart()[1], "big"))
        assert received == [data["ranks"]["0"]["last_seq"]]  # only the closing batch
    finally:
        sub.close()


@pytest.mark.parametrize(
    "args", [["--config", "/nonexistent.yaml"], ["--shard", "2", "--shards", "2"]]
)
def test_bad_config_or_flags_exit_2(subprocess_env: dict[str, str], args: list[str]) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli", "l1-ingest", *args],
        check=False,
        cwd=ROOT,
        env=subprocess_env,
        capture_output=True,
        timeout=30,
    )
    assert proc.returncode == 2
    assert b"Traceback" not in proc.stderr and b"l1-ingest:" in proc.stderr
