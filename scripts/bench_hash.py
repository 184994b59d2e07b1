"""Benchmark block hashing: this project's BlockHasher vs cbor2+hashlib vs vLLM's own hasher.

Same prompts for every column: 4,096 and 131,072 token ids, block size 16 and 128,
``sha256_cbor`` with PYTHONHASHSEED "0", no salt. Token ids are drawn from a 151,936-id
vocabulary either uniformly (the worst case for per-token look-ups: no cache locality) or
Zipf-like (id rank ~ frequency, closer to real text). Columns:

- ``member_keys``: :meth:`BlockHasher.member_keys`, what the API calls per request;
- ``cbor2+hashlib``: vLLM's algorithm spelled out, ``cbor2.dumps(canonical=True)`` and
  ``hashlib.sha256`` per block, in this interpreter;
- ``vLLM``: vLLM's ``get_request_block_hasher`` on a real ``Request``, run in the
  interpreter given by ``--vllm-python`` (scripts/setup_vllm_bench_venv.sh makes one). Its
  hashes are checked against this project's before its times are printed.

Usage: ``python scripts/bench_hash.py [--vllm-python /tmp/vllm-venv/bin/python]
[--repeat-4k 200] [--repeat-128k 20]``. Prints Markdown: best-of-N time per request (as
``timeit`` advises; the machine may be shared), and tokens/s at that time.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import os
import platform
import random
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import cbor2

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common.blockhash import BlockHasher, HashSettings, none_hash

VOCAB = 151_936
CASES = ((4096, 16), (4096, 128), (131_072, 16), (131_072, 128))
DISTRIBUTIONS = ("uniform", "zipf")

# Runs in the vLLM interpreter: reads {"prompts": {name: tokens}, "cases": [[name, block,
# repeat]]} on stdin, prints {"version", "results": [[best_ns, event ints]]}.
VLLM_CHILD = r"""
import json, os, sys, time
os.environ["VLLM_LOGGING_LEVEL"] = "ERROR"
import vllm
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256_cbor
from vllm.v1.core import kv_cache_utils as kcu
from vllm.v1.request import Request
kcu.init_none_hash(sha256_cbor)  # PYTHONHASHSEED=0 is set by the parent
spec = json.load(sys.stdin)
results = []
for name, block, repeat in spec["cases"]:
    hasher = kcu.get_request_block_hasher(block, sha256_cbor)
    request = Request("bench", spec["prompts"][name], SamplingParams(max_tokens=1), None)
    best = None
    for _ in range(repeat + 1):  # the first call is a warm-up
        start = time.perf_counter_ns()
        hashes = hasher(request)
        elapsed = time.perf_counter_ns() - start
        best = elapsed if best is None else min(best, elapsed)
    ints = [int.from_bytes(bytes(h)[-8:], "big") for h in hashes]
    results.append([best, ints])
print(json.dumps({"version": vllm.__version__, "results": results}))
"""


def make_prompt(tokens: int, distribution: str) -> list[int]:
    rng = random.Random(f"{tokens}-{distribution}")
    if distribution == "uniform":
        return [rng.randrange(VOCAB) for _ in range(tokens)]
    weights = [1.0 / (rank + 1) for rank in range(VOCAB)]
    return rng.choices(range(VOCAB), weights=weights, k=tokens)


def reference_digests(parent: bytes, tokens: list[int], block: int) -> list[bytes]:
    """vLLM's hash_block_tokens chain, spelled with cbor2 and hashlib."""
    out = []
    for start in range(0, len(tokens) - len(tokens) % block, block):
        preimage = cbor2.dumps((parent, tuple(tokens[start : start + block]), None), canonical=True)
        parent = hashlib.sha256(preimage).digest()
        out.append(parent)
    return out


def best_ns(funcs: list[Callable[[], object]], repeat: int) -> list[int]:
    """Best-of-``repeat`` time of each function, the functions taking turns so that load
    from other processes on the machine falls on all of them alike."""
    for func in funcs:
        func()  # warm-up: lazy tables, allocator
    best = [2**63] * len(funcs)
    for _ in range(repeat):
        for index, func in enumerate(funcs):
            start = time.perf_counter_ns()
            func()
            best[index] = min(best[index], time.perf_counter_ns() - start)
    return best


def run_vllm(python: str, prompts: dict[str, list[int]], cases: list[list[object]]) -> dict:
    """vLLM's best times and hashes, or raises RuntimeError saying why the column is skipped."""
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    env.pop("PYTHONPATH", None)
    try:
        proc = subprocess.run([python, "-c", VLLM_CHILD], input=json.dumps(
            {"prompts": prompts, "cases": cases}), capture_output=True, text=True, env=env,
            timeout=900, check=False)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RuntimeError(f"cannot run {python}: {exc}") from None
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"{python} failed: {last}")
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def _cell(tokens: int, ns: float) -> str:
    return f"{ns / 1000:,.0f} µs ({tokens / (ns / 1e9) / 1e6:.1f} M tok/s)"


def _vllm_column(python: str | None, prompts: dict[str, list[int]],
                 rows: list[tuple[str, int, int, int]]) -> tuple[dict | None, str]:  # fmt: skip
    if not python:
        return None, "vLLM column skipped: no --vllm-python given"
    try:
        vllm = run_vllm(python, prompts, [[f"{d}-{n}", b, r] for d, n, b, r in rows])
    except RuntimeError as exc:
        return None, f"vLLM column skipped: {exc}"
    return vllm, f"vLLM column: vLLM {vllm['version']} via {python}"


def _row(hasher: BlockHasher, parent: bytes, tokens: list[int], block: int, repeat: int,
         vllm_result: list | None) -> str:  # fmt: skip
    assert reference_digests(parent, tokens, block) == hasher.digests(tokens, block)
    ours, ref = best_ns([partial(hasher.member_keys, tokens, block),
                         partial(reference_digests, parent, tokens, block)], repeat)  # fmt: skip
    vllm_cell, vs_vllm = "–", "–"
    if vllm_result is not None:
        vllm_ns, vllm_ints = vllm_result
        if vllm_ints != hasher.event_ints(tokens, block):
            raise SystemExit(f"vLLM's hashes differ from ours ({len(tokens)} tokens, {block})")
        vllm_cell, vs_vllm = _cell(len(tokens), vllm_ns), f"{vllm_ns / ours:.2f}×"
    return (f"{_cell(len(tokens), ours)} | {_cell(len(tokens), ref)} | {vllm_cell} "
            f"| {ref / ours:.2f}× | {vs_vllm} |")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-python", help="python of a venv with vLLM (e.g. 0.28.0)")
    parser.add_argument("--repeat-4k", type=int, default=200)
    parser.add_argument("--repeat-128k", type=int, default=20)
    args = parser.parse_args(argv)
    settings = HashSettings()
    hasher, parent = BlockHasher(settings), none_hash(settings)
    prompts = {f"{d}-{n}": make_prompt(n, d) for d in DISTRIBUTIONS for n in {n for n, _ in CASES}}
    rows = [(d, n, b, args.repeat_4k if n <= 4096 else args.repeat_128k)
            for d in DISTRIBUTIONS for n, b in CASES]  # fmt: skip
    vllm, note = _vllm_column(args.vllm_python, prompts, rows)
    print(f"Python {platform.python_version()}, cbor2 {importlib.metadata.version('cbor2')}, "
          f"{os.cpu_count()} CPUs; best of N per request; {note}\n")  # fmt: skip
    print("| tokens | ids | block | member_keys | cbor2+hashlib | vLLM | vs cbor2 | vs vLLM |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for index, (dist, n, block, repeat) in enumerate(rows):
        result = vllm["results"][index] if vllm else None
        cells = _row(hasher, parent, prompts[f"{dist}-{n}"], block, repeat, result)
        print(f"| {n:,} | {dist} | {block} | {cells}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
