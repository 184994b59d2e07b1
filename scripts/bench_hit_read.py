"""The hit-rate read's cost by candidates × prompt length × block size × holders: this tree
against an older revision (default d9e6241: every block of every candidate by SMISMEMBER),
side by side on the same data in one run.

One ``redis-server`` (or a 3-master Redis Cluster, ``--backend cluster``) holds ``--fleet``
instances written through the real store operations (``upsert_instance``, ``apply_batch``,
``replace_l3``), each with ``--filler`` unrelated L1 hashes and half as many in L3. For every
cell the chosen holders among the cell's candidates get a random-length prefix (uniform in
[0, blocks]) of the prompt's chain in L1 and another in L3 (removed again after the cell).
Two ``cache-indexer api`` servers (one gunicorn worker each) run against it, one from each
revision (the old one from a ``git worktree`` of ``--old-rev``); each cell sends the same
request to both, in alternating turns, one request at a time, and prints p50/p99 end to end
and Redis CPU per request from the server's own ``INFO cpu`` (``used_cpu_user`` +
``used_cpu_sys`` deltas over the turn, summed over the cluster's nodes), and whether both
answered the same. Each side has ``--rounds`` turns per cell (the order alternating), a turn
stopping after ``--seconds`` / rounds (at least ``--min-requests``).

``--options`` instead compares read strategies in this process on one cell (no HTTP, no
hashing): the full read, this tree's read plan (:class:`services.api.scoring.Scorer`) and a
prototype Lua walk (one script call given the chain once, SMISMEMBER in doubling chunks per
set until the first miss; single server only).

Usage: ``python scripts/bench_hit_read.py [--candidates 1,8,64,256,1024]
[--tokens 4096,32768,131072] [--blocks 16,128] [--holders 0,4,all] [--seconds 2]
[--old-rev d9e6241] [--backend single|cluster]``; ``--options`` with one value of each.
Prints Markdown. Benchmarks only, never a test.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import orjson
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import bench_revs

from common import keys
from common.blockhash import BlockHasher, HashSettings
from common.config import Redis as RedisConfig
from common.redis_client import Client, connect
from common.store import Instance, TierOps
from services.api.scoring import EMPTY, Scorer
from tests.redis_nodes import Cluster, Node, reserve_port, wait_for
from tests.store_oracle import OracleStore

MAX_TOKENS = 131_072

LUA_WALK = """
local n, out = #ARGV, {}
for k = 1, #KEYS do
  local run, lo, size = 0, 1, 32
  while lo <= n do
    local hi = math.min(n, lo + size - 1)
    local flags = redis.call('SMISMEMBER', KEYS[k], unpack(ARGV, lo, hi))
    local miss = nil
    for i = 1, #flags do if flags[i] == 0 then miss = i break end end
    if miss then run = lo + miss - 2 break end
    run, lo, size = hi, hi + 1, math.min(size * 2, 4096)
  end
  out[k] = run
end
return out
"""


def _ip(i: int) -> str:
    return f"10.9.{i // 256}.{i % 256}"


class Fleet:
    """The backend, its instances and their write cursors."""

    def __init__(self, backend: str, n: int, filler: int) -> None:
        self.servers: Node | Cluster = Cluster(3) if backend == "cluster" else Node()
        self.servers.start()
        self.cfg = RedisConfig(url=self.servers.url, cluster=backend == "cluster")
        self.client: Client = connect(self.cfg, retries=3)
        self.store = OracleStore(self.client)
        self.cluster = backend == "cluster"
        self.gen: dict[str, int] = {}
        self.seq: dict[str, int] = {}
        self.filler: dict[str, list[int]] = {}
        rng = random.Random(7)
        for i in range(n):
            ip = _ip(i)
            self.gen[ip] = self.store.upsert_instance(Instance(ip=ip, uid=f"b-{i}"))[1]
            self.seq[ip] = 0
            self._write(ip, "S", [rng.getrandbits(63) for _ in range(filler)])
            self.filler[ip] = [rng.getrandbits(63) for _ in range(filler // 2)]
            self.store.replace_l3(ip, self.filler[ip], gen=self.gen[ip])

    def _write(self, ip: str, op: str, hashes: list[int]) -> None:
        for off in range(0, len(hashes), 5000):
            ops = TierOps()
            (ops.store if op == "S" else ops.remove)("l1", hashes[off : off + 5000])
            self.store.apply_batch(ip, self.gen[ip], 0, self.seq[ip], ops)
            self.seq[ip] += 1

    @contextmanager
    def holding(self, held: dict[str, tuple[list[int], list[int]]]) -> Iterator[None]:
        """The holders' L1 and L3 prefixes written for the cell, removed after it."""
        for ip, (l1, l3) in held.items():
            self._write(ip, "S", l1)
            self.store.replace_l3(ip, self.filler[ip] + l3, gen=self.gen[ip])
        try:
            yield
        finally:
            for ip, (l1, _) in held.items():
                self._write(ip, "R", l1)
                self.store.replace_l3(ip, self.filler[ip], gen=self.gen[ip])

    def cpu(self) -> float:
        """Redis' own CPU seconds (user + sys), summed over the nodes."""
        if self.cluster:
            infos = self.client.info("cpu", target_nodes="primaries")  # type: ignore[call-arg]
            return sum(float(v["used_cpu_user"]) + float(v["used_cpu_sys"]) for v in infos.values())
        info = self.client.info("cpu")
        return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])

    def close(self) -> None:
        self.client.close()
        self.servers.cleanup()


@contextmanager
def _api(tree: Path, cfg: RedisConfig, work: Path, tag: str) -> Iterator[str]:
    port = reserve_port()
    path = work / f"api-{tag}.yaml"
    doc = {
        "redis": {"url": cfg.url, "cluster": cfg.cluster},
        "log": {"level": "warning"},
        "http": {"addr": f"127.0.0.1:{port}", "workers": 1},
    }
    path.write_text(yaml.safe_dump(doc))
    log = (work / f"api-{tag}.log").open("ab")
    env = {**os.environ, "PYTHONPATH": str(tree)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "api", "--config", str(path)],
        cwd=tree,
        stdout=log,
        stderr=log,
        env=env,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(
            lambda: httpx.get(f"{url}/readyz", timeout=1).status_code == 200,
            timeout=90,
            what=f"the {tag} API",
        )
        yield f"{url}/kv-cache/hit-rate"
    finally:
        proc.terminate()
        proc.wait(30)


class Turns:
    """Latencies and Redis CPU of one side of a cell."""

    def __init__(self) -> None:
        self.lat: list[float] = []
        self.cpu = 0.0
        self.answer: Any = None

    def pct(self, q: float) -> float:
        ordered = sorted(self.lat)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000

    @property
    def cpu_ms(self) -> float:
        return self.cpu / len(self.lat) * 1000


def _turn(
    http: httpx.Client, url: str, body: bytes, fleet: Fleet, args: argparse.Namespace, t: Turns
) -> None:
    cpu0, start, sent = fleet.cpu(), time.perf_counter(), 0
    while sent < args.min_requests or time.perf_counter() - start < args.seconds / args.rounds:
        t0 = time.perf_counter()
        r = http.post(url, content=body, headers={"Content-Type": "application/json"})
        t.lat.append(time.perf_counter() - t0)
        if r.status_code != 200:
            raise RuntimeError(f"{url}: {r.status_code} {r.text[:200]}")
        t.answer = t.answer or r.json()["server_score_list"]
        sent += 1
        if sent >= args.max_requests:
            break
    t.cpu += fleet.cpu() - cpu0


def _holders(
    rng: random.Random, ints: list[int], candidates: int, spec: str
) -> dict[str, tuple[list[int], list[int]]]:
    count = candidates if spec == "all" else min(int(spec), candidates)
    chosen = rng.sample(range(candidates), count)
    return {
        _ip(i): (ints[: rng.randint(0, len(ints))], ints[: rng.randint(0, len(ints))])
        for i in chosen
    }


def _cells(args: argparse.Namespace) -> Iterator[tuple[int, int, int, str]]:
    for block in _ints(args.blocks):
        for tokens in _ints(args.tokens):
            for candidates in _ints(args.candidates):
                if candidates * (tokens // block) > 1024 * 4096:
                    print(f"<!-- cut: {candidates} × {tokens} × {block}: over the limit -->")
                    continue
                for holders in args.holders.split(","):
                    yield block, tokens, candidates, holders


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def _compare(args: argparse.Namespace, fleet: Fleet, prompt: list[int], work: Path) -> None:
    hasher, rng = BlockHasher(HashSettings()), random.Random(11)
    old = bench_revs._checkout(args.old_rev, work)
    try:
        with (
            _api(old, fleet.cfg, work, "old") as old_url,
            _api(ROOT, fleet.cfg, work, "new") as new_url,
            httpx.Client(timeout=120) as http,
        ):
            print(
                f"| backend | block | tokens | candidates | holders | {args.old_rev} p50 ms "
                "| new p50 ms | old p99 | new p99 | old Redis CPU ms/req | new Redis CPU ms/req "
                "| CPU new/old | p50 new/old | same answers |"
            )
            print("|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
            for block, tokens, candidates, spec in _cells(args):
                ints = hasher.event_ints(prompt[:tokens], block)
                held = _holders(rng, ints, candidates, spec)
                ips = [_ip(i) for i in range(candidates)]
                body = orjson.dumps(
                    {"server_ip": ips, "body": {"token_ids": prompt[:tokens], "block_size": block}}
                )
                sides = [Turns(), Turns()]
                with fleet.holding(held):
                    for rnd in range(args.rounds):
                        order = [(old_url, sides[0]), (new_url, sides[1])]
                        for url, t in order if rnd == 0 else order[::-1]:
                            _turn(http, url, body, fleet, args, t)
                o, n = sides
                print(
                    f"| {args.backend} | {block} | {tokens:,} | {candidates:,} | {spec} | "
                    f"{o.pct(0.5):.1f} | {n.pct(0.5):.1f} | {o.pct(0.99):.1f} | "
                    f"{n.pct(0.99):.1f} | {o.cpu_ms:.2f} | {n.cpu_ms:.2f} | "
                    f"{n.cpu_ms / max(o.cpu_ms, 1e-9):.3f} | {n.pct(0.5) / o.pct(0.5):.2f} | "
                    f"{'yes' if o.answer == n.answer else 'NO'} |",
                    flush=True,
                )
    finally:
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(old)], check=False
        )


def _options(args: argparse.Namespace, fleet: Fleet, prompt: list[int]) -> None:
    """Read strategies in this process on one cell: full read, read plan, Lua walk."""
    hasher = BlockHasher(HashSettings())
    block, tokens, candidates = int(args.blocks), int(args.tokens), int(args.candidates)
    members = hasher.member_keys(prompt[:tokens], block)
    ints = hasher.event_ints(prompt[:tokens], block)
    ips = [_ip(i) for i in range(candidates)]
    held = _holders(random.Random(11), ints, candidates, args.holders)
    walk = fleet.client.register_script(LUA_WALK)
    set_keys = [k for ip in ips for k in (keys.tier_set(ip, "l1"), keys.l3_set(ip))]

    def full() -> Any:
        return fleet.store.prefix_lengths(ips, members)

    def plan() -> Any:
        s = Scorer(tokens, block, lambda unit, lookahead: members, fleet.store)
        for ip in ips:
            s.queue(ip, EMPTY)
        s.execute()
        return s.finish()

    def lua() -> Any:
        return walk(keys=set_keys, args=members)

    strategies = {"full read (SMISMEMBER all)": full, "read plan": plan}
    if not fleet.cluster:
        strategies["Lua walk (one call)"] = lua
    print("| strategy | p50 ms | p99 ms | Redis CPU ms/req |")
    print("|---|---:|---:|---:|")
    with fleet.holding(held):
        stats = {name: Turns() for name in strategies}
        for _ in range(3):
            for name, fn in strategies.items():
                t = stats[name]
                cpu0, start = fleet.cpu(), time.perf_counter()
                while time.perf_counter() - start < args.seconds / 3 or len(t.lat) < 3:
                    t0 = time.perf_counter()
                    fn()
                    t.lat.append(time.perf_counter() - t0)
                t.cpu += fleet.cpu() - cpu0
        for name, t in stats.items():
            print(f"| {name} | {t.pct(0.5):.2f} | {t.pct(0.99):.2f} | {t.cpu_ms:.3f} |")
    runs = lua() if not fleet.cluster else []
    same = all(list(r) == [a, b] for r, a, b in zip(full(), runs[::2], runs[1::2], strict=False))
    print(
        f"<!-- {block} × {tokens:,} × {candidates} candidates, holders {args.holders}; "
        f"the Lua walk's runs equal the full read's: {same} -->"
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--candidates", default="1,8,64,256,1024")
    p.add_argument("--tokens", default="4096,32768,131072")
    p.add_argument("--blocks", default="16,128")
    p.add_argument("--holders", default="0,4,all")
    p.add_argument("--seconds", type=float, default=2.0, help="per side and cell")
    p.add_argument("--rounds", type=int, default=2, help="turns per side and cell, alternating")
    p.add_argument("--min-requests", type=int, default=3, help="per turn")
    p.add_argument("--max-requests", type=int, default=200)
    p.add_argument("--fleet", type=int, default=1024)
    p.add_argument("--filler", type=int, default=2000)
    p.add_argument("--old-rev", default="d9e6241")
    p.add_argument("--backend", default="single", choices=("single", "cluster"))
    p.add_argument("--options", action="store_true")
    args = p.parse_args()
    prompt = [random.Random(3).randrange(150_000) for _ in range(MAX_TOKENS)]
    fleet_size = max(args.fleet, max(_ints(args.candidates)))
    t0 = time.perf_counter()
    fleet = Fleet(args.backend, fleet_size, args.filler)
    print(f"<!-- {fleet_size} instances filled in {time.perf_counter() - t0:.0f} s -->")
    try:
        with tempfile.TemporaryDirectory(prefix="bench-hit-read-") as tmp:
            if args.options:
                _options(args, fleet, prompt)
            else:
                _compare(args, fleet, prompt, Path(tmp))
    finally:
        fleet.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
