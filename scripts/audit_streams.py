"""Measure the prediction audit's verdicts with concurrent streams that do not wait for the
index: how many answers differ from what the engine reuses, and how many of those the audit
explains (what CacheIndexerPredictionsOff must tolerate).

Starts redis-server and every cache-indexer process (static discovery, L1 ingester, L3
poller, API under gunicorn) for one simulated vLLM pod (tests/integration/fleet.py: 96 GPU
blocks of 16 tokens, so it evicts). Each engine step serves ``--streams`` requests at once;
the next step's questions are asked right after the step is served, before its events are
indexed, and the step's outcomes are reported after that (``cached_tokens`` = the engine
model's hit for the request when it was scheduled). Prints the counts by verdict, cause and
explanation as Markdown.

Usage: ``python scripts/audit_streams.py [--streams 8] [--steps 25] [--seed 3]``.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from services.simulator.cache_model import Request
from services.simulator.workload import Workload
from tests.conftest import RedisServer, child_env
from tests.fake_master import FakeMaster
from tests.integration.fleet import BLOCK, Fleet, start_stack
from tests.store_oracle import OracleStore

IP = "127.0.0.91"


class Streams:
    def __init__(self, api: int, fleet: Fleet) -> None:
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{api}", timeout=10)
        self.sim = fleet.sims[IP]
        self.ids = itertools.count()
        self.results: collections.Counter[tuple[Any, ...]] = collections.Counter()

    def ask(self, batch: list[Request]) -> list[str]:
        rids = []
        for r in batch:
            rid = f"s-{next(self.ids)}"
            body = {"token_ids": list(r.token_ids), "block_size": BLOCK}
            body["cache_salt"] = r.cache_salt or ""
            doc = {"server_ip": [IP], "request_id": rid, "body": body}
            self.http.post("/kv-cache/hit-rate", json=doc).raise_for_status()
            rids.append(rid)
        return rids

    def report(self, rids: list[str], batch: list[Request], cached: list[int]) -> None:
        for rid, r, c in zip(rids, batch, cached, strict=True):
            body = {"request_id": rid, "server_ip": IP, "cached_tokens": c}
            body["prompt_tokens"] = len(r.token_ids)
            for _ in range(100):  # the record reaches Redis within ~20 ms
                resp = self.http.post("/kv-cache/outcome", json=body)
                if resp.status_code != 404:
                    break
                time.sleep(0.02)
            doc = resp.json()
            self.results[(doc.get("verdict"), doc.get("cause"), doc.get("explained"))] += 1

    def run(self, workload: Workload, streams: int, steps: int) -> None:
        batch = [workload.next() for _ in range(streams)]
        rids = self.ask(batch)
        for _ in range(steps):
            cached = [self.sim.true_hit_tokens(r) for r in batch]  # at scheduling
            self.sim.serve(batch)
            self.sim.flush()
            following = [workload.next() for _ in range(streams)]
            following_ids = self.ask(following)  # before this step is indexed
            self.report(rids, batch, cached)
            batch, rids = following, following_ids
        self.report(rids, batch, [self.sim.true_hit_tokens(r) for r in batch])


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--seed", type=int, default=3)
    args = p.parse_args(argv)
    server = RedisServer().start()
    master = FakeMaster("0.3.13").start()
    fleet = Fleet([IP], master)
    procs: list[Any] = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            store = OracleStore(redis.Redis.from_url(server.url))
            api = start_stack(Path(tmp), procs, child_env(), {"url": server.url}, fleet, store)
            streams = Streams(api, fleet)
            workload = Workload(
                "mixed", prompts=24, prompt_len=256, block_size=BLOCK, seed=args.seed
            )
            streams.run(workload, args.streams, args.steps)
            _print(streams.results, args)
            for proc in procs:
                proc.terminate()
            for proc in procs:
                proc.wait(15)
    finally:
        fleet.close()
        master.stop()
        server.cleanup()
    return 0


def _print(results: collections.Counter[tuple[Any, ...]], args: argparse.Namespace) -> None:
    total = sum(results.values())
    print(f"{args.streams} streams × {args.steps + 1} steps, seed {args.seed}: {total} reports\n")
    print("| verdict | cause | explained | reports |")
    print("|---|---|---|---:|")
    for (verdict, cause, explained), n in results.most_common():
        print(f"| {verdict} | {cause or '-'} | {explained} | {n} |")
    unexplained = sum(n for k, n in results.items() if k[2] is False)
    print(f"\nunexplained: {unexplained} / {total} ({100 * unexplained / max(total, 1):.1f} %)")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
