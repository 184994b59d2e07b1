"""Normal hit-rate requests while N connections stall mid-request: stock gthread vs the API worker.

Starts its own redis-server and two gunicorn servers of the same app
(``services.api.app:get_app()``, 2 workers × 4 threads, default ``http.*`` deadlines): one
with gunicorn's stock ``gthread`` worker (before issue 13), one with
:class:`services.api.transport.worker.DeadlineWorker`. For each N it opens N connections to each
server that send part of a request and stop (half mid-headers, half mid-body), then sends
``--requests`` normal requests (8 candidates × 4,096 tokens, one keep-alive client, 5 s
client timeout; it gives up after 5 time-outs) and prints p50/p99 latency of the answered
ones and how many timed out.

Usage: ``python scripts/bench_api_stalls.py [--stalled 0,8,100,400] [--requests 200]``.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_api import BLOCK, Servers, _pct, _prompt
from bench_util import free_port, wait_for

ROOT = Path(__file__).resolve().parent.parent
WORKERS = {"stock gthread": "gthread", "API worker": "services.api.transport.worker.DeadlineWorker"}


def _stall(port: int, count: int, body: bytes) -> list[socket.socket]:
    head = (
        f"POST /kv-cache/hit-rate HTTP/1.1\r\nHost: b\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    socks = []
    for i in range(count):
        sock = socket.create_connection(("127.0.0.1", port))
        sock.sendall(head[:30] if i % 2 else head + body[:100])
        socks.append(sock)
    return socks


def _measure(url: str, body: bytes, requests: int) -> tuple[list[float], int, int]:
    """Latencies of the answered requests, failures, requests sent (stops after 5 failures)."""
    latencies, failed, sent = [], 0, 0
    with httpx.Client(timeout=5) as client:
        while sent < requests and failed < 5:
            sent += 1
            start = time.perf_counter()
            try:
                ok = client.post(url, content=body).status_code == 200
            except httpx.TimeoutException:
                ok = False
            if ok:
                latencies.append(time.perf_counter() - start)
            else:
                failed += 1
    return latencies, failed, sent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stalled", default="0,8,100,400")
    parser.add_argument("--requests", type=int, default=200)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-stalls-"))
    servers = Servers(tmp, 2)
    try:
        from common.blockhash import BlockHasher
        from common.settings import ApiSettings
        from common.store import Store

        body = _prompt(BlockHasher(ApiSettings().hash), Store(servers.client), 4096, 8, 43)[0]
        config = tmp / "config.yaml"
        config.write_text(
            f"log:\n  level: error\nredis:\n  url: redis://127.0.0.1:{servers.redis_port}/0\n"
        )
        env = {**servers.env, "CACHE_INDEXER_CONFIG": str(config)}
        ports = {}
        for name, worker in WORKERS.items():
            ports[name] = free_port()
            servers._start(
                [
                    sys.executable,
                    "-m",
                    "gunicorn",
                    "-w",
                    "2",
                    "--threads",
                    "4",
                    "-k",
                    worker,
                    "--log-level",
                    "warning",
                    "--bind",
                    f"127.0.0.1:{ports[name]}",
                    "services.api.app:get_app()",
                ],
                env,
            )
            wait_for(
                lambda p=ports[name]: httpx.get(f"http://127.0.0.1:{p}/healthz").status_code == 200,
                name,
                30,
                tolerate=(httpx.HTTPError,),
            )
        print(f"{os.cpu_count()} CPUs shared by client, servers and Redis; block {BLOCK}\n")
        print("| worker | stalled connections | p50 ms | p99 ms | timed out (5 s) |")
        print("|---|---:|---:|---:|---:|")
        for count in (int(n) for n in args.stalled.split(",")):
            for name, port in ports.items():
                stalled = _stall(port, count, body)
                lat, failed, sent = _measure(
                    f"http://127.0.0.1:{port}/kv-cache/hit-rate", body, args.requests
                )
                p50 = f"{_pct(lat, 0.5):.1f}" if lat else "–"
                p99 = f"{_pct(lat, 0.99):.1f}" if lat else "–"
                print(f"| {name} | {count} | {p50} | {p99} | {failed} of {sent} |", flush=True)
                for sock in stalled:
                    sock.close()
    finally:
        servers.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
