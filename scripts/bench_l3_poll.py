"""Benchmark one L3 poll of a master holding N keys: time, poller memory, Redis writes.

For each N a fresh child process (so peak RSS is per size) starts a redis-server, registers
8 instances, and starts a fake master in a *separate* process (tests/fake_master.py, 0.3.13
wire format, 16 segments = 8 pods × TP 2, keys ``Bench-Model@tp_rank:{0,1}@…@{sha256 hex}``
placed at random). Then, with ``ingest.l3`` defaults (scope segment, batchSize 200):

* first poll (every key located with /batch_query_keys), steady-state polls (nothing
  located), a poll after 1 % of the blocks were replaced; each followed by the Redis write
  of all 8 instances' sets (``L3Writer.publish``);
* memory: the same first and steady polls again on a fresh index under tracemalloc
  (peak during the poll, and what stays held after it), and the process's peak RSS;
* baseline "naive": whole body in memory (``resp.text.splitlines()``), the regex on every
  key, a dict of key strings, and every key located again on every poll (a stateless
  poller); and ``/query_key`` one key at a time for a 2,000-key sample, extrapolated to N.

With ``--real-master`` the same first/steady polls run against a real ``mooncake_master``
(PyPI 0.3.13.post1) holding N keys put by two store clients (``put_batch``, 16-byte values,
random placement over their two segments); store clients listen on all interfaces, so run
it in a private network namespace.

With ``--hybrid`` the keys are those of a vLLM hybrid instead: per block the TP-2 keys of
full-attention group 0 plus, for every 4th block, those of a sliding-window group 1 (tails):
N keys in all, so the per-group path (one set per group) is measured against the same key
count.

With ``--formats`` it compares the key families instead (scripts/bench_l3_formats.py):
vLLM keys, vllm-ascend normal keys and vllm-ascend layer-wise keys (TP2 × 24 layers, both
layouts), steady-state polls of the same key count side by side in one run.

With ``--relocation`` it measures issue 20's re-location (a key put again elsewhere between
two polls): the current poller (reads the master's removal counters each poll and locates
every key again when they moved) and the previous one (locates new keys only) side by side
in one run, on the same master: first poll, steady polls, a poll after 1 % of the blocks
were replaced by new ones (removals that the vanished keys account for: nothing re-located),
a poll after 1 % of the keys were removed and put again on a random segment (the current
poller lists again and re-locates every key), a steady poll after.

Usage: ``python scripts/bench_l3_poll.py [--sizes 100000,1000000]``,
``python scripts/bench_l3_poll.py --relocation --sizes 1000000``,
``python scripts/bench_l3_poll.py --hybrid --sizes 1000000``,
``python scripts/bench_l3_poll.py --formats --sizes 1000000`` and
``unshare -n sh -c 'ip link set lo up && python scripts/bench_l3_poll.py --real-master'``.
Prints Markdown.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import threading
import time
import tracemalloc
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common.settings import L3PollerSettings  # noqa: E402
from common.store import Instance, Store  # noqa: E402
from services.l3_poller.client import Churn, MasterClient, parse_batch_body  # noqa: E402
from tests.keys_oracle import parse_key  # noqa: E402
from services.l3_poller.metrics import PollerMetrics  # noqa: E402
from services.l3_poller.poller import MasterPoller  # noqa: E402
from services.l3_poller.writer import L3Writer  # noqa: E402
from tests.conftest import RedisServer  # noqa: E402
from tests.fake_master import FakeMaster  # noqa: E402
from tests.metrics_oracle import value_of  # noqa: E402

sys.path.insert(0, str(ROOT / "scripts"))
import bench_l3_formats  # noqa: E402

PODS = [f"10.0.0.{i}" for i in range(1, 9)]


# -- the fake master process ------------------------------------------------------------


def _block_keys(
    rng: random.Random, n_blocks: int, eps: list[str], hybrid: bool = False
) -> dict[str, tuple[str, ...]]:
    """TP-2 keys of ``n_blocks`` blocks; ``hybrid``: group 1 too at every 4th block (so
    ``n_blocks`` is scaled by the caller to keep the key count)."""
    keys: dict[str, tuple[str, ...]] = {}
    for i in range(n_blocks):
        digest = rng.randbytes(32).hex()
        for group in (0, 1) if hybrid and i % 4 == 3 else (0,):
            for tp in (0, 1):
                keys[f"Bench-Model@tp_rank:{tp}@pcp0@dcp0@pp_rank:0@group:{group}@{digest}"] = (
                    rng.choice(eps),
                )
    return keys


def _blocks_for(n_keys: int, hybrid: bool) -> int:
    return n_keys * 4 // 10 if hybrid else n_keys // 2  # hybrid: 2.5 keys per block


def serve(n_keys: int, family: str = "") -> None:
    """Child: serve N keys; on stdin ``churn F`` replace a fraction F of the blocks
    (``family`` "hybrid": the hybrid keys of ``_block_keys``)."""
    hybrid = family == "hybrid"
    family = "" if hybrid else family
    rng = random.Random(7)
    master = FakeMaster("0.3.13")
    master.record_paths = False
    eps = [master.mount(f"{ip}:{12300 + r}", f"{ip}:{15000 + r}") for ip in PODS for r in (0, 1)]
    master.set_keys(
        bench_l3_formats.family_keys(rng, family, n_keys, eps)
        if family
        else _block_keys(rng, _blocks_for(n_keys, hybrid), eps, hybrid)
    )
    master.all_keys_body()
    master.start()
    print(master.url, flush=True)
    for line in sys.stdin:
        cmd, frac = line.split()[0], float(line.split()[1])
        keys = list(master.keys.items())
        if cmd == "move":  # a fraction of the keys removed and put again elsewhere
            moved = rng.sample(keys, int(len(keys) * frac))
            master.set_keys({**dict(keys), **{k: (rng.choice(eps),) for k, _ in moved}})
            master.all_keys_body()
            print("ok", flush=True)
            continue
        cut = int(len(keys) * frac) // 2 * 2
        master.set_keys(
            {**dict(keys[cut:]), **_block_keys(rng, _blocks_for(cut, hybrid), eps, hybrid)}
        )
        master.all_keys_body()
        print("ok", flush=True)


def put_client(n_keys: int, host: str, master: str) -> None:
    """Child: a store client putting N TP-2 keys, kept alive until stdin closes."""
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    assert store.setup(host, "P2PHANDSHAKE", 512 << 20, 16 << 20, "tcp", "", master) == 0
    rng = random.Random(host)
    keys = [
        f"Bench-Model@tp_rank:{tp}@pcp0@dcp0@pp_rank:0@group:0@{digest}"
        for digest in (rng.randbytes(32).hex() for _ in range(n_keys // 2))
        for tp in (0, 1)
    ]
    for i in range(0, len(keys), 1000):
        assert store.put_batch(keys[i : i + 1000], [b"x" * 16] * len(keys[i : i + 1000])) == 0
    print("ok", flush=True)
    sys.stdin.read()


def real_master(n_keys: int) -> dict[str, Any]:
    """First and steady polls against a real master (run inside a network namespace)."""
    rpc, admin = 50551, 19003
    master = subprocess.Popen(
        [
            "mooncake_master",
            "--rpc_address=127.0.0.1",
            f"--rpc_port={rpc}",
            "--metrics_host=127.0.0.1",
            f"--metrics_port={admin}",
            "--enable_metric_reporting=false",
        ],
        stderr=subprocess.DEVNULL,
    )
    clients: list[subprocess.Popen[str]] = []
    redis_server = RedisServer().start()
    try:
        url = f"http://127.0.0.1:{admin}"
        _wait_http(url + "/health")
        t = time.perf_counter()
        for host in ("127.0.0.2", "127.0.0.3"):
            clients.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        __file__,
                        "--put",
                        str(n_keys // 2),
                        "--host",
                        host,
                        "--master",
                        f"127.0.0.1:{rpc}",
                    ],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.DEVNULL,
                    text=True,
                )
            )
        for c in clients:
            assert c.stdout is not None and c.stdout.readline().strip() == "ok"
        out: dict[str, Any] = {"keys": n_keys, "put_s": time.perf_counter() - t}
        import redis

        store = Store(redis.Redis.from_url(redis_server.url))
        for ip in ("127.0.0.2", "127.0.0.3"):
            store.upsert_instance(Instance(ip=ip, uid=ip))
        metrics = PollerMetrics.register()
        writer = L3Writer(store, "segment", metrics)
        cfg = L3PollerSettings(http_timeout=60.0, poll_interval=60.0)
        poller = MasterPoller(
            url, cfg, MasterClient(url, 60.0, 60.0), writer, metrics, threading.Event()
        )
        writer.enroll(url, poller)
        for name in ("first", "steady"):
            wall, cpu = time.perf_counter(), time.process_time()
            view = poller.poll_once()
            out[name] = {
                "wall_s": time.perf_counter() - wall,
                "cpu_s": time.process_time() - cpu,
                "blocks": view.blocks.complete,
            }
            t = time.perf_counter()
            assert writer.publish(url, view, owner=poller)
            out[name]["redis_write_s"] = time.perf_counter() - t
        out["located"] = value_of(metrics.keys_located, master=url)
        return out
    finally:
        for c in clients:
            c.kill()
        master.terminate()
        master.wait(10)
        redis_server.cleanup()


def _wait_http(url: str) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            httpx.get(url)
            return
        except httpx.HTTPError:
            time.sleep(0.05)
    raise RuntimeError(f"{url} did not answer")


# -- the measuring process --------------------------------------------------------------


class Bench:
    def __init__(self, n_keys: int, hybrid: bool = False) -> None:
        self.n = n_keys
        self.redis = RedisServer().start()
        import redis

        self.store = Store(redis.Redis.from_url(self.redis.url))
        for ip in PODS:
            self.store.upsert_instance(Instance(ip=ip, uid=ip))
        self.server = subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--serve",
                str(n_keys),
                *(["--family", "hybrid"] if hybrid else []),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.server.stdout is not None
        self.url = self.server.stdout.readline().strip()
        self.cfg = L3PollerSettings(http_timeout=60.0, poll_interval=60.0)
        self.metrics = PollerMetrics.register()
        self.writer = L3Writer(self.store, "segment", self.metrics)
        self.out: dict[str, Any] = {"keys": n_keys}

    def poller(self, previous: bool = False) -> MasterPoller:
        client = (_PreviousClient if previous else MasterClient)(self.url, 60.0, 60.0)
        poller = MasterPoller(
            self.url, self.cfg, client, self.writer, self.metrics, threading.Event()
        )
        self.writer.enroll(self.url, poller)
        return poller

    def poll(self, poller: MasterPoller, name: str, write: bool = True) -> None:
        located = value_of(self.metrics.keys_located, master=self.url)
        wall, cpu = time.perf_counter(), time.process_time()
        view = poller.poll_once()
        row = {
            "wall_s": time.perf_counter() - wall,
            "cpu_s": time.process_time() - cpu,
            "located": value_of(self.metrics.keys_located, master=self.url) - located,
            "blocks": view.blocks.complete,
        }
        if write:
            t = time.perf_counter()
            assert self.writer.publish(self.url, view, owner=poller)
            row["redis_write_s"] = time.perf_counter() - t
        self.out[name] = row

    def churn(self, frac: float, cmd: str = "churn") -> None:
        assert self.server.stdin is not None and self.server.stdout is not None
        self.server.stdin.write(f"{cmd} {frac}\n")
        self.server.stdin.flush()
        assert self.server.stdout.readline().strip() == "ok"

    def timing(self) -> None:
        poller = self.poller()
        self.poll(poller, "first")
        self.poll(poller, "steady")
        self.poll(poller, "steady2")
        self.churn(0.01)
        self.poll(poller, "churn_1pct")
        self.out["rss_after_polls_MB"] = _rss_mb()

    def relocation(self) -> None:
        """The current and the previous poller side by side, poll for poll."""
        pollers = {"current": self.poller(), "previous": self.poller(previous=True)}
        for step in RELOCATION_STEPS:
            if step == "churn_1pct":
                self.churn(0.01)
            elif step == "moved_1pct":
                self.churn(0.01, "move")
            for name, poller in pollers.items():
                self.poll(poller, f"{name}:{step}", write=False)

    def memory(self) -> None:
        poller = self.poller()
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        poller.poll_once()
        held, peak = tracemalloc.get_traced_memory()
        self.out["mem_first"] = {
            "peak_B_per_key": (peak - base) / self.n,
            "held_B_per_key": (held - base) / self.n,
        }
        tracemalloc.reset_peak()
        poller.poll_once()
        held, peak = tracemalloc.get_traced_memory()
        self.out["mem_steady"] = {
            "peak_B_per_key": (peak - base) / self.n,
            "held_B_per_key": (held - base) / self.n,
        }
        tracemalloc.stop()

    def naive(self) -> None:
        """Stateless baseline: whole body, regex per key, locate everything again."""
        http = httpx.Client(timeout=60)
        t = time.perf_counter()
        lines = http.get(self.url + "/get_all_keys").text.splitlines()
        parsed = {k: p for k in lines if (p := parse_key(k)) is not None}
        t_parse = time.perf_counter() - t
        keys = list(parsed)
        for i in range(0, len(keys), 200):
            parse_batch_body(
                http.get(self.url + "/batch_query_keys?keys=" + ",".join(keys[i : i + 200])).content
            )
        self.out["naive_poll"] = {"wall_s": time.perf_counter() - t, "parse_s": t_parse}
        del lines, parsed, keys
        tracemalloc.start()
        body = http.get(self.url + "/get_all_keys").text
        lines = body.splitlines()
        parsed = {k: p for k in lines if (p := parse_key(k)) is not None}
        self.out["naive_mem_B_per_key"] = tracemalloc.get_traced_memory()[1] / self.n
        tracemalloc.stop()
        del body, lines
        sample = list(parsed)[:2000]
        t = time.perf_counter()
        for key in sample:
            http.get(self.url + "/query_key?key=" + key)
        self.out["query_key_per_key_ms"] = (time.perf_counter() - t) / len(sample) * 1000
        http.close()

    def close(self) -> None:
        assert self.server.stdin is not None
        self.server.stdin.close()
        self.server.wait(30)
        self.redis.cleanup()


def _rss_mb() -> float:
    """Peak RSS of this process so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


RELOCATION_STEPS = ("first", "steady", "steady2", "churn_1pct", "moved_1pct", "steady_after")


class _PreviousClient(MasterClient):
    """The poller before issue 20: no removal counters read, so no key is located again."""

    def removals(self) -> Churn | None:
        return Churn(0, 0)


def child(n_keys: int, hybrid: bool = False, relocation: bool = False) -> None:
    bench = Bench(n_keys, hybrid)
    if relocation:
        try:
            bench.relocation()
        finally:
            bench.close()
        print(json.dumps(bench.out), flush=True)
        return
    try:
        bench.out["rss_before_MB"] = _rss_mb()
        bench.timing()
        bench.memory()
        bench.naive()
    finally:
        bench.close()
    print(json.dumps(bench.out), flush=True)


def report(rows: list[dict[str, Any]]) -> None:
    print("| keys | poll | wall s | poller CPU s | keys located | Redis write s (8 inst.) |")
    print("|---:|---|---:|---:|---:|---:|")
    for r in rows:
        for name in ("first", "steady", "steady2", "churn_1pct"):
            p = r[name]
            print(
                f"| {r['keys']:,} | {name} | {p['wall_s']:.2f} | {p['cpu_s']:.2f} | "
                f"{int(p['located']):,} | {p['redis_write_s']:.2f} |"
            )
        n, q = r["keys"], r["query_key_per_key_ms"]
        print(
            f"| {n:,} | baseline: naive stateless poll | {r['naive_poll']['wall_s']:.2f} | "
            f"– | {n:,} | – |"
        )
        print(
            f"| {n:,} | baseline: /query_key per key (2,000 sampled, extrapolated) | "
            f"{q * n / 1000:.0f} | – | {n:,} | – |"
        )
    print()
    print(
        "| keys | first poll peak B/key | steady peak B/key | held B/key | peak RSS MB "
        "(RSS before) | naive parse peak B/key |"
    )
    print("|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['keys']:,} | {r['mem_first']['peak_B_per_key']:.0f} | "
            f"{r['mem_steady']['peak_B_per_key']:.0f} | "
            f"{r['mem_steady']['held_B_per_key']:.0f} | "
            f"{r['rss_after_polls_MB']:.0f} ({r['rss_before_MB']:.0f}) | "
            f"{r['naive_mem_B_per_key']:.0f} |"
        )


def report_relocation(rows: list[dict[str, Any]]) -> None:
    print("| keys | poll | current: wall s | keys located | previous: wall s | keys located |")
    print("|---:|---|---:|---:|---:|---:|")
    for r in rows:
        for step in RELOCATION_STEPS:
            cur, prev = r[f"current:{step}"], r[f"previous:{step}"]
            print(
                f"| {r['keys']:,} | {step} | {cur['wall_s']:.2f} | {int(cur['located']):,} | "
                f"{prev['wall_s']:.2f} | {int(prev['located']):,} |"
            )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="100000,1000000")
    p.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    p.add_argument("--child", type=int, help=argparse.SUPPRESS)
    p.add_argument("--real-master", action="store_true", help="measure a real mooncake_master")
    p.add_argument("--put", type=int, help=argparse.SUPPRESS)
    p.add_argument("--host", help=argparse.SUPPRESS)
    p.add_argument("--master", help=argparse.SUPPRESS)
    p.add_argument("--formats", action="store_true", help="compare the key families")
    p.add_argument(
        "--relocation", action="store_true", help="re-location: current vs previous poller"
    )
    p.add_argument("--family", default="", help=argparse.SUPPRESS)
    p.add_argument(
        "--hybrid",
        action="store_true",
        help="a vLLM hybrid's keys: group 0 everywhere, group 1 at every 4th block",
    )
    args = p.parse_args()
    if args.put:
        put_client(args.put, args.host, args.master)
        return
    if args.real_master:
        print("| keys | put s | poll | wall s | poller CPU s | Redis write s (2 inst.) |")
        print("|---:|---:|---|---:|---:|---:|")
        for n in (int(s) for s in args.sizes.split(",")):
            r = real_master(n)
            for name in ("first", "steady"):
                q = r[name]
                print(
                    f"| {n:,} | {r['put_s']:.1f} | {name} | {q['wall_s']:.2f} | "
                    f"{q['cpu_s']:.2f} | {q['redis_write_s']:.2f} |",
                    flush=True,
                )
        return
    if args.serve:
        serve(args.serve, args.family)
        return
    if args.formats:
        bench_l3_formats.report(
            [bench_l3_formats.compare(int(n), __file__) for n in args.sizes.split(",")]
        )
        return
    if args.child:
        child(args.child, args.hybrid, args.relocation)
        return
    rows = []
    for n in (int(s) for s in args.sizes.split(",")):
        out = subprocess.run(
            [
                sys.executable,
                __file__,
                "--child",
                str(n),
                *(["--hybrid"] if args.hybrid else []),
                *(["--relocation"] if args.relocation else []),
            ],
            check=True,
            capture_output=True,
            text=True,
            env={**os.environ},
        )
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    (report_relocation if args.relocation else report)(rows)


if __name__ == "__main__":
    main()
