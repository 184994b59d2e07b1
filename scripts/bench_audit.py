"""Benchmark the prediction audit: hit-rate latency with the audit on versus off, side by
side in one run, and the cost of an outcome report.

Starts its own redis-server and two ``cache-indexer api`` servers (``--workers`` each) on it,
identical but for ``audit.enabled``. Every request carries a fresh ``request_id`` (so both
bodies and answers are the same size); only the audit-on server records it. ``--clients``
threads each send requests to the two servers in turns (on, off, on, …), so drift and noise
hit both alike; p50/p99 of each, per prompt shape, and their ratio. Then every recorded id
gets its outcome report (``POST /kv-cache/outcome``, one client): p50/p99 of a report next
to the hit-rate p50, and what the audit-on server counted
(``cache_indexer_api_audit_records_total``). Prints Markdown.

``--control`` runs both servers with the audit off (the "on" column is then a second
identical server): the noise floor of the comparison on this machine.

Usage: ``python scripts/bench_audit.py [--requests 1500] [--clients 4] [--workers 2]
[--control]``.
"""

from __future__ import annotations

import argparse
import itertools
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import orjson
import redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common.blockhash import BlockHasher
from common.settings import ApiSettings
from common.store import Instance, Store, TierOps

from bench_util import free_port, stop, wait_for

BLOCK = 128
SHAPES = ((8, 4096), (32, 1024))  # (candidates, prompt tokens)
_STARTING = (OSError, httpx.HTTPError, redis.RedisError)


def _populate(store: Store, hasher: BlockHasher, candidates: int, tokens: int, net: int) -> dict:
    """Even candidates hold the whole prompt in L1, every one its first half in L3."""
    rng = random.Random(tokens * candidates)
    prompt = [rng.randrange(151_936) for _ in range(tokens)]
    members = [int(m) for m in hasher.member_keys(prompt, BLOCK)]
    ips = [f"10.{net}.0.{i + 1}" for i in range(candidates)]
    for i, ip in enumerate(ips):
        _, gen = store.upsert_instance(Instance(ip=ip, uid=f"bench-{ip}"))
        ops = TierOps()
        ops.store(
            "l1", (members if i % 2 == 0 else []) + [rng.getrandbits(63) for _ in range(5000)]
        )
        store.apply_batch(ip, gen, 0, 1, ops)
        store.replace_l3(ip, members[: len(members) // 2])
    return {"server_ip": ips, "body": {"token_ids": prompt, "block_size": BLOCK}}


class Servers:
    def __init__(self, tmp: Path, workers: int, control: bool = False) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("CACHE_INDEXER_")}
        self.env["PYTHONPATH"] = str(ROOT)
        port = free_port()
        self._start(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", ""])
        self.client = redis.Redis(port=port)
        wait_for(self.client.ping, "redis-server", 30, tolerate=_STARTING)
        self.urls: dict[str, str] = {}
        for name, enabled in (("on", "false" if control else "true"), ("off", "false")):
            api = free_port()
            config = tmp / f"config-{name}.yaml"
            config.write_text(
                f'http:\n  addr: "127.0.0.1:{api}"\n  workers: {workers}\n'
                f"log:\n  level: warning\nredis:\n  url: redis://127.0.0.1:{port}/0\n"
                f"audit:\n  enabled: {enabled}\n  maxRecordsPerSecond: 100000\n"
            )
            self._start([sys.executable, "-m", "services.cli", "api", "--config", str(config)])
            self.urls[name] = f"http://127.0.0.1:{api}"
        for url in self.urls.values():
            wait_for(
                lambda u=url: httpx.get(u + "/readyz").status_code == 200,
                "api",
                60,
                tolerate=_STARTING,
            )

    def _start(self, argv: list[str]) -> None:
        self.procs.append(subprocess.Popen(argv, cwd=ROOT, env=self.env, stdout=subprocess.DEVNULL))

    def close(self) -> None:
        for proc in reversed(self.procs):
            stop(proc)


def _turns(urls: dict[str, str], doc: dict, n: int, clients: int) -> dict[str, list[float]]:
    """``clients`` threads, each ``n // clients`` requests to on and to off in turns."""
    times: dict[str, list[float]] = {"on": [], "off": []}
    ids = itertools.count()
    lock = threading.Lock()

    def client(k: int) -> None:
        with httpx.Client(timeout=30) as http:
            order = ("on", "off") if k % 2 == 0 else ("off", "on")
            for _ in range(n // clients):
                for name in order:
                    with lock:
                        rid = f"bench-{next(ids)}"
                    body = orjson.dumps({**doc, "request_id": rid})
                    start = time.perf_counter()
                    resp = http.post(urls[name] + "/kv-cache/hit-rate", content=body)
                    elapsed = time.perf_counter() - start
                    assert resp.status_code == 200, resp.text
                    with lock:
                        times[name].append(elapsed)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return times


def _reports(url: str, client: redis.Redis, limit: int) -> list[float]:
    """One report per recorded question (up to ``limit``), for its first candidate, one
    client; only the report's round trip is timed."""
    keys = [
        k
        for k in itertools.islice(client.scan_iter("ci:audit:{*", count=1000), 2 * limit)
        if not k.endswith(b":r")
    ][:limit]
    times = []
    with httpx.Client(timeout=30) as http:
        for key in keys:
            rid = key.decode().split("{", 1)[1].rsplit("}", 1)[0]
            ip = next(iter(orjson.loads(client.get(key) or b"{}").get("c", {})), "")
            body = orjson.dumps({"request_id": rid, "server_ip": ip, "cached_tokens": 1024})
            start = time.perf_counter()
            resp = http.post(url + "/kv-cache/outcome", content=body)
            times.append(time.perf_counter() - start)
            assert resp.status_code == 200, resp.text
    return times


def _ms(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q) - 1] * 1000 if len(values) > 1 else 0.0


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=1500, help="per server and shape")
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--reports", type=int, default=1000)
    p.add_argument(
        "--control",
        action="store_true",
        help="both servers with the audit off: how far apart two identical servers measure",
    )
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        servers = Servers(Path(tmp), args.workers, args.control)
        try:
            _run(servers, args)
        finally:
            servers.close()
    return 0


def _run(servers: Servers, args: argparse.Namespace) -> None:
    store, hasher = Store(servers.client), BlockHasher(ApiSettings().hash)
    print(
        f"hit-rate, {args.clients} clients, {args.workers} workers per server, "
        f"{args.requests} requests per server and shape, in turns\n"
    )
    print(
        "| candidates × tokens | audit off p50 | audit on p50 | on/off "
        "| off p99 | on p99 | on/off |"
    )
    print("|---|---|---|---|---|---|---|")
    p50s = []
    for net, (candidates, tokens) in enumerate(SHAPES, 1):
        doc = _populate(store, hasher, candidates, tokens, net)
        _turns(servers.urls, doc, 40, 2)  # warm both
        t = _turns(servers.urls, doc, args.requests, args.clients)
        on50, off50, on99, off99 = (
            _ms(t[s], q) for s, q in (("on", 50), ("off", 50), ("on", 99), ("off", 99))
        )
        p50s.append(on50)
        print(
            f"| {candidates} × {tokens} | {off50:.2f} ms | {on50:.2f} ms | {on50 / off50:.3f} "
            f"| {off99:.2f} ms | {on99:.2f} ms | {on99 / off99:.3f} |"
        )
    metrics = httpx.get(servers.urls["on"] + "/metrics").text
    counted = [
        line
        for line in metrics.splitlines()
        if line.startswith("cache_indexer_api_audit_records_total")
    ]
    if args.control:
        return
    times = _reports(servers.urls["on"], servers.client, args.reports)
    print(
        f"\noutcome report, one client, {len(times)} reports: p50 {_ms(times, 50):.2f} ms, "
        f"p99 {_ms(times, 99):.2f} ms (hit-rate p50 with the audit on: "
        f"{', '.join(f'{v:.2f}' for v in p50s)} ms)"
    )
    print("records: " + "; ".join(counted))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
