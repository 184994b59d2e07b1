"""Scale evidence: hit-rate throughput with a small and a 1,000-instance index.

For each backend (one ``redis-server``, and a 3-master Redis Cluster made with
``redis-cli --cluster create``), on free loopback ports:

1. **Small fleet**: ``--small`` instances (default 64) are written through the real store
   operations (``Store.upsert_instance``, ``Store.apply_batch`` with batches of ``--batch``
   stored hashes, ``Store.replace_l3``); each holds ``--blocks`` GPU blocks (default
   10,000): random-length prefixes of 8 of the 32 pool prompts, the rest unrelated hashes,
   and in L3 another prefix of each plus 1,000 unrelated hashes.
2. Load: ``cache-indexer api`` replicas (1 and 3; each its own gunicorn with the config's
   workers) behind round-robin client processes, for two request shapes — 8 candidates ×
   4k tokens and 64 candidates × 32k tokens (block size 128: 32 and 256 blocks). The
   8-candidate requests draw from the first 10 instances (the "10-instance case"), the
   64-candidate ones from the first 64. Also, in this process, ``prefix_lengths`` alone
   (``tests/store_oracle.py``: the single-group reads the API sends in its one pipelined
   round trip, through ``Store.execute``; no HTTP / hashing).
3. **Large fleet**: the index is filled to ``--instances`` (default 1,000) and the same
   load runs again, candidates drawn from all instances. Redis ``used_memory`` (summed
   over the cluster's nodes) after each fill.

Usage: ``python scripts/bench_scale.py [--instances 1000] [--blocks 10000] [--seconds 5]
[--clients 4] [--backends single,cluster]``. Prints Markdown. Needs redis-server and
redis-cli on PATH; uses a lot of memory (~1.2 GB per backend at the defaults).
"""

from __future__ import annotations

import argparse
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import orjson
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common.blockhash import BlockHasher, HashSettings
from common.config import Redis as RedisConfig
from common.redis_client import Client, connect
from common.store import Instance, Store, TierOps
from tests.redis_nodes import Cluster, Node, reserve_port, wait_for
from tests.store_oracle import OracleStore

BLOCK = 128
POOL = 32
SHAPES = (("8 candidates × 4k tokens", 8, 4096, 10), ("64 candidates × 32k tokens", 64, 32768, 64))


def _ip(i: int) -> str:
    return f"10.{i // 65536}.{i // 256 % 256}.{i % 256}"


class Data:
    """The prompt pool (token ids and their block hashes) shared by writer and clients."""

    def __init__(self, seed: int = 1) -> None:
        rng = random.Random(seed)
        hasher = BlockHasher(HashSettings())
        self.prompts = [[rng.randrange(150_000) for _ in range(32768)] for _ in range(POOL)]
        self.ints = [hasher.event_ints(p, BLOCK) for p in self.prompts]
        self.members = [hasher.member_keys(p, BLOCK) for p in self.prompts]


def _fill(store: Store, data: Data, start: int, stop: int, blocks: int, batch: int) -> None:
    rng = random.Random(start)
    for i in range(start, stop):
        ip = _ip(i)
        _, gen = store.upsert_instance(Instance(ip=ip, uid=f"bench-{i}"))
        held: list[int] = []
        l3: list[int] = []
        for p in rng.sample(range(POOL), 8):
            held += data.ints[p][: rng.randrange(len(data.ints[p]) + 1)]
            l3 += data.ints[p][: rng.randrange(len(data.ints[p]) + 1)]
        held += [rng.getrandbits(64) for _ in range(max(0, blocks - len(held)))]
        for seq, off in enumerate(range(0, len(held), batch)):
            ops = TierOps()
            ops.store("l1", held[off : off + batch])
            store.apply_batch(ip, gen, 0, seq, ops)
        store.replace_l3(ip, l3 + [rng.getrandbits(64) for _ in range(1000)], gen=gen)


def _bodies(data: Data, n_inst: int, candidates: int, tokens: int, count: int = 64) -> list[bytes]:
    rng = random.Random(candidates * 7 + n_inst)
    out = []
    for _ in range(count):
        p = rng.randrange(POOL)
        ips = [_ip(i) for i in rng.sample(range(n_inst), candidates)]
        out.append(
            orjson.dumps(
                {
                    "server_ip": ips,
                    "body": {
                        "token_ids": data.prompts[p][:tokens],
                        "block_size": BLOCK,
                        "cache_salt": "",
                    },
                }
            )
        )
    return out


def _client(urls: list[str], bodies: list[bytes], seconds: float, offset: int) -> list[float]:
    latencies: list[float] = []
    clients = [httpx.Client(timeout=30) for _ in urls]
    end = time.perf_counter() + seconds
    i = offset
    while time.perf_counter() < end:
        k = i % len(urls)
        t0 = time.perf_counter()
        r = clients[k].post(
            urls[k], content=bodies[i % len(bodies)], headers={"Content-Type": "application/json"}
        )
        latencies.append(time.perf_counter() - t0)
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {r.text[:200]}")
        i += 1
    for c in clients:
        c.close()
    return latencies


class Tally:
    """Requests and latencies of one case, accumulated over interleaved rounds."""

    def __init__(self) -> None:
        self.lat: list[float] = []
        self.elapsed = 0.0

    def row(self, digits: int = 1) -> str:
        ordered = sorted(self.lat) or [0.0]

        def pct(q: float) -> float:
            return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000

        return f"{self.rate:,.0f} | {pct(0.5):.{digits}f} | {pct(0.99):.{digits}f}"

    @property
    def rate(self) -> float:
        return len(self.lat) / self.elapsed if self.elapsed else 0.0


def _http_round(
    pool: ProcessPoolExecutor,
    urls: list[str],
    bodies: list[bytes],
    seconds: float,
    clients: int,
    tally: Tally,
) -> None:
    t0 = time.perf_counter()
    futures = [pool.submit(_client, urls, bodies, seconds, j * 17) for j in range(clients)]
    tally.lat += [x for f in futures for x in f.result()]
    tally.elapsed += time.perf_counter() - t0


def _direct_round(
    store: Store,
    data: Data,
    n_inst: int,
    candidates: int,
    tokens: int,
    seconds: float,
    tally: Tally,
) -> None:
    rng = random.Random(len(tally.lat))
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        p = rng.randrange(POOL)
        ips = [_ip(i) for i in rng.sample(range(n_inst), candidates)]
        t1 = time.perf_counter()
        store.prefix_lengths(ips, data.members[p][: tokens // BLOCK])
        tally.lat.append(time.perf_counter() - t1)
    tally.elapsed += time.perf_counter() - t0


@contextmanager
def _apis(cfg: RedisConfig, replicas: int, work: Path, tag: str) -> Iterator[list[str]]:
    procs, urls = [], []
    for r in range(replicas):
        port = reserve_port()
        path = work / f"api-{tag}-{r}.yaml"
        path.write_text(
            yaml.safe_dump(
                {
                    "redis": {"url": cfg.url, "cluster": cfg.cluster},
                    "log": {"level": "warning"},
                    "http": {"addr": f"127.0.0.1:{port}"},
                }
            )
        )
        log = (work / f"api-{tag}-{r}.log").open("ab")
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "services.cli", "api", "--config", str(path)],
                cwd=ROOT,
                stdout=log,
                stderr=log,
            )
        )
        urls.append(f"http://127.0.0.1:{port}/kv-cache/hit-rate")
    try:
        for url in urls:
            wait_for(
                lambda u=url: (
                    httpx.get(u.replace("kv-cache/hit-rate", "readyz"), timeout=1).status_code
                    == 200
                ),
                timeout=60,
                what="an API replica",
            )
        yield urls
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            p.wait(30)


def _used_memory(client: Client, cluster: bool) -> int:
    if cluster:
        infos = client.info("memory", target_nodes="primaries")  # type: ignore[call-arg]
        return sum(int(v["used_memory"]) for v in infos.values())
    return int(client.info("memory")["used_memory"])


class Fleet:
    """One backend (server or cluster) holding ``n`` instances, and its candidate pools."""

    def __init__(self, kind: str, n: int, args: argparse.Namespace, data: Data) -> None:
        self.kind, self.n = kind, n
        self.servers: Node | Cluster = Cluster(3) if kind == "cluster" else Node()
        self.servers.start()
        self.cfg = RedisConfig(url=self.servers.url, cluster=kind == "cluster", socket_timeout=30)  # type: ignore[arg-type]
        self.client = connect(self.cfg, retries=3)
        self.store = OracleStore(self.client)
        base = _used_memory(self.client, self.cfg.cluster)
        t0 = time.perf_counter()
        _fill(self.store, data, 0, n, args.blocks, args.batch)
        self.fill_s = time.perf_counter() - t0
        self.memory = _used_memory(self.client, self.cfg.cluster) - base

    def pool(self, small_pool: int) -> int:
        return self.n if self.n > 64 else small_pool

    def close(self) -> None:
        self.client.close()
        self.servers.cleanup()


def _compare(args: argparse.Namespace, fleets: list[Fleet], data: Data, work: Path) -> None:
    """Small and large fleet side by side: rounds alternate between them."""
    rounds = 4
    for shape, candidates, tokens, small_pool in SHAPES:
        bodies = [_bodies(data, f.pool(small_pool), candidates, tokens) for f in fleets]
        direct = [Tally() for _ in fleets]
        for _ in range(rounds):
            for f, t in zip(fleets, direct):
                _direct_round(
                    f.store, data, f.pool(small_pool), candidates, tokens, args.seconds / rounds, t
                )
        for replicas in (1, 3):
            http = [Tally() for _ in fleets]
            with (
                _apis(fleets[0].cfg, replicas, work, "s") as su,
                _apis(fleets[1].cfg, replicas, work, "l") as lu,
                ProcessPoolExecutor(args.clients) as pool,
            ):
                for urls, b in zip((su, lu), bodies):
                    _client(urls, b[:4], 0.5, 0)  # warm-up
                for _ in range(rounds):
                    for urls, b, t in zip((su, lu), bodies, http):
                        _http_round(pool, urls, b, args.seconds / rounds, args.clients, t)
            for f, h, d in zip(fleets, http, direct):
                print(
                    f"| {f.kind} | {f.n:,} ({f.pool(small_pool)}) | {shape} | {replicas} | "
                    f"{h.row()} | {d.row(2)} |",
                    flush=True,
                )
            print(
                f"| {fleets[1].kind} ratio large/small | | {shape} | {replicas} | "
                f"{http[1].rate / http[0].rate:.2f} | | | "
                f"{direct[1].rate / direct[0].rate:.2f} | | |",
                flush=True,
            )


def _backend(args: argparse.Namespace, kind: str, data: Data, work: Path) -> None:
    fleets = [Fleet(kind, args.small, args, data)]
    try:
        fleets.append(Fleet(kind, args.instances, args, data))
        for f in fleets:
            print(
                f"<!-- {kind}: {f.n} instances × {args.blocks} blocks filled in "
                f"{f.fill_s:.0f} s; used_memory +{f.memory / 1e6:,.0f} MB = "
                f"{f.memory / (f.n * args.blocks):.0f} B per L1 block (L3 included) -->",
                flush=True,
            )
        _compare(args, fleets, data, work)
    finally:
        for f in fleets:
            f.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--instances", type=int, default=1000)
    p.add_argument("--small", type=int, default=64)
    p.add_argument("--blocks", type=int, default=10_000)
    p.add_argument("--batch", type=int, default=500, help="stored hashes per apply_batch")
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--backends", default="single,cluster")
    args = p.parse_args()
    data = Data()
    print(
        "| backend | instances (candidate pool) | request | API replicas | HTTP req/s | p50 ms "
        "| p99 ms | prefix_lengths/s | p50 ms | p99 ms |"
    )
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-scale-") as tmp:
        for kind in args.backends.split(","):
            _backend(args, kind, data, Path(tmp))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
