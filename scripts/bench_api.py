"""Benchmark ``POST /kv-cache/hit-rate`` under the real gunicorn server, against baselines.

Starts its own redis-server and ``cache-indexer api`` on free loopback ports, registers
instances holding partially matching prefixes of one prompt (plus unrelated blocks so the
sets are not tiny), then sends a bounded number of requests from a few client processes
and prints requests/s and p50/p99 latency per case. In the same run, in this process and
single-threaded, it times the parts and a naive baseline:

- ``hash``: :meth:`BlockHasher.member_keys` alone;
- ``hash + pipelined``: hash, then :meth:`Store.prefix_lengths` (one round trip) — what
  the API does per request, without HTTP/JSON;
- ``hash + naive``: hash, then one SISMEMBER per block per tier per instance, each its
  own round trip, stopping at the first miss (no pipelining).

Usage: ``python scripts/bench_api.py [--workers 2] [--clients 4] [--requests-4k 2000]
[--requests-128k 200]``. Needs ``redis-server`` on PATH. Prints Markdown.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import httpx
import orjson
import redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common import keys
from common.blockhash import BlockHasher
from common.config import Config
from common.store import Instance, Store, TierOps
from services.api.app import hash_settings

BLOCK = 128
NOISE = 20_000  # unrelated block hashes per instance and tier
CASES = (("4k tokens, 8 instances", 4096, 8), ("128k tokens, 16 instances", 131072, 16))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait(cond: Callable[[], object], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if cond():
                return
        except (OSError, httpx.HTTPError, redis.RedisError):  # still starting
            time.sleep(0.05)
            continue
        time.sleep(0.05)
    raise SystemExit(f"bench: timed out waiting for {what}")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _populate(store: Store, rng: random.Random, prompt_members: list[int], ips: list[str]) -> None:
    """Instance i holds the first n*i/k blocks in L1 and the first n*(k-i)/k in L3, then a
    hole, then the rest of the prompt, plus unrelated blocks."""
    n, k = len(prompt_members), len(ips)
    for i, ip in enumerate(ips):
        _, gen = store.upsert_instance(Instance(ip=ip, uid=f"bench-{ip}"))
        l1_run, l3_run = n * i // k, n * (k - i) // k
        ops = TierOps()
        ops.store("l1", prompt_members[:l1_run] + prompt_members[l1_run + 1:]
                  + [rng.getrandbits(64) for _ in range(NOISE)])
        store.apply_batch(ip, gen, 0, 1, ops)
        store.replace_l3(ip, prompt_members[:l3_run] + prompt_members[l3_run + 1:]
                         + [rng.getrandbits(64) for _ in range(NOISE)])


def _client_run(url: str, body: bytes, count: int) -> list[float]:
    latencies = []
    with httpx.Client(timeout=30) as client:
        for _ in range(count):
            start = time.perf_counter()
            resp = client.post(url, content=body, headers={"Content-Type": "application/json"})
            latencies.append(time.perf_counter() - start)
            if resp.status_code != 200:
                raise RuntimeError(f"unexpected {resp.status_code}: {resp.text[:200]}")
    return latencies


def _over_http(url: str, body: bytes, requests: int, clients: int) -> tuple[float, list[float]]:
    _client_run(url, body, 5)  # warm-up: connections, worker imports
    per_client = max(1, requests // clients)
    with ProcessPoolExecutor(clients) as pool:
        start = time.perf_counter()
        futures = [pool.submit(_client_run, url, body, per_client) for _ in range(clients)]
        latencies = [lat for f in futures for lat in f.result()]
        elapsed = time.perf_counter() - start
    return len(latencies) / elapsed, latencies


def _naive_lengths(client: redis.Redis, ips: list[str],
                   members: list[bytes]) -> list[tuple[int, int]]:
    out = []
    for ip in ips:
        runs = []
        for key in (keys.tier_set(ip, "l1"), keys.l3_set(ip)):
            run = 0
            while run < len(members) and client.sismember(key, members[run]):
                run += 1
            runs.append(run)
        out.append((runs[0], runs[1]))
    return out


def _timed(fn: Callable[[], object], repeat: int) -> list[float]:
    out = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


def _row(name: str, latencies: list[float], rps: float | None = None) -> str:
    rate = rps if rps is not None else len(latencies) / sum(latencies)
    return f"| {name} | {rate:,.0f} | {_pct(latencies, 0.5):.2f} | {_pct(latencies, 0.99):.2f} |"


def _case(args: argparse.Namespace, url: str, store: Store, hasher: BlockHasher,
          label: str, tokens: int, instances: int, requests: int) -> list[str]:
    rng = random.Random(tokens)
    prompt = [rng.randrange(150_000) for _ in range(tokens)]
    members = hasher.member_keys(prompt, BLOCK)
    ips = [f"10.{tokens % 251}.0.{i + 1}" for i in range(instances)]
    _populate(store, rng, [int(m) for m in members], ips)
    expected = store.prefix_lengths(ips, members)
    assert _naive_lengths(store.r, ips, members) == expected
    body = orjson.dumps({"server_ip": ips, "body": {"token_ids": prompt, "cache_salt": "",
                                                    "block_size": BLOCK}})
    rps, http_lat = _over_http(url, body, requests, args.clients)
    rps1, http_lat1 = _over_http(url, body, max(20, requests // 4), 1)
    repeat = max(20, requests // 10)
    naive_repeat = max(5, repeat // 10)
    return [
        f"**{label}** ({tokens // BLOCK} blocks, request body {len(body) / 1024:,.0f} KiB)", "",
        "| path | req/s | p50 ms | p99 ms |", "|---|---:|---:|---:|",
        _row(f"API over HTTP ({args.workers} workers, {args.clients} clients)", http_lat, rps),
        _row(f"API over HTTP ({args.workers} workers, 1 client)", http_lat1, rps1),
        _row("in-process: hash only", _timed(lambda: hasher.member_keys(prompt, BLOCK), repeat)),
        _row("in-process: hash + pipelined reads (1 round trip)", _timed(
            lambda: store.prefix_lengths(ips, hasher.member_keys(prompt, BLOCK)), repeat)),
        _row("baseline: hash + naive SISMEMBER loop", _timed(
            lambda: _naive_lengths(store.r, ips, hasher.member_keys(prompt, BLOCK)),
            naive_repeat)),
        "",
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--requests-4k", type=int, default=2000)
    parser.add_argument("--requests-128k", type=int, default=200)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-api-"))
    redis_port, api_port = _free_port(), _free_port()
    redis_proc = subprocess.Popen(
        ["redis-server", "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "no", "--dir", str(tmp)], stdout=subprocess.DEVNULL)
    api_proc: subprocess.Popen[bytes] | None = None
    try:
        client = redis.Redis(port=redis_port)
        _wait(client.ping, "redis-server")
        (tmp / "config.yaml").write_text(
            f'http:\n  addr: "127.0.0.1:{api_port}"\n  workers: {args.workers}\n'
            f"  maxHitRateBodyBytes: 8388608\nlog:\n  level: warning\n"
            f"redis:\n  url: redis://127.0.0.1:{redis_port}/0\n")
        env = {k: v for k, v in os.environ.items() if not k.startswith("CACHE_INDEXER_")}
        env["PYTHONPATH"] = str(ROOT)
        api_proc = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "api", "--config", str(tmp / "config.yaml")],
            cwd=ROOT, env=env)
        base = f"http://127.0.0.1:{api_port}"
        _wait(lambda: httpx.get(f"{base}/readyz").status_code == 200, "the API")
        store, hasher = Store(client), BlockHasher(hash_settings(Config()))
        version = client.info()["redis_version"]
        lines = [(f"redis-server {version}, Python {sys.version.split()[0]}, {os.cpu_count()} CPUs"
                  " (clients, server and Redis share them)"), ""]
        for (label, tokens, instances), requests in zip(
                CASES, (args.requests_4k, args.requests_128k)):
            lines += _case(args, f"{base}/kv-cache/hit-rate", store, hasher, label, tokens,
                           instances, requests)
        print("\n".join(lines))
    finally:
        if api_proc is not None:
            _stop(api_proc)
        _stop(redis_proc)
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
