"""Benchmark one ``cache-indexer l1-ingest`` process against a simulated vLLM publisher.

Starts its own redis-server and one ingester (static shard 0/1) on free loopback ports.

1. **Throughput.** The simulator's prefix-cache model pre-generates ``--batches`` engine
   steps (mixed workload, block size 16, ``--per-step`` requests each); the publisher then
   sends them as fast as it can (replay on, so anything a high-water mark drops is
   replayed). Timed from the first to the last applied batch: batches/s, events/s and
   block-hash updates/s (stores + removes) applied by the ingester. For scale, the raw rate
   of pipelined SADD (redis-py, 1,000 commands per pipeline, one member each) on the same
   Redis.
2. **Lag.** At a steady ``--rate`` batches/s for ``--lag-seconds``, the time from
   ``publish()`` to the batch's sequence being visible in Redis (this process polls
   ``OracleStore.last_seq`` in a tight loop): p50 / p99 / max.

3. **Hash self-check cost** (``ingest.l1.hashCheckRate``). The throughput run repeated
   with the check off (rate 0), at the default budget and at an unbounded one
   (``--check-rates``), alternating ``--check-rounds`` times on fresh ingesters so that the
   shared machine's load hits every setting alike; plus, in this process, the CPU time of
   one checked block and of a batch offered to an empty budget.

Usage: ``python scripts/bench_l1_ingest.py [--batches 20000] [--rate 200] [--lag-seconds 10]
[--check-batches 5000] [--check-rounds 3] [--check-rates 0,100,1000000]``.
Needs ``redis-server`` on PATH. Prints Markdown.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import redis
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common.events import BlockRemoved, BlockStored, Event
from common.store import Instance
from services.simulator.engine import SimulatedVLLM
from services.simulator.workload import Workload
from tests.store_oracle import OracleStore

from bench_util import free_port, stop, wait_for

IP = "127.0.0.9"


def _start(workdir: Path) -> tuple[subprocess.Popen[bytes], subprocess.Popen[bytes], str]:
    port = free_port()
    rds = subprocess.Popen(
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
            "--dir",
            str(workdir),
        ],
        stdout=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url)
    wait_for(lambda: _pings(client), "redis-server", 120, interval=0.001)
    return rds, _ingester(workdir, url), url


def _ingester(
    workdir: Path, url: str, hash_check_rate: int | None = None
) -> subprocess.Popen[bytes]:
    l1: dict[str, object] = {
        "topic": "kv-events",
        "backoffInitial": "50ms",
        "backoffMax": "1s",
        "replayTimeout": "5s",
    }
    if hash_check_rate is not None:
        l1["hashCheckRate"] = hash_check_rate
    config = workdir / f"config-{hash_check_rate}.yaml"
    config.write_text(
        yaml.safe_dump({"redis": {"url": url}, "log": {"level": "warning"}, "ingest": {"l1": l1}})
    )
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.cli",
            "l1-ingest",
            "--config",
            str(config),
            "--shard",
            "0",
            "--shards",
            "1",
        ],
        cwd=ROOT,
    )


Runs = dict[int, list[tuple[float, float]]]


def check_comparison(
    workdir: Path,
    url: str,
    store: OracleStore,
    batches: int,
    per_step: int,
    rates: list[int],
    rounds: int,
) -> Runs:
    """Per hashCheckRate, ``rounds`` alternating runs each on a fresh ingester: (batches/s,
    ingester CPU µs per batch). CPU time is what the check adds; wall-clock throughput on a
    shared machine mostly measures the other jobs."""
    out: Runs = {rate: [] for rate in rates}
    for r in range(rounds):
        for rate in rates:
            ingester = _ingester(workdir, url, rate)
            try:
                t = throughput(
                    store, batches, per_step, uid=f"uid-check-{rate}-{r}", pid=ingester.pid
                )
            finally:
                stop(ingester)
            store.remove_instance(IP)
            out[rate].append(
                (t["batches"] / t["seconds"], t["ingester_cpu_seconds"] / t["batches"] * 1e6)
            )
    return out


def check_cost(batches: int, per_step: int) -> tuple[float, float, float, int]:
    """In this process, over ``batches`` simulated engine steps: µs per checked block, µs per
    batch offered to an empty budget, µs per batch with budget left but nothing checkable
    (every store chains from a block the checker never verified), blocks checked."""
    from common.blockhash import HashSettings
    from services.l1_ingest.hashcheck import HashChecker

    sim = _sim(batches, 16)
    workload = Workload("mixed", prompts=256, prompt_len=1024, block_size=16, seed=1)
    steps = [sim.models[0].step([workload.next() for _ in range(per_step)]) for _ in range(batches)]
    sim.close()
    checker = HashChecker("bench", HashSettings(), 1e12)
    per_block = _per(steps, checker.offer) * len(steps) / max(1, checker.ok)
    empty = HashChecker("bench", HashSettings(), 1e-9)
    empty._tokens = 0.0  # noqa: SLF001 - the budget is spent
    per_empty = _per(steps, empty.offer)
    children = [
        [e for e in events if not (isinstance(e, BlockStored) and e.parent_block_hash is None)]
        for events in steps
    ]
    idle = HashChecker("bench", HashSettings(), 1e12)
    per_scan = _per(children, idle.offer)
    assert idle.ok == 0
    return per_block, per_empty, per_scan, checker.ok


def _per(steps: list[list[Event]], offer: Callable[[list[Event]], None]) -> float:
    """CPU µs per call of ``offer`` over ``steps`` (CPU time: the machine is shared)."""
    started = time.process_time()
    for events in steps:
        offer(events)
    return (time.process_time() - started) / len(steps) * 1e6


def search_cost() -> float:
    """CPU ms of one fruitless search for an explanation (every candidate tried)."""
    from common.blockhash import BlockHasher, HashSettings
    from services.l1_ingest.hashcheck import HashChecker
    from services.simulator.cache_model import PrefixCacheModel, Request

    odd = BlockHasher(HashSettings(seed="a seed nobody tries"))
    events = PrefixCacheModel(8, 16, odd).step([Request(tuple(range(16)), "salt")])
    checker = HashChecker("bench", HashSettings(), 1000)
    started = time.process_time()
    checker.offer(events)
    assert checker.hint is None and checker.mismatch == 1
    return (time.process_time() - started) * 1000


def _pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False


def _sim(batches: int, block_size: int) -> SimulatedVLLM:
    return SimulatedVLLM(
        f"tcp://*:{free_port()}",
        f"tcp://*:{free_port()}",
        "kv-events",
        vllm_version="0.28.0",
        block_size=block_size,
        num_blocks=4096,
        buffer_steps=batches + 10,
    )


def _register(store: OracleStore, sim: SimulatedVLLM, uid: str) -> None:
    store.upsert_instance(
        Instance(
            ip=IP,
            uid=uid,
            zmq_endpoint=sim.endpoint.replace("*", "127.0.0.1"),
            replay_endpoint=sim.replay_endpoint.replace("*", "127.0.0.1"),
        )
    )

    def joined() -> bool:  # no-op batches until the ingester has applied one
        if store.last_seq(IP, 0) is not None:
            return True
        sim.reset_prefix_cache()
        threading.Event().wait(0.01)
        return False

    wait_for(joined, "the ingester to join", 120, interval=0.001)


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def throughput(
    store: OracleStore,
    batches: int,
    per_step: int,
    uid: str = "uid-throughput",
    pid: int | None = None,
) -> dict[str, float]:
    sim = _sim(batches, 16)
    _register(store, sim, uid)
    workload = Workload("mixed", prompts=256, prompt_len=1024, block_size=16, seed=1)
    model = sim.models[0]
    steps: list[list[Event]] = []
    while len(steps) < batches:
        events = model.step([workload.next() for _ in range(per_step)])
        if events:
            steps.append(events)
    n_events = sum(len(s) for s in steps)
    n_hashes = sum(
        len(e.block_hashes) for s in steps for e in s if isinstance(e, (BlockStored, BlockRemoved))
    )
    payloads_start = sim.last_seq() + 1
    cpu_start = _cpu_seconds(pid) if pid else 0.0
    started = time.perf_counter()
    for events in steps:
        sim.publishers[0].publish(events)
    sim.flush()
    published = time.perf_counter() - started
    last = payloads_start + batches - 1
    wait_for(lambda: (store.last_seq(IP, 0) or -1) >= last, "the last batch", 120, interval=0.001)
    elapsed = time.perf_counter() - started
    cpu = _cpu_seconds(pid) - cpu_start if pid else 0.0
    sim.close()
    return {
        "batches": batches,
        "events": n_events,
        "hashes": n_hashes,
        "seconds": elapsed,
        "publish_seconds": published,
        "ingester_cpu_seconds": cpu,
    }


def raw_sadd(client: redis.Redis, members: int) -> float:
    client.delete("bench:raw")
    started = time.perf_counter()
    pipe = client.pipeline(transaction=False)
    for i in range(members):
        pipe.sadd("bench:raw", i * 2654435761 % (1 << 64))
        if i % 1000 == 999:
            pipe.execute()
    pipe.execute()
    elapsed = time.perf_counter() - started
    client.delete("bench:raw")
    return members / elapsed


def lag(store: OracleStore, rate: float, seconds: float, per_step: int) -> list[float]:
    sim = _sim(int(rate * seconds) + 10, 16)
    _register(store, sim, "uid-lag")
    workload = Workload("mixed", prompts=64, prompt_len=512, block_size=16, seed=2)
    sent: dict[int, float] = {}
    seen: dict[int, float] = {}
    done, pause = threading.Event(), threading.Event()

    def watch() -> None:
        last = store.last_seq(IP, 0) or -1
        while not done.is_set() or last < max(sent, default=-1):
            now_seq = store.last_seq(IP, 0) or -1
            stamp = time.perf_counter()
            for s in range(last + 1, now_seq + 1):
                seen[s] = stamp
            last = max(last, now_seq)
            pause.wait(0.0002)

    watcher = threading.Thread(target=watch)
    watcher.start()
    period, next_at, end = 1.0 / rate, time.perf_counter(), time.perf_counter() + seconds
    while time.perf_counter() < end:
        events = sim.models[0].step([workload.next() for _ in range(per_step)])
        if events:
            stamp = time.perf_counter()
            sent[sim.publishers[0].publish(events)] = stamp
        next_at += period
        pause.wait(max(0.0, next_at - time.perf_counter()))
    done.set()
    watcher.join()
    sim.close()
    return sorted(seen[s] - t for s, t in sent.items() if s in seen)


def _pct(values: list[float], p: float) -> float:
    return values[min(len(values) - 1, int(p * len(values)))] * 1000


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, default=20_000)
    ap.add_argument("--per-step", type=int, default=4, help="requests per engine step")
    ap.add_argument("--rate", type=float, default=200.0, help="batches/s for the lag test")
    ap.add_argument("--lag-seconds", type=float, default=10.0)
    ap.add_argument("--check-batches", type=int, default=5_000)
    ap.add_argument("--check-rounds", type=int, default=3)
    ap.add_argument(
        "--check-rates",
        default="0,100,1000000",
        help="hashCheckRate values compared (blocks/s per instance)",
    )
    ap.add_argument(
        "--check-only", action="store_true", help="only the hash self-check comparison (part 3)"
    )
    args = ap.parse_args()
    rates = [int(r) for r in args.check_rates.split(",")]
    workdir = Path(tempfile.mkdtemp(prefix="bench-l1-"))
    rds, ingester, url = _start(workdir)
    client = redis.Redis.from_url(url)
    store = OracleStore(client)
    try:
        if args.check_only:
            stop(ingester)
            compared = check_comparison(
                workdir, url, store, args.check_batches, args.per_step, rates, args.check_rounds
            )
            _print_check(compared, *check_cost(2_000, args.per_step), args.check_batches)
            print(f"one fruitless search for an explanation: {search_cost():.1f} ms CPU")
            return 0
        t = throughput(store, args.batches, args.per_step)
        sadd = raw_sadd(client, 200_000)
        store.remove_instance(IP)
        lags = lag(store, args.rate, args.lag_seconds, args.per_step)
        stop(ingester)
        store.remove_instance(IP)
        compared = check_comparison(
            workdir, url, store, args.check_batches, args.per_step, rates, args.check_rounds
        )
    finally:
        if ingester.poll() is None:
            stop(ingester)
        rds.terminate()
        rds.wait(10)
        shutil.rmtree(workdir, ignore_errors=True)
    secs = t["seconds"]
    print("| measure | value |\n|---|---:|")
    print(f"| batches applied/s (one ingester) | {t['batches'] / secs:,.0f} |")
    print(f"| events applied/s | {t['events'] / secs:,.0f} |")
    print(f"| block-hash updates applied/s | {t['hashes'] / secs:,.0f} |")
    print(
        f"| (per batch: events / hashes) | {t['events'] / t['batches']:.1f} / "
        f"{t['hashes'] / t['batches']:.1f} |"
    )
    print(f"| (publisher alone: batches/s) | {t['batches'] / t['publish_seconds']:,.0f} |")
    print(f"| raw pipelined SADD, redis-py, members/s | {sadd:,.0f} |")
    print(f"| lag publish→visible at {args.rate:.0f} batches/s, p50 ms | {_pct(lags, 0.5):.2f} |")
    print(f"| lag p99 ms | {_pct(lags, 0.99):.2f} |")
    print(f"| lag max ms ({len(lags)} batches) | {lags[-1] * 1000:.2f} |")
    _print_check(compared, *check_cost(2_000, args.per_step), args.check_batches)
    print(f"one fruitless search for an explanation: {search_cost():.1f} ms CPU")
    return 0


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def _print_check(
    compared: Runs, per_block: float, per_empty: float, per_scan: float, checked: int, batches: int
) -> None:
    off = compared[min(compared)]
    base_rate, base_cpu = _median([r for r, _ in off]), _median([c for _, c in off])
    print(
        f"\n| hashCheckRate | batches/s per run ({batches} batches) | median | vs off "
        "| ingester CPU µs/batch per run | median | vs off |"
    )
    print("|---:|---|---:|---:|---|---:|---:|")
    for rate, runs in compared.items():
        speed, cpu = _median([r for r, _ in runs]), _median([c for _, c in runs])
        print(
            f"| {rate:,} | {', '.join(f'{r:,.0f}' for r, _ in runs)} | {speed:,.0f} | "
            f"{speed / base_rate - 1:+.1%} | {', '.join(f'{c:,.0f}' for _, c in runs)} | "
            f"{cpu:,.0f} | {cpu / base_cpu - 1:+.1%} |"
        )
    print(
        f"\nin-process: {per_block:.1f} µs per checked block ({checked} blocks); per batch "
        f"{per_empty:.2f} µs with the budget spent, {per_scan:.2f} µs with budget left "
        "but nothing checkable"
    )


if __name__ == "__main__":
    sys.exit(main())
