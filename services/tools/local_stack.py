"""``cache-indexer local-stack``: the whole system on one machine, on embedded defaults.

Starts, in ``.local-stack/`` (logs, config, sockets): its own redis-server (loopback port
and a unix socket), two simulated dense vLLM pods (``simulate-vllm``; pod IPs 127.0.0.2 and
127.0.0.3, KV events over ipc:// sockets, 0.28.0 map and 0.23.0 array encodings), two
simulated hybrid-model pods (:data:`HYBRID_PODS`: 127.0.0.4 a Gemma 3 shape on vLLM 0.30.0,
127.0.0.5 a Qwen3-Next shape on 0.28.0, both also serving the example prompt), the
discovery worker (static mode), an L1 ingester, the API on ``127.0.0.1:28080`` and — in a
private network namespace, because Mooncake store clients listen on every interface — a
real ``mooncake_master``, one store client per dense pod putting blocks in vLLM's key format,
and the L3 poller (which reaches Redis through the unix socket). Without root/``unshare`` or
without the Mooncake wheel the L3 side is left out with a warning and L3 ratios stay 0.

When everything answers it writes ``.local-stack/example-request.json`` (a prompt pod A
and the hybrid pods serve, asked of every pod) and prints the API's answer for it, with the
hybrid pods' expected hit: vLLM's rule over the groups their state files report. Ctrl-C (or
``--duration``) stops every process it started, by PID.

``--engine vllm-ascend`` (or ``LOCAL_STACK_ENGINE=vllm-ascend``) makes both dense pods play
vllm-ascend instead (the hybrid pods stay vLLM): KV events of the paired vLLM releases
(0.18.0 and 0.13.0, array encoding) plus the AscendStoreConnector's ``medium="cpu"`` events,
and TP2 AscendStoreConnector keys in Mooncake — pod A in v0.18's layout, pod B layer-wise as
v0.21+ writes it (:data:`ASCEND`).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from common import logs
from common.blockhash import BlockHasher, HashSettings
from common.lifecycle import install_signal_handlers
from services.simulator.shapes import state_hit_tokens
from services.simulator.workload import Workload
from services.tools.local_stack_l3 import run_l3_side, start_l3_side
from services.tools.local_stack_processes import Processes, cli, wait_http

logger = logging.getLogger(__name__)

MODEL = "Qwen2.5-0.5B-Instruct"
BLOCK_SIZE = 16
PODS = [  # name, ip, emulated vLLM version, workload seed
    ("pod-a", "127.0.0.2", "0.28.0", 1),
    ("pod-b", "127.0.0.3", "0.23.0", 2),
]
# name, ip, emulated vLLM version, workload seed, --model-shape. Releases before 0.31, whose
# salted blocks hash like the config's vllmVersion (0.28: untagged extra keys).
HYBRID_PODS = [
    ("pod-c", "127.0.0.4", "0.30.0", 3, "gemma3"),
    ("pod-d", "127.0.0.5", "0.28.0", 4, "qwen3next"),
]
WORKLOAD = {"prompts": 16, "prompt_len": 256}
ENGINES = ("vllm", "vllm-ascend")
ASCEND = {  # pod → (vLLM release its vllm-ascend pairs with, Mooncake key spec)
    "pod-a": ("0.18.0", {"engine": "vllm-ascend", "tp": 2, "form": "A"}),
    "pod-b": ("0.13.0", {"engine": "vllm-ascend", "tp": 2, "form": "E-LW", "layers": 24}),
}


def _write_config(
    workdir: Path, redis_port: int, api_port: int, master_port: int, with_l3: bool
) -> Path:
    cfg: dict[str, Any] = {
        "http": {"addr": f"127.0.0.1:{api_port}", "workers": 2},
        "log": {"level": "info"},
        "redis": {"url": f"redis://127.0.0.1:{redis_port}/0"},
        "discovery": {
            "mode": "static",
            "static": {
                "vllm": [
                    {
                        "ip": ip,
                        "name": name,
                        "zmqEndpoint": f"ipc://{workdir}/{name}.pub",
                        "replayEndpoint": f"ipc://{workdir}/{name}.replay",
                    }
                    for name, ip in _all_pods()
                ],
                "mooncakeMasters": [{"url": f"http://127.0.0.1:{master_port}"}] if with_l3 else [],
            },
        },
        "ingest": {
            "l1": {"topic": "kv-events", "backoffInitial": "200ms", "backoffMax": "5s"},
            "l3": {"pollInterval": "2s", "httpTimeout": "2s"},
        },
    }
    path = workdir / "config.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False), encoding="utf-8")
    return path


def _all_pods() -> list[tuple[str, str]]:
    return [(p[0], p[1]) for p in PODS] + [(p[0], p[1]) for p in HYBRID_PODS]


def _example(workdir: Path) -> tuple[list[int], dict[str, list[str]]]:
    """Pod A's first pooled prompt, and the block digests each pod puts into Mooncake.

    Pod A puts its other pooled prompts; pod B puts the first 3/4 of the example prompt,
    so the example answers L1 ≈ 1.0 / L3 0.0 for pod A and L1 0.0 / L3 0.75 for pod B.
    """
    hasher = BlockHasher(HashSettings())
    pools = {
        name: Workload("mixed", block_size=BLOCK_SIZE, seed=seed, **WORKLOAD).pool
        for name, _, _, seed in PODS
    }
    example = list(pools["pod-a"][0].token_ids)
    digests = hasher.digests(example, BLOCK_SIZE)
    others = {d for r in pools["pod-a"][1:6] for d in hasher.digests(list(r.token_ids), BLOCK_SIZE)}
    # A key is stored once, by whoever puts it first: keep pod A off the example's blocks.
    puts = {
        "pod-a": sorted(d.hex() for d in others - set(digests)),
        "pod-b": [d.hex() for d in digests[: max(1, len(digests) * 3 // 4)]],
    }
    return example, puts


def _start(procs: Processes, args: argparse.Namespace, workdir: Path) -> tuple[list[int], bool]:
    redis_port, master_port = args.redis_port, args.master_port
    example, puts = _example(workdir)
    _start_redis(procs, workdir, redis_port)
    config = _write_config(workdir, redis_port, args.port, master_port, True)
    env = dict(os.environ, CACHE_INDEXER_CONFIG=str(config))
    for name, _, version, seed in PODS:
        if args.engine == "vllm-ascend":
            version = ASCEND[name][0]
        procs.spawn(
            name, _simulator(workdir, name, version, seed, "--engine", args.engine), env=env
        )
    prompt = workdir / "example-prompt.json"
    prompt.write_text(json.dumps(example), encoding="utf-8")
    for name, _, version, seed, shape in HYBRID_PODS:
        hybrid = ("--model-shape", shape, "--warm-prompt-file", str(prompt))
        procs.spawn(name, _simulator(workdir, name, version, seed, *hybrid), env=env)
    procs.spawn("discovery", cli("discovery"), env=env)
    procs.spawn("l1-ingest", cli("l1-ingest"), env=env)
    procs.spawn("api", cli("api"), env=env)
    with_l3 = start_l3_side(procs, workdir, config, master_port, _pod_blocks(puts, args.engine))
    if not with_l3:
        _write_config(workdir, redis_port, args.port, master_port, False)
    return example, with_l3


def _start_redis(procs: Processes, workdir: Path, port: int) -> None:
    """The stack's redis-server: loopback ``port`` and ``redis.sock`` (for the L3 side)."""
    procs.spawn(
        "redis",
        [
            shutil.which("redis-server") or "redis-server",
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--unixsocket",
            str(workdir / "redis.sock"),
            "--unixsocketperm",
            "700",
            "--dir",
            str(workdir),
        ],
    )


def _pod_blocks(puts: dict[str, list[str]], engine: str) -> dict[str, dict[str, Any]]:
    """Dense pod name → what its Mooncake store client puts: the key spec and the hashes."""
    blocks = {}
    for name, _, _, _ in PODS:
        spec: dict[str, Any] = {"model": MODEL, "tp": 1}
        if engine == "vllm-ascend":
            spec.update(ASCEND[name][1])
        blocks[name] = {**spec, "hashes": puts[name]}
    return blocks


def _simulator(workdir: Path, name: str, version: str, seed: int, *extra: str) -> list[str]:
    return cli(
        "simulate-vllm",
        *extra,
        "--endpoint",
        f"ipc://{workdir}/{name}.pub",
        "--replay-endpoint",
        f"ipc://{workdir}/{name}.replay",
        "--topic",
        "kv-events",
        "--vllm-version",
        version,
        "--block-size",
        str(BLOCK_SIZE),
        "--num-blocks",
        "8192",
        "--rate",
        "2",
        "--seed",
        str(seed),
        "--prompts",
        str(WORKLOAD["prompts"]),
        "--prompt-len",
        str(WORKLOAD["prompt_len"]),
        "--state-file",
        str(workdir / f"{name}.state.json"),
    )


def expected_hybrid_hits(workdir: Path, example: list[int]) -> dict[str, int]:
    """Hybrid pod IP → vLLM's hit for ``example``, in tokens, over the residency its
    simulator's state file reports (0 while it has written none)."""
    hashes = BlockHasher(HashSettings()).event_ints(example, BLOCK_SIZE, None)
    hits = {}
    for name, ip, _, _, _ in HYBRID_PODS:
        try:
            state = json.loads((workdir / f"{name}.state.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):  # not written yet (it is replaced atomically)
            state = None
        hits[ip] = state_hit_tokens(state, hashes, len(example)) if state else 0
    return hits


def _filled(scores: dict[str, Any], with_l3: bool, expected: dict[str, int]) -> bool:
    """Pod A's L1, pod B's L3 and every hybrid pod's expected L1 hit are answered."""
    a, b = (scores.get(PODS[i][1], {}) for i in (0, 1))
    return (
        a.get("l1_hit_ratio", 0) > 0
        and (not with_l3 or b.get("l3_hit_ratio", 0) > 0)
        and all(
            hit > 0 and scores.get(ip, {}).get("l1_hit_ratio", 0) > 0
            for ip, hit in expected.items()
        )
    )


def _show_example(
    port: int, example: list[int], with_l3: bool, workdir: Path, stop: threading.Event
) -> Any:
    request = {
        "server_ip": [ip for _, ip in _all_pods()],
        "body": {"token_ids": example, "cache_salt": "", "block_size": BLOCK_SIZE},
    }
    path = workdir / "example-request.json"
    path.write_text(json.dumps(request), encoding="utf-8")
    wait_http(f"http://127.0.0.1:{port}/readyz", 60, stop)
    url = f"http://127.0.0.1:{port}/kv-cache/hit-rate"
    answer: Any = None
    expected: dict[str, int] = {}
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not stop.is_set():  # until L1 and L3 are filled
        answer = httpx.post(url, json=request, timeout=5).json()
        expected = expected_hybrid_hits(workdir, example)
        scores = {s["server_ip"]: s for s in answer.get("server_score_list", [])}
        if _filled(scores, with_l3, expected):
            break
        stop.wait(0.5)
    truth = ", ".join(
        f"{name} ({shape}, {ip}) {expected.get(ip, 0)} tokens"
        for name, ip, _, _, shape in HYBRID_PODS
    )
    print(
        f"\nexample request: {path}\n  curl -s -X POST {url} -H 'Content-Type: "
        f"application/json' -d @{path}\nanswer: {json.dumps(answer)}\n"
        f"expected hybrid L1 hits (vLLM's rule over the simulators' groups): {truth}\n",
        flush=True,
    )
    return answer


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="cache-indexer local-stack", description=__doc__.split("\n")[0]
    )
    p.add_argument("--workdir", default=".local-stack")
    p.add_argument("--port", type=int, default=28080, help="API port on 127.0.0.1")
    p.add_argument("--redis-port", type=int, default=26379)
    p.add_argument("--master-port", type=int, default=29003, help="Mooncake admin port (+1: RPC)")
    p.add_argument("--duration", type=float, default=0, help="stop after N seconds (0 = Ctrl-C)")
    p.add_argument(
        "--engine",
        choices=ENGINES,
        default=os.environ.get("LOCAL_STACK_ENGINE") or "vllm",
        help="what the simulated pods play (default $LOCAL_STACK_ENGINE or vllm)",
    )
    p.add_argument("--l3-side", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    logs.configure("info")
    workdir = Path(args.workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    if args.engine not in ENGINES:
        p.error(f"--engine: {args.engine!r} is not one of {', '.join(ENGINES)}")
    stop = threading.Event()
    install_signal_handlers(stop)
    if args.l3_side:
        pods = [(name, ip) for name, ip, _, _ in PODS]
        return run_l3_side(workdir, args.master_port, pods, stop)
    procs = Processes(workdir)
    try:
        example, with_l3 = _start(procs, args, workdir)
        _show_example(args.port, example, with_l3, workdir, stop)
        started = time.monotonic()
        while not stop.wait(1.0):
            if procs.dead():
                logger.error("stopped unexpectedly: %s (see %s)", ", ".join(procs.dead()), workdir)
                return 1
            if args.duration and time.monotonic() - started >= args.duration:
                break
        return 0
    finally:
        procs.stop_all()
