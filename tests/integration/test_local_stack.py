"""The README's first command: the whole stack starts, answers, and stops what it started."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT, reserve_port


def _port_closed(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def test_local_stack_serves_l1_and_l3_ratios(tmp_path: Path,
                                            subprocess_env: dict[str, str]) -> None:
    api, redis_port, master = reserve_port(), reserve_port(), reserve_port()
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli", "local-stack", "--workdir", str(tmp_path),
         "--port", str(api), "--redis-port", str(redis_port), "--master-port", str(master),
         "--duration", "1"],
        cwd=ROOT, env=subprocess_env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("answer: "))
    answer = json.loads(line[len("answer: "):])
    assert answer["status"] == 0
    pod_a, pod_b = answer["server_score_list"]
    assert (pod_a["server_ip"], pod_b["server_ip"]) == ("127.0.0.2", "127.0.0.3")
    assert pod_a["l1_hit_ratio"] > 0, "pod A serves the example prompt: its GPU holds a prefix"
    assert pod_b["l1_hit_ratio"] == 0.0, "pod B never saw the example prompt"
    request = json.loads((tmp_path / "example-request.json").read_text())
    assert request["server_ip"] == ["127.0.0.2", "127.0.0.3"]
    if os.geteuid() == 0 and shutil.which("unshare") and shutil.which("mooncake_master"):
        n = len(request["body"]["token_ids"]) // request["body"]["block_size"]
        assert pod_b["l3_hit_ratio"] == (max(1, n * 3 // 4)) / n, "pod B put 3/4 of the blocks"
        assert pod_a["l3_hit_ratio"] == 0.0
    for port in (api, redis_port, master):
        assert _port_closed(port), f"port {port} still open after the stack stopped"
