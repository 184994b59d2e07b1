"""The README's first command: the whole stack starts, answers, and stops what it started.

The stack runs once for the module; its L1 answer, its hybrid pods' answer and its L3 answer
(which needs the Mooncake side: root, ``unshare`` and the Mooncake wheel) are separate tests,
so a machine without the Mooncake side reports the L3 part as skipped (failed under
``CI=true``).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from services.tools.local_stack import HYBRID_PODS, expected_hybrid_hits
from tests.conftest import ROOT, child_env, mooncake_missing, require, reserve_port, reserve_ports


def _port_closed(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


@dataclass
class StackRun:
    proc: subprocess.CompletedProcess[str]
    workdir: Path
    ports: tuple[int, ...]
    engine: str

    def answer(self) -> dict[str, Any]:
        assert self.proc.returncode == 0, self.proc.stderr[-3000:]
        line = next(ln for ln in self.proc.stdout.splitlines() if ln.startswith("answer: "))
        answer: dict[str, Any] = json.loads(line[len("answer: ") :])
        assert answer["status"] == 0
        return answer

    def request(self) -> dict[str, Any]:
        doc: dict[str, Any] = json.loads((self.workdir / "example-request.json").read_text())
        return doc

    def scores(self) -> dict[str, dict[str, Any]]:
        return {s["server_ip"]: s for s in self.answer()["server_score_list"]}

    def dense(self) -> tuple[dict[str, Any], dict[str, Any]]:
        scores = self.scores()
        return scores["127.0.0.2"], scores["127.0.0.3"]


@pytest.fixture(scope="module", params=["vllm", "vllm-ascend"])
def stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> StackRun:
    """One run of the stack per engine. ``vllm-ascend``: the pods' Mooncake keys are
    AscendStoreConnector keys (TP2, pod B layer-wise) and their events vLLM 0.18/0.13 arrays
    plus the connector's cpu events."""
    engine: str = request.param
    workdir = tmp_path_factory.mktemp(f"local-stack-{engine}")
    api, redis_port, master = reserve_port(), reserve_port(), reserve_ports(2)  # master+1: RPC
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.cli",
            "local-stack",
            "--workdir",
            str(workdir),
            "--port",
            str(api),
            "--redis-port",
            str(redis_port),
            "--master-port",
            str(master),
            "--duration",
            "1",
            "--engine",
            engine,
        ],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=180,
    )
    return StackRun(proc, workdir, (api, redis_port, master), engine)


def test_local_stack_serves_l1_ratios_and_stops(stack: StackRun) -> None:
    pod_a, pod_b = stack.dense()
    assert pod_a["l1_hit_ratio"] > 0, "pod A serves the example prompt: its GPU holds a prefix"
    assert pod_b["l1_hit_ratio"] == 0.0, "pod B never saw the example prompt"
    assert stack.request()["server_ip"] == [
        "127.0.0.2",
        "127.0.0.3",
        *(ip for _, ip, _, _, _ in HYBRID_PODS),
    ]
    for port in stack.ports:
        assert _port_closed(port), f"port {port} still open after the stack stopped"


def test_local_stack_serves_l3_ratios(stack: StackRun) -> None:
    reason = mooncake_missing()
    require(reason is None, f"the local stack's L3 side cannot run: {reason}")
    pod_a, pod_b = stack.dense()
    request = stack.request()
    n = len(request["body"]["token_ids"]) // request["body"]["block_size"]
    assert pod_b["l3_hit_ratio"] == (max(1, n * 3 // 4)) / n, "pod B put 3/4 of the blocks"
    assert pod_a["l3_hit_ratio"] == 0.0
    spec = json.loads((stack.workdir / "pod-b.blocks.json").read_text())
    assert spec.get("engine", "vllm") == stack.engine  # so the L3 hits above are that format's


def test_local_stack_runs_hybrid_pods_and_answers_their_hit(stack: StackRun) -> None:
    """The Gemma 3 and Qwen3-Next shaped pods hold the example prompt: vLLM's rule over the
    groups their simulators report gives a non-zero hit, and the API answers exactly it."""
    request = stack.request()
    tokens, block = request["body"]["token_ids"], request["body"]["block_size"]
    expected = expected_hybrid_hits(stack.workdir, tokens)
    assert set(expected) == {ip for _, ip, _, _, _ in HYBRID_PODS}
    assert all(hit == (len(tokens) - 1) // block * block for hit in expected.values()), (
        "each hybrid pod served the example prompt: vLLM reuses all but its last token"
    )
    scores, n = stack.scores(), len(tokens) // block
    assert {ip: scores[ip]["l1_hit_ratio"] for ip in expected} == {
        ip: min(hit, n * block) / (n * block) for ip, hit in expected.items()
    }
