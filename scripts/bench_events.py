"""Benchmark common.events.decode_batch: microseconds per payload, plain msgpack for reference.

Usage: python scripts/bench_events.py [seconds-per-case]. Prints one line per case; numbers
only, no assertions (behaviour is tested in tests/unit/test_events*.py).
"""

from __future__ import annotations

import json
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

import msgpack

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.events import BlockStored, decode_batch, encode_batch  # noqa: E402

GOLDEN = Path(__file__).resolve().parents[1] / "tests" / "data" / "vllm_golden.json"


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


def main() -> None:
    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 0.5
    print(f"{'case':<36} {'bytes':>6} {'decode us':>10} {'unpack us':>10} {'batches/s':>10}")
    for name, payload in _cases():
        decode = _per_call(lambda p=payload: decode_batch(p), seconds)  # type: ignore[misc]
        unpack = _per_call(
            lambda p=payload: msgpack.unpackb(p, raw=False, strict_map_key=False),  # type: ignore[misc]
            seconds,
        )
        print(
            f"{name:<36} {len(payload):>6} {decode * 1e6:>10.1f} {unpack * 1e6:>10.1f} "
            f"{1 / decode:>10.0f}"
        )


if __name__ == "__main__":
    main()
