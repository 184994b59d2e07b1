"""Benchmark common.events.decode_batch: microseconds per payload, plain msgpack for reference.

Usage: python scripts/bench_events.py [seconds-per-case] [--old-rev REV] [--rounds N]

With ``--old-rev`` the decoder of that git revision (``git archive REV common`` into a
temporary directory) is timed on the same payloads in a child process, alternating with this
checkout's decoder for N rounds, so both see the same machine load; the medians are printed
side by side. Numbers only, no assertions (behaviour is tested in tests/unit/test_events*.py).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import msgpack

ROOT = Path(__file__).resolve().parents[1]
COMMON_ROOT = "BENCH_EVENTS_COMMON_ROOT"  # set for the --old-rev child: whose common to import
sys.path.insert(0, os.environ.get(COMMON_ROOT, str(ROOT)))

from common.events import BlockStored, decode_batch, encode_batch  # noqa: E402

GOLDEN = ROOT / "tests" / "data" / "vllm_golden.json"


def _per_call(fn: Callable[[], object], seconds: float) -> float:
    calls, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        for _ in range(100):
            fn()
        calls += 100
    return elapsed / calls


def _cases() -> list[tuple[str, bytes]]:
    golden = json.loads(GOLDEN.read_text())["versions"]
    cases = []
    for label in ("0.28.0", "0.23.0"):
        section = golden[label]["events_int_hashes"]
        mixed = bytes.fromhex(section["mixed"]["payload_hex"])
        cases.append((f"{label} mixed (3 events)", mixed))
        step4 = bytes.fromhex(section["steps"][3]["payload_hex"])
        cases.append((f"{label} step4 (3 events, 6 blocks)", step4))
    rng = random.Random(0)
    big = [
        BlockStored(
            [rng.getrandbits(64) for _ in range(32)],
            rng.getrandbits(64),
            [rng.randrange(150_000) for _ in range(512)],
            16,
            None,
            "GPU",
            None,
            None,
            0,
            "full_attention",
        )
        for _ in range(8)
    ]
    for version in ((0, 23, 0), (0, 28, 0)):
        payload = encode_batch(big, ts=0.0, data_parallel_rank=0, vllm_version=version)
        cases.append((f"{'.'.join(map(str, version))} 8 x 32 blocks", payload))
    return cases


def _time_decode(payloads: list[bytes], seconds: float) -> list[float]:
    """Seconds per decode_batch call of each payload, with the ``common`` this process has."""
    return [_per_call(lambda p=p: decode_batch(p), seconds) for p in payloads]  # type: ignore[misc]


def _old_decoder(rev: str, tmp: Path) -> Path:
    """The ``common`` package of ``rev``, unpacked under ``tmp``; returns its parent."""
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", rev, "common"], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(tmp)], input=archive, check=True)
    return tmp


def _time_old(old_root: Path, payloads: list[bytes], seconds: float) -> list[float]:
    """This script as a child (``--worker``) importing the old revision's ``common``."""
    out = subprocess.run(
        [sys.executable, __file__, str(seconds), "--worker"],
        input=json.dumps([p.hex() for p in payloads]),
        env={**os.environ, COMMON_ROOT: str(old_root)},
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return [float(x) for x in json.loads(out)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("seconds", nargs="?", type=float, default=0.5)
    parser.add_argument("--old-rev", help="also time this git revision's decoder")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:  # payloads (hex) on stdin, seconds per call on stdout, both JSON
        payloads_in = [bytes.fromhex(h) for h in json.load(sys.stdin)]
        print(json.dumps(_time_decode(payloads_in, args.seconds)))
        return
    names, payloads = zip(*_cases(), strict=True)
    unpack = [
        _per_call(lambda p=p: msgpack.unpackb(p, raw=False, strict_map_key=False), args.seconds)  # type: ignore[misc]
        for p in payloads
    ]
    if not args.old_rev:
        new = _time_decode(list(payloads), args.seconds)
        print(f"{'case':<36} {'bytes':>6} {'decode us':>10} {'unpack us':>10} {'batches/s':>10}")
        for name, p, d, u in zip(names, payloads, new, unpack, strict=True):
            print(f"{name:<36} {len(p):>6} {d * 1e6:>10.1f} {u * 1e6:>10.1f} {1 / d:>10.0f}")
        return
    with tempfile.TemporaryDirectory() as tmp:
        old_root = _old_decoder(args.old_rev, Path(tmp))
        rounds_new, rounds_old = [], []
        for _ in range(args.rounds):  # alternating, so both see the same load
            rounds_new.append(_time_decode(list(payloads), args.seconds))
            rounds_old.append(_time_old(old_root, list(payloads), args.seconds))
    new = [statistics.median(r[i] for r in rounds_new) for i in range(len(names))]
    old = [statistics.median(r[i] for r in rounds_old) for i in range(len(names))]
    print(f"medians of {args.rounds} alternating rounds; old = {args.old_rev}")
    print(f"{'case':<36} {'bytes':>6} {'new us':>8} {'old us':>8} {'old/new':>8} {'unpack us':>10}")
    for name, p, n, o, u in zip(names, payloads, new, old, unpack, strict=True):
        print(
            f"{name:<36} {len(p):>6} {n * 1e6:>8.1f} {o * 1e6:>8.1f} {o / n:>8.2f} {u * 1e6:>10.1f}"
        )


if __name__ == "__main__":
    main()
