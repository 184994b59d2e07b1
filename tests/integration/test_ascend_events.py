"""vllm-ascend's KV events through the real decoder and L1 ingester (real ZMQ, real Redis):
vLLM core events in the paired release's array encoding go to L1; the AscendStoreConnector's
``BlockStored(medium="cpu")`` events go to the non-GPU tier (l2), never to L1."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import msgpack
import pytest
import redis

from common.events import BlockStored, decode_batch
from services.l1_ingest.apply import plan_ops
from services.simulator.ascend import ConnectorEvents
from services.simulator.engine import SimulatedVLLM
from services.simulator.workload import Workload
from tests.conftest import ROOT, reserve_port
from tests.integration.l1_support import (
    InProcessIngester,
    register,
    true_counts,
    wait_quiet,
    warm_up,
)
from tests.store_oracle import OracleStore

IP = "127.0.0.12"


@pytest.fixture()
def ascend_sim() -> Iterator[Callable[[str], SimulatedVLLM]]:
    sims: list[SimulatedVLLM] = []

    def make(version: str) -> SimulatedVLLM:
        sims.append(
            SimulatedVLLM(
                f"tcp://*:{reserve_port()}",
                "",
                "kv-events",
                vllm_version=version,
                num_blocks=48,
                engine="vllm-ascend",
            )
        )
        return sims[-1]

    yield make
    for sim in sims:
        sim.close()


def test_connector_event_on_the_wire_is_an_array_and_goes_to_l2() -> None:
    """The exact shape vllm-ascend v0.18.0 sends (vLLM 0.18 msgspec array_like, tagged):
    [tag, block_hashes=[u64], parent, token_ids, block_size, lora_id, medium, lora_name,
    extra_keys]."""
    u64 = 6768143630869698996
    event = ["BlockStored", [u64], None, list(range(128)), 128, None, "cpu", None, None]
    gpu = ["BlockStored", [u64], None, list(range(128)), 128, None, "GPU", None, None]
    payload = msgpack.packb([1.5, [gpu, event], 0])
    batch = decode_batch(payload)
    assert batch.form == "array" and not batch.skipped
    assert [e.medium for e in batch.events] == ["GPU", "cpu"]  # type: ignore[union-attr]
    writes = [op for op in plan_ops(batch).ops.ops if op[0] == "S"]
    assert writes == [("S", "l1", 0, [u64]), ("S", "l2", 0, [u64])]
    v13 = msgpack.packb([1.5, [event[:7]], None])  # vLLM 0.13: no lora_name/extra_keys yet
    assert [op for op in plan_ops(decode_batch(v13)).ops.ops if op[0] == "S"] == [
        ("S", "l2", 0, [u64])
    ]


def test_connector_events_follow_the_gpu_stores() -> None:
    conn = ConnectorEvents()
    gpu = BlockStored(
        [b"\x00" * 24 + (7).to_bytes(8, "big"), 9], None, list(range(32)), 16, medium="GPU"
    )
    out = conn.after([gpu])
    assert [
        (e.block_hashes, e.parent_block_hash, e.token_ids, e.medium)  # type: ignore[union-attr]
        for e in out
    ] == [([7], None, list(range(16)), "cpu"), ([9], 7, list(range(16, 32)), "cpu")]
    assert conn.after([gpu]) == []  # already in the pool: the connector skips existing keys


@pytest.mark.parametrize("version", ["0.13.0", "0.18.0", "0.20.2"])
def test_ascend_stream_indexes_gpu_in_l1_and_the_pool_in_l2(
    redis_client: redis.Redis, ascend_sim: Callable[[str], SimulatedVLLM], version: str
) -> None:
    store = OracleStore(redis_client)
    sim = ascend_sim(version)
    ing = InProcessIngester(redis_client)
    try:
        register(store, IP, sim)
        warm_up(store, IP, sim)
        workload = Workload("mixed", prompts=12, prompt_len=96, block_size=16, seed=3)
        for _ in range(30):
            sim.serve([workload.next() for _ in range(3)])
        wait_quiet(store, IP, sim)
        assert store.tier_counts(IP, "l1") == dict(true_counts(sim))  # GPU: exact
        pool = sim.connectors[0].pool
        assert pool and store.tier_members(IP, "l2") == pool  # every pooled block, in l2
        assert pool - set(true_counts(sim)), "evicted GPU blocks stay in the pool"
        assert not store.tier_members(IP, "l1") & (pool - set(true_counts(sim)))
        assert ing.count("events", type="BlockStored", outcome="l2") == len(pool)
        assert ing.count("skipped_media", medium="CPU") == len(pool)
    finally:
        ing.close()


def test_simulate_vllm_cli_plays_vllm_ascend(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    state = tmp_path / "sim.json"
    sim = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.cli",
            "simulate-vllm",
            "--engine",
            "vllm-ascend",
            "--endpoint",
            f"tcp://*:{reserve_port()}",
            "--num-blocks",
            "40",
            "--rate",
            "100",
            "--duration",
            "1",
            "--state-file",
            str(state),
        ],
        check=False,
        cwd=ROOT,
        env=subprocess_env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert sim.returncode == 0, sim.stderr[-2000:]
    assert "simulating vllm-ascend (vLLM 0.18.0, dense)" in sim.stderr  # the paired release
    truth = json.loads(state.read_text())["ranks"]["0"]
    assert truth["pool"] and set(truth["pool"]) >= set(truth["gpu"])  # every GPU block pooled
