"""vllm-ascend keys in a real ``mooncake_master``, read back through ``POST /kv-cache/hit-rate``;
prints the observations as JSON (tests/integration/test_l3_ascend_mooncake.py asserts them).

Runs inside a private network namespace (store clients listen on all interfaces)::

    unshare -n sh -c 'ip link set lo up && python tests/integration/ascend_mooncake_driver.py'

The setup is mooncake_driver.py's (redis-server, the master, one store client per "pod" —
127.0.0.2 = A, 127.0.0.3 = B, 127.0.0.4 = C registered without a segment — and
``cache-indexer l3-poll``, scope segment) plus the API under gunicorn. Every client puts its
keys pinned to its own segment, as vllm-ascend does with ``preferred_segment``. Keys are
AscendStoreConnector keys (services/simulator/ascend.py) of the project's own block hashes.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from services.simulator.ascend import ascend_store_key  # noqa: E402
from tests.conftest import reserve_port, wait_for  # noqa: E402
from tests.integration.mooncake_driver import (  # noqa: E402
    A,
    B,
    BLOCK,
    C,
    HASHER,
    Scenario,
    prompt,
)

LAYERS = 6


def keys(
    tokens: list[int],
    model: str,
    form: str,
    heads: int = 2,
    skip: tuple[tuple[int, int, int], ...] = (),
) -> list[str]:
    """Every (block, head[, layer]) key of a prompt but those in ``skip``."""
    layers = range(LAYERS) if form.endswith("LW") else range(1)
    return [
        ascend_store_key(model, h, d.hex(), form=form, layer=ly)
        for b, d in enumerate(HASHER.digests(tokens, BLOCK))
        for h in range(heads)
        for ly in layers
        if (b, h, ly) not in skip
    ]


class AscendScenario(Scenario):
    def start(self) -> None:
        super().start()
        self.api = reserve_port()
        self._spawn(
            [
                sys.executable,
                "-m",
                "services.cli",
                "api",
                "--config",
                str(self.tmp / "config.yaml"),
                "--bind",
                f"127.0.0.1:{self.api}",
                "--workers",
                "1",
            ],
            "api.log",
            {**os.environ, "PYTHONPATH": str(ROOT)},
        )
        wait_for(
            lambda: httpx.get(f"http://127.0.0.1:{self.api}/readyz").status_code == 200,
            timeout=30,
            what="the API",
        )

    def hit_rate(self, tokens: list[int]) -> dict[str, float]:
        body = {"server_ip": [A, B, C], "body": {"token_ids": tokens, "block_size": BLOCK}}
        answer = httpx.post(
            f"http://127.0.0.1:{self.api}/kv-cache/hit-rate", json=body, timeout=10
        ).json()
        return {s["server_ip"]: s["l3_hit_ratio"] for s in answer["server_score_list"]}

    def run(self) -> None:
        pod_a, pod_b = self.pods[A], self.pods[B]
        p1, p2, p3, p4 = prompt(11, 8), prompt(12, 6), prompt(13, 4), prompt(14, 4)
        puts: list[int] = []
        # pod A: a TP2 vllm-ascend v0.18 deployment; block 5 lost head 1's key
        puts += pod_a.call("put", keys(p1, "Qwen2.5-7B-Instruct", "A", skip=((5, 1, 0),)), pin=True)
        # pod B: a TP2 layer-wise v0.21+ deployment; block 3 lost layer 4 of head 1
        puts += pod_b.call(
            "put", keys(p2, "Qwen2.5-0.5B-Instruct", "E-LW", skip=((3, 1, 4),)), pin=True
        )
        # v0.20.2 layer-wise (the layer id after the hash), complete, on A
        puts += pod_a.call("put", keys(p4, "Qwen2.5-0.5B-Instruct", "C-LW"), pin=True)
        # v0.20.2 normal TP2 with each head on another pod's segment
        p3_keys = keys(p3, "Qwen2.5-1.5B-Instruct", "C")
        puts += pod_a.call("put", p3_keys[0::2], pin=True)  # head 0
        puts += pod_b.call("put", p3_keys[1::2], pin=True)  # head 1
        puts += pod_a.call("put", ["some-other-tool@v1@not-a-block"], pin=True)
        self.out["puts"] = puts
        self.settle()
        self.out["p1"], self.out["p2"] = self.hit_rate(p1), self.hit_rate(p2)
        self.out["p3"], self.out["p4"] = self.hit_rate(p3), self.hit_rate(p4)
        # one more key goes: block 1 of the cross-pod deployment loses head 1
        self.out["remove"] = pod_b.call("remove", [p3_keys[3]])
        # and the missing layer of p2 arrives: the whole prompt is complete
        missing = ascend_store_key(
            "Qwen2.5-0.5B-Instruct", 1, HASHER.digests(p2, BLOCK)[3].hex(), form="E-LW", layer=4
        )
        self.out["put_missing"] = pod_b.call("put", [missing], pin=True)
        self.settle()
        self.out["p2_after"], self.out["p3_after"] = self.hit_rate(p2), self.hit_rate(p3)
        self.out["master_state"] = self.store.get_master_state(self.master_url)
        self.out["unparsed_gauge"] = self.counter("keys_unparsed")


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="l3-ascend-") as tmp:
        scenario = AscendScenario("segment", Path(tmp))
        out: dict[str, Any] = scenario.out
        try:
            scenario.start()
            scenario.run()
        except Exception as exc:  # noqa: BLE001 - reported to the test with the logs
            out["error"] = repr(exc)
            out["logs"] = {
                p.name: p.read_text(errors="replace")[-3000:] for p in Path(tmp).glob("*.log")
            }
        finally:
            scenario.stop()
        print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
