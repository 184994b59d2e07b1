"""Benchmark hit ratios of a hybrid (2-group) model against the single-group case, side by side.

Starts its own redis-server and ``cache-indexer api`` (2 workers). Indexes 8 single-group
instances (one full-attention group) and 8 gpt-oss-like instances (group 0 sliding window
w = 128, group 1 full attention, as vLLM numbers them), each holding the whole prompt in
every group plus unrelated noise, through the ingester's own ``Store.apply_batch``. Then:

- **Throughput** (needs ``wrk``, Debian package ``wrk``): 8 candidates × 4,096 tokens; wrk
  on the single-group body and on the hybrid body in turns, ``--rounds`` times; requests/s of
  both and the ratio hybrid / single, with the median.
- **In process**: CPU time of ``hit_rate.score`` per request for both bodies (taken in
  turns, median), with the number of Redis round trips and of prompt hashings per request
  (counted by wrapping the store and the hasher).
- **Memory**: bytes per indexed block of a group set (``MEMORY USAGE``) against a bare set of
  the same members.

Usage: ``python scripts/bench_hybrid.py [--rounds 5] [--seconds 8] [--connections 8]
[--block-size 128]``. Prints Markdown.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
import redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common import keys
from common.blockhash import BlockHasher
from common.settings import ApiSettings
from common.store import Instance, Store, TierOps
from common.store_reads import Reads
from services.api import hit_rate
from services.api.api_metrics import ApiMetrics
from services.api.scoring import ViewCache

from bench_util import free_port, stop, wait_for

CANDIDATES = 8
TOKENS = 4096
NOISE = 20_000
_STARTING = (OSError, httpx.HTTPError, redis.RedisError)


def _index(
    store: Store, ip: str, members: list[int], hybrid: bool, block: int, rng: random.Random
) -> None:
    gen = store.upsert_instance(Instance(ip=ip, uid=f"u-{ip}"))[1]
    ops = TierOps()
    shape = (
        ((0, "sliding_window", 128), (1, "full_attention", None))
        if hybrid
        else ((0, "full_attention", None),)
    )
    noise = [rng.getrandbits(64) for _ in range(NOISE)]
    for g, kind, window in shape:
        ops.describe(g, kind, block, window)
        ops.store("l1", members + noise, group=g)
    ops.settings(0, 0, 1)
    assert store.apply_batch(ip, gen, 0, 0, ops).status == "applied"
    store.r.hset(keys.l1_state(ip), "hash_check", "ok")
    store.replace_l3(ip, {g: members[: len(members) // 2] for g, _, _ in shape})


class Counting:
    """Wraps the store and the hasher to count round trips and hashings per request."""

    def __init__(self, store: Store, hasher: BlockHasher) -> None:
        self.store, self.hasher = store, hasher
        self.trips = self.hashings = 0
        self.r = store.r

    def execute(self, reads: Reads) -> list[Any]:
        self.trips += 1
        return self.store.execute(reads)

    def member_keys(self, *args: Any, **kw: Any) -> list[bytes]:
        self.hashings += 1
        return self.hasher.member_keys(*args, **kw)


def _in_process(store: Store, bodies: dict[str, bytes], rounds: int) -> dict[str, Any]:
    hasher = BlockHasher(ApiSettings().hash)
    counting = Counting(store, hasher)
    metrics, views = ApiMetrics(), ViewCache()
    out: dict[str, Any] = {name: [] for name in bodies}
    counts = {}
    for body in bodies.values():  # warm: the views are learned on the first request
        hit_rate.score(
            hit_rate.parse_request(body),
            counting,
            counting,  # type: ignore[arg-type]
            metrics,
            views,
        )
    for _ in range(rounds):
        for name, body in bodies.items():
            counting.trips = counting.hashings = 0
            started = time.thread_time()
            for _ in range(50):
                hit_rate.score(
                    hit_rate.parse_request(body),
                    counting,
                    counting,  # type: ignore[arg-type]
                    metrics,
                    views,
                )
            out[name].append((time.thread_time() - started) / 50 * 1e6)
            counts[name] = (counting.trips / 50, counting.hashings / 50)
    return {name: (statistics.median(v), *counts[name]) for name, v in out.items()}


def _wrk(url: str, body: bytes, tmp: Path, seconds: int, connections: int) -> float:
    body_file = tmp / f"body-{abs(hash(body))}.json"
    body_file.write_bytes(body)
    script = body_file.with_suffix(".lua")
    script.write_text(
        f'wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\n'
        f'local f = io.open("{body_file}", "rb")\nwrk.body = f:read("*a")\n'
        f"f:close()\n"
    )
    out = subprocess.run(
        ["wrk", "-t1", f"-c{connections}", f"-d{seconds}s", "-s", str(script), url],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    if "Non-2xx" in out:
        raise SystemExit(f"bench: non-2xx answers from {url}:\n{out}")
    match = re.search(r"Requests/sec:\s+([\d.]+)", out)
    if not match:
        raise SystemExit(f"bench: no rate in wrk output:\n{out}")
    return float(match.group(1))


def _memory(client: redis.Redis, rng: random.Random) -> tuple[float, float]:
    members = [rng.getrandbits(64) for _ in range(100_000)]
    store = Store(client)
    ip = "10.9.9.9"
    gen = store.upsert_instance(Instance(ip=ip, uid="m"))[1]
    ops = TierOps()
    ops.describe(1, "sliding_window", 16, 128)
    ops.store("l1", members, group=1)
    store.apply_batch(ip, gen, 0, 0, ops)
    client.sadd("bench:bare", *members)
    group = client.memory_usage(keys.tier_group_set(ip, "l1", 1), samples=0) or 0
    copies = client.memory_usage(keys.tier_group_copies(ip, "l1", 1), samples=0) or 0
    bare = client.memory_usage("bench:bare", samples=0) or 1
    return (group + copies) / len(members), bare / len(members)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=int, default=8)
    parser.add_argument("--connections", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=128)
    args = parser.parse_args()
    if not shutil.which("wrk"):
        raise SystemExit("bench: wrk is not installed (apt-get install -y wrk)")
    rng = random.Random(1)
    block = args.block_size
    prompt = [rng.randrange(1, 150_000) for _ in range(TOKENS)]
    hasher = BlockHasher(ApiSettings().hash)
    members = [int(m) for m in hasher.member_keys(prompt, block)]
    procs: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory(prefix="bench-hybrid-") as tmp_name:
        tmp = Path(tmp_name)
        try:
            port, api_port = free_port(), free_port()
            procs.append(
                subprocess.Popen(
                    [
                        "redis-server",
                        "--port",
                        str(port),
                        "--bind",
                        "127.0.0.1",
                        "--save",
                        "",
                        "--appendonly",
                        "no",
                        "--dir",
                        tmp_name,
                    ],
                    stdout=subprocess.DEVNULL,
                )
            )
            client = redis.Redis(port=port)
            wait_for(client.ping, "redis-server", 30, tolerate=_STARTING)
            store = Store(client)
            single = [f"10.1.0.{i}" for i in range(CANDIDATES)]
            hybrid = [f"10.2.0.{i}" for i in range(CANDIDATES)]
            for ip in single:
                _index(store, ip, members, False, block, rng)
            for ip in hybrid:
                _index(store, ip, members, True, block, rng)
            bodies = {
                name: orjson.dumps(
                    {"server_ip": ips, "body": {"token_ids": prompt, "block_size": block}}
                )
                for name, ips in (("single group", single), ("2 groups (SWA + FA)", hybrid))
            }
            config = tmp / "config.yaml"
            config.write_text(
                f'http:\n  addr: "127.0.0.1:{api_port}"\n  workers: 2\n'
                f"log:\n  level: warning\nredis:\n  url: redis://127.0.0.1:{port}/0\n"
            )
            env = {k: v for k, v in os.environ.items() if not k.startswith("CACHE_INDEXER_")}
            env["PYTHONPATH"] = str(ROOT)
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "services.cli", "api", "--config", str(config)],
                    cwd=ROOT,
                    env=env,
                    stdout=subprocess.DEVNULL,
                )
            )
            url = f"http://127.0.0.1:{api_port}{hit_rate.PATH}"
            wait_for(
                lambda: httpx.get(f"http://127.0.0.1:{api_port}/healthz").status_code == 200,
                "the API",
                60,
                tolerate=_STARTING,
            )
            for body in bodies.values():  # the workers learn the views
                for _ in range(8):
                    assert httpx.post(url, content=body).status_code == 200
            rates: dict[str, list[float]] = {name: [] for name in bodies}
            for _ in range(args.rounds):
                for name, body in bodies.items():
                    rates[name].append(_wrk(url, body, tmp, args.seconds, args.connections))
            names = list(bodies)
            ratios = [h / s for s, h in zip(rates[names[0]], rates[names[1]])]
            print(
                f"## Hybrid vs single group: {CANDIDATES} candidates × {TOKENS} tokens, "
                f"block {block}, {args.rounds} rounds × {args.seconds} s, wrk -t1 "
                f"-c{args.connections}, 2 API workers, {os.cpu_count()} CPUs\n"
            )
            print("| case | req/s per round | median |")
            print("|---|---|---|")
            for name in names:
                print(
                    f"| {name} | {', '.join(f'{r:.0f}' for r in rates[name])} | "
                    f"{statistics.median(rates[name]):.0f} |"
                )
            print(
                f"| ratio 2 groups / single | {', '.join(f'{r:.2f}' for r in ratios)} | "
                f"**{statistics.median(ratios):.2f}×** |\n"
            )
            inproc = _in_process(store, bodies, args.rounds)
            print(
                "| in process (`hit_rate.score`) | CPU µs/request (median) | Redis round "
                "trips/request | prompt hashings/request |"
            )
            print("|---|---|---|---|")
            for name, (us, trips, hashings) in inproc.items():
                print(f"| {name} | {us:.0f} | {trips:.0f} | {hashings:.0f} |")
            group, bare = _memory(client, rng)
            print(
                f"\nMemory: a group set {group:.1f} B per block, a bare set {bare:.1f} B per "
                f"member: **{group / bare:.2f}×**"
            )
        finally:
            for proc in reversed(procs):
                stop(proc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
