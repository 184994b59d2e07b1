"""The simulator's publisher on the wire: vLLM's bind/connect rule, DP ports, replay framing;
a hybrid model shape's events as decoded, and its state file."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import msgpack
import pytest
import zmq

from common.blockhash import BlockHasher, HashSettings
from common.events import AllBlocksCleared, BlockRemoved, BlockStored, decode_batch
from services.l1_ingest.replay import ReplayRequest
from services.simulator.engine import SimulatedVLLM
from services.simulator.publisher import Publisher, binds, offset_endpoint
from services.simulator.shapes import state_hit_tokens
from services.simulator.workload import Workload
from tests.conftest import ROOT, child_env, reserve_ports, wait_for


def fetch_replay(
    ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, start_seq: int, timeout: float
) -> ReplayRequest:
    """The ingester's replay client, blocking: one request run to its end marker or deadline."""
    request = ReplayRequest(ctx, endpoint, start_seq, timeout)
    poller = zmq.Poller()
    poller.register(request.socket, zmq.POLLIN)
    while not request.read() and not request.expired():
        poller.poll(max(1, int((request.deadline - time.monotonic()) * 1000)))
    return request


def test_bind_rule_and_offsets() -> None:
    assert binds("tcp://*:5557") and binds("tcp://[::]:5557") and binds("ipc:///tmp/x")
    assert binds("inproc://kv") and not binds("tcp://127.0.0.1:5557")
    assert offset_endpoint("tcp://*:5557", 1) == "tcp://*:5558"
    assert offset_endpoint("inproc://kv", 1) == "inproc://kv_dp1"


def test_non_wildcard_endpoint_connects_to_a_binding_subscriber() -> None:
    ctx = zmq.Context.instance()
    port = reserve_ports(2)
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.bind(f"tcp://127.0.0.1:{port + 1}")  # DP rank 1 → configured port + 1
    pub = Publisher(f"tcp://127.0.0.1:{port}", dp_rank=1)
    try:
        frames: list[bytes] = []

        def received() -> bool:
            pub.publish([AllBlocksCleared()])  # the first ones may be lost (slow joiner)
            if sub.poll(100):
                frames[:] = sub.recv_multipart()
            return bool(frames)

        wait_for(received, what="a frame from the connecting PUB")
        assert frames[0] == b"" and len(frames[1]) == 8
        assert decode_batch(frames[2]).data_parallel_rank == 1
    finally:
        pub.close()
        sub.close(linger=0)


@pytest.mark.parametrize(("version", "width"), [((0, 25, 0), 3), ((0, 26, 0), 4)])
def test_replay_framing_by_version(version: tuple[int, int, int], width: int) -> None:
    rport = reserve_ports()
    pub = Publisher(
        f"tcp://*:{reserve_ports()}",
        f"tcp://*:{rport}",
        "kv-events",
        vllm_version=version,
        buffer_steps=3,
    )
    try:
        for _ in range(5):
            pub.publish([AllBlocksCleared()])
        pub.flush()
        ctx = zmq.Context.instance()
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{rport}")
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        replies = []
        while True:
            assert dealer.poll(5000)
            replies.append(dealer.recv_multipart())
            if replies[-1][-2] == b"\xff" * 8:
                break
        dealer.close(linger=0)
        assert [len(r) for r in replies] == [width] * 4  # 3 buffered + end marker
        assert [int.from_bytes(r[-2], "big") for r in replies[:-1]] == [2, 3, 4]
        assert replies[-1][-1] == b""
        # The ingester's replay client reads both framings and reports the late start.
        got = fetch_replay(ctx, f"tcp://127.0.0.1:{rport}", 0, timeout=5)
        assert got.complete and [s for s, _ in got.batches] == [2, 3, 4]
    finally:
        pub.close()


def test_hybrid_events_decode_with_each_groups_fields() -> None:
    """A gemma3-shaped simulator on the wire (0.28.0 maps), read back through replay and
    ``decode_batch``: every store names its group, kind, window and block size; removes
    carry ``group_idx`` and no kind; sparse stores (empty hashes, null parents before a
    window tail) occur; the decoded events replay to the state file's residency, from which
    vLLM's hit follows."""
    rport = reserve_ports()
    sim = SimulatedVLLM(
        f"tcp://*:{reserve_ports()}",
        f"tcp://*:{rport}",
        "kv-events",
        vllm_version="0.28.0",
        num_blocks=60,
        model_shape="gemma3",
    )
    try:
        workload = Workload("mixed", prompts=8, prompt_len=120, block_size=16, seed=4)
        served = [workload.next() for _ in range(120)]
        for i in range(0, len(served), 2):
            sim.serve(served[i : i + 2])
        sim.flush()
        got = fetch_replay(zmq.Context.instance(), f"tcp://127.0.0.1:{rport}", 0, timeout=5)
        assert got.complete and len(got.batches) == sim.last_seq() + 1
        net: list[Counter[int]] = [Counter(), Counter(), Counter()]
        sparse_roots = empties = removes = 0
        for _, payload in got.batches:
            batch = decode_batch(payload)
            assert batch.form == "map" and not batch.skipped
            for raw in msgpack.unpackb(payload)[1]:
                if raw["type"] == "BlockRemoved":
                    assert set(raw) == {"type", "block_hashes", "medium", "group_idx"}
            for e in batch.events:
                if isinstance(e, BlockRemoved):
                    assert e.group_idx in (0, 1, 2) and e.medium == "GPU"
                    net[e.group_idx].subtract(int(h) for h in e.block_hashes)
                    removes += 1
                    continue
                assert isinstance(e, BlockStored) and e.group_idx in (0, 1, 2)
                assert (e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window) == (
                    ("sliding_window", 64) if e.group_idx < 2 else ("full_attention", None)
                )
                assert e.block_size == 16 and len(e.token_ids) % 16 == 0 and e.token_ids
                net[e.group_idx].update(int(h) for h in e.block_hashes)
                empties += not e.block_hashes
                sparse_roots += e.parent_block_hash is None and 0 < len(e.block_hashes) * 16 < len(
                    e.token_ids
                )
        assert removes and empties and sparse_roots
        state = sim.state()
        groups = state["ranks"]["0"]["gpu_groups"]
        assert [+c for c in net] == [
            Counter({int(h): n for h, n in groups[g].items()}) for g in ("0", "1", "2")
        ]
        assert state["groups"][2] == {
            "group": 2,
            "kind": "full_attention",
            "block_size": 16,
            "sliding_window": None,
        }
        hits = [
            (
                state_hit_tokens(state, sim.models[0].hashes(r), len(r.token_ids)),
                sim.true_hit_tokens(r),
                sim.true_prefix_len(r) * 16,
            )
            for r in served
        ]
        assert all(h == t for h, t, _ in hits)
        assert any(h > 0 for h, _, _ in hits), "some prompts must hit"
        assert any(h < fa for h, _, fa in hits), "the full-attention prefix over-reports"
    finally:
        sim.close()


def test_simulate_vllm_cli_plays_a_hybrid_and_reports_its_groups(tmp_path: Path) -> None:
    """``--model-shape qwen3next``: the state file has the groups and their residency; the
    ``--warm-prompt-file`` prompt then has vLLM's hit (the Mamba state at its last full
    block); a hybrid before vLLM 0.22 is refused."""
    warm, state = tmp_path / "warm.json", tmp_path / "sim.json"
    tokens = list(range(7, 107))  # 100 tokens: 6 full blocks
    warm.write_text(json.dumps(tokens))
    base = [
        sys.executable,
        "-m",
        "services.cli",
        "simulate-vllm",
        "--endpoint",
        f"tcp://*:{reserve_ports()}",
        "--model-shape",
        "qwen3next",
    ]
    run = subprocess.run(
        [
            *base,
            "--warm-prompt-file",
            str(warm),
            "--rate",
            "50",
            "--duration",
            "0.5",
            "--state-file",
            str(state),
        ],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr.decode()[-2000:]
    truth = json.loads(state.read_text())
    assert truth["finished"] and truth["model_shape"] == "qwen3next"
    assert [(g["group"], g["kind"]) for g in truth["groups"]] == [
        (0, "mamba"),
        (1, "full_attention"),
    ]
    hashes = BlockHasher(HashSettings()).event_ints(tokens, 16, None)
    assert str(hashes[5]) in truth["ranks"]["0"]["gpu_groups"]["0"]
    assert truth["ranks"]["0"]["gpu"] == truth["ranks"]["0"]["gpu_groups"]["0"]
    assert state_hit_tokens(truth, hashes, len(tokens)) == 96
    old = subprocess.run(
        [*base, "--vllm-version", "0.21.0", "--duration", "0.1"],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        timeout=60,
    )
    assert old.returncode == 2 and b"vLLM >= 0.22" in old.stderr
