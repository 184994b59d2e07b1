"""Benchmark block hashing: this project's BlockHasher vs vLLM's own hasher vs cbor2+hashlib.

Same prompts for every column: 4,096, 131,072 and 2,097,152 token ids (``--tokens``), block
size 16 and 128, ``sha256_cbor`` with PYTHONHASHSEED "0", no salt. Token ids are drawn from a
151,936-id vocabulary uniformly (the worst case: no locality, ~57 % of ids need 5 CBOR bytes)
or Zipf-like (id rank ~ frequency, closer to real text). Columns:

- ``member_keys``: :meth:`BlockHasher.member_keys`, what the API calls per request;
- ``vLLM``: vLLM's ``get_request_block_hasher`` on a real ``Request``, run in a persistent
  child process of the interpreter given by ``--vllm-python``
  (scripts/setup_vllm_bench_venv.sh makes one). Its hashes are checked against ours first.
- ``cbor2+hashlib``: vLLM's algorithm spelled out, ``cbor2.dumps(canonical=True)`` and
  ``hashlib.sha256`` per block, in this interpreter (no vLLM needed).

The machine may be shared, so the three take turns call by call (one call of ours, one of
vLLM's in its process, one of cbor2's, again) and each keeps its best time of N (as
``timeit`` advises), by default in CPU time of the calling thread (``--clock cpu``: time
spent waiting for a CPU another process holds is not counted; ``--clock wall`` counts it).
That is one round; ``--rounds`` rounds are run and the table shows the median time and the
median ratio (with the rounds' lowest and highest ratio).
Memory: the peak Python-heap allocation of one ``member_keys`` call (tracemalloc, which also
sees numpy's buffers) and the memory importing the hasher adds to a fresh process.

``--old-rev REV`` adds a column: this project's own ``BlockHasher`` as of git revision REV,
run in a child process like vLLM's (e.g. to compare with the encoder before a change).

Usage: ``python scripts/bench_hash.py [--vllm-python /tmp/vllm-venv/bin/python]
[--tokens 4096,131072,2097152] [--rounds 3] [--repeat-4k 100] [--repeat-long 5]
[--clock cpu|wall] [--old-rev REV]``.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from functools import partial
from pathlib import Path

import cbor2

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common import blockhash_native
from common.blockhash import BlockHasher, HashSettings, none_hash

VOCAB = 151_936
BLOCKS = (16, 128)
CALL_TOKENS = 40_960  # a timing covers max(1, CALL_TOKENS // tokens) calls in a row
DISTRIBUTIONS = ("uniform", "zipf")

# Runs in the vLLM interpreter. Reads one JSON line {"prompts": {name: tokens}}, answers
# "ready <version>", then serves lines "<clock> <name> <block> <calls>" (-> ns of <calls>
# hasher calls in a row by that clock, "cpu" or "wall") and "ints <name> <block> 1" (-> JSON
# event ints) until EOF.
VLLM_CHILD = r"""
import json, os, sys, time
os.environ["VLLM_LOGGING_LEVEL"] = "ERROR"
import vllm
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256_cbor
from vllm.v1.core import kv_cache_utils as kcu
from vllm.v1.request import Request
kcu.init_none_hash(sha256_cbor)  # PYTHONHASHSEED=0 is set by the parent
prompts = json.loads(sys.stdin.readline())["prompts"]
requests = {name: Request("bench", tokens, SamplingParams(max_tokens=1), None)
            for name, tokens in prompts.items()}
hashers = {}
print("ready", vllm.__version__, flush=True)
for line in sys.stdin:
    what, name, block, calls = line.split()
    hasher = hashers.setdefault(block, kcu.get_request_block_hasher(int(block), sha256_cbor))
    clock = time.thread_time_ns if what == "cpu" else time.perf_counter_ns
    start = clock()
    for _ in range(int(calls)):
        hashes = hasher(requests[name])  # the Request keeps no hashes: every call hashes all
    elapsed = clock() - start
    if what == "ints":
        print(json.dumps([int.from_bytes(bytes(h)[-8:], "big") for h in hashes]), flush=True)
    else:
        print(elapsed, flush=True)
"""


# Runs this project's BlockHasher of another revision (--old-rev), extracted to PYTHONPATH;
# the same protocol as VLLM_CHILD.
OLD_CHILD = r"""
import json, sys, time
from common.blockhash import BlockHasher, HashSettings
hasher = BlockHasher(HashSettings())
prompts = json.loads(sys.stdin.readline())["prompts"]
print("ready", "old", flush=True)
for line in sys.stdin:
    what, name, block, calls = line.split()
    if what == "ints":
        print(json.dumps(hasher.event_ints(prompts[name], int(block))), flush=True)
        continue
    clock = time.thread_time_ns if what == "cpu" else time.perf_counter_ns
    start = clock()
    for _ in range(int(calls)):
        hasher.member_keys(prompts[name], int(block))
    print(clock() - start, flush=True)
"""


class ChildHasher:
    """A hasher in a child process (vLLM's, or an older revision's), timed call by call."""

    def __init__(
        self, python: str, code: str, prompts: dict[str, list[int]], path: str | None = None
    ) -> None:
        env = {**os.environ, "PYTHONHASHSEED": "0"}
        env.pop("PYTHONPATH", None)
        if path:
            env["PYTHONPATH"] = path
        try:  # cwd: "python -c" puts it first on sys.path, before PYTHONPATH
            self.proc = subprocess.Popen(
                [python, "-c", code],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                env=env,
                cwd=path or tempfile.gettempdir(),
            )
        except OSError as exc:
            raise RuntimeError(f"cannot run {python}: {exc}") from None
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.stdin, self.stdout = self.proc.stdin, self.proc.stdout
        try:
            self.stdin.write(json.dumps({"prompts": prompts}) + "\n")
            self.stdin.flush()
        except BrokenPipeError:
            pass
        ready = self.stdout.readline().split()
        if not ready or ready[0] != "ready":
            self.close()
            raise RuntimeError(f"{python} could not run the hasher (see its stderr above)")
        self.version = ready[1]

    def ask(self, what: str, name: str, block: int, calls: int = 1) -> str:
        self.stdin.write(f"{what} {name} {block} {calls}\n")
        self.stdin.flush()
        return self.stdout.readline()

    def time_ns(self, clock: str, name: str, block: int, calls: int = 1) -> int:
        """ns of ``calls`` hasher calls in a row, in the child."""
        return int(self.ask(clock, name, block, calls))

    def event_ints(self, name: str, block: int) -> list[int]:
        return list(json.loads(self.ask("ints", name, block)))

    def close(self) -> None:
        self.stdin.close()
        self.proc.wait(timeout=60)


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


def best_ns(
    funcs: list[Callable[[], int | None]], repeat: int, clock: str, calls: int = 1
) -> list[float]:
    """Best-of-``repeat`` time of one call of each function, the functions taking turns so
    that load from other processes on the machine falls on all of them alike. Each timing
    covers ``calls`` calls in a row (so that a short prompt's time is well above the clock's
    granularity). A function returning an int reports its own time for ``calls`` calls (the
    children time themselves)."""
    now = time.thread_time_ns if clock == "cpu" else time.perf_counter_ns
    best = [float(2**63)] * len(funcs)
    for _ in range(repeat):
        for index, func in enumerate(funcs):
            start = now()
            reported = func()
            elapsed = now() - start if reported is None else reported
            best[index] = min(best[index], max(elapsed, 1) / calls)
    return best


def _calls(count: int, func: Callable[..., object], *args: object) -> None:
    for _ in range(count):
        func(*args)


def _quiet(func: Callable[[], object]) -> Callable[[], None]:
    def run() -> None:
        func()

    return run


def _cell(tokens: int, ns: float) -> str:
    return f"{ns / 1e6:,.2f} ms ({tokens / (ns / 1e9) / 1e6:.1f} M tok/s)"


def _ratio(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.2f}×"
    return f"{statistics.median(values):.2f}× ({min(values):.2f}–{max(values):.2f})"


def _row(
    case: tuple[str, int, int, int],
    prompt: list[int],
    hasher: BlockHasher,
    vllm: ChildHasher | None,
    old: ChildHasher | None,
    args: argparse.Namespace,
) -> str:
    dist, tokens, block, repeat = case
    name = f"{dist}-{tokens}"
    for child in (vllm, old):
        if child is not None and child.event_ints(name, block) != hasher.event_ints(prompt, block):
            raise SystemExit(f"{child.version}'s hashes differ from ours ({name}, block {block})")
    parent = none_hash(hasher.settings)
    calls = max(1, CALL_TOKENS // tokens)
    funcs = [
        _quiet(partial(_calls, calls, hasher.member_keys, prompt, block)),
        _quiet(partial(_calls, calls, reference_digests, parent, prompt, block)),
    ]
    for child in (vllm, old):
        if child is not None:
            funcs.append(partial(child.time_ns, args.clock, name, block, calls))
    times = [best_ns(funcs, repeat, args.clock, calls) for _ in range(args.rounds)]
    vs_old = f" {_ratio([t[-1] / t[0] for t in times])} |" if old is not None else ""
    ours, ref = (statistics.median(t[i] for t in times) for i in range(2))
    vs_ref = _ratio([t[1] / t[0] for t in times])
    vllm_cell = vs_vllm = "–"
    if vllm is not None:
        vllm_cell = _cell(tokens, statistics.median(t[2] for t in times))
        vs_vllm = _ratio([t[2] / t[0] for t in times])
    return (
        f"| {tokens:,} | {dist} | {block} | {_cell(tokens, ours)} | {vllm_cell} "
        f"| {_cell(tokens, ref)} | **{vs_vllm}** | {vs_ref} |{vs_old}"
    )


def peak_bytes(func: Callable[[], object]) -> int:
    tracemalloc.start()
    func()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak


IMPORT_COST = r"""
import re
def private_kib():  # this process's own (not shared) resident memory
    text = open("/proc/self/smaps_rollup").read()
    return sum(int(n) for n in re.findall(r"^Private_(?:Clean|Dirty):\s+(\d+)", text, re.M))
def rss_kib():
    return int(open("/proc/self/statm").read().split()[1]) * 4
before = private_kib(), rss_kib()
from common.blockhash import BlockHasher, HashSettings
BlockHasher(HashSettings()).member_keys(list(range(151_936)), 16)
print((private_kib() - before[0]) / 1024, (rss_kib() - before[1]) / 1024)
"""


def import_cost() -> str:
    """Private and resident memory that importing and first using the hasher adds."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    try:
        out = subprocess.run(
            [sys.executable, "-c", IMPORT_COST],
            capture_output=True,
            text=True,
            env=env,
            check=True,
            timeout=120,
        ).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return "import cost: not measured (no /proc/self/smaps_rollup?)"
    return (
        f"importing and first using BlockHasher adds {float(out[0]):.1f} MB private "
        f"memory ({float(out[1]):.1f} MB resident, shared libraries included)"
    )


def _vllm_child(
    python: str | None, prompts: dict[str, list[int]]
) -> tuple[ChildHasher | None, str]:
    if not python:
        return None, "vLLM column skipped: no --vllm-python given"
    try:
        vllm = ChildHasher(python, VLLM_CHILD, prompts)
    except RuntimeError as exc:
        return None, f"vLLM column skipped: {exc}"
    return vllm, f"vLLM column: vLLM {vllm.version} via {python}"


def _old_child(rev: str, prompts: dict[str, list[int]]) -> ChildHasher:
    """This project's ``common/`` as of ``rev`` (git archive into a temporary directory)."""
    path = tempfile.mkdtemp(prefix="bench-hash-old-")
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", rev, "common"], capture_output=True, check=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", path], input=archive, check=True)
    return ChildHasher(sys.executable, OLD_CHILD, prompts, path=path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-python", help="python of a venv with vLLM (e.g. 0.28.0)")
    parser.add_argument(
        "--tokens", default="4096,131072,2097152", help="comma-separated prompt lengths"
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--clock",
        choices=("cpu", "wall"),
        default="cpu",
        help="cpu: the calling thread's CPU time (default; steadier on a "
        "shared machine), wall: elapsed time",
    )
    parser.add_argument("--repeat-4k", type=int, default=100, help="best of N, <= 4,096 tokens")
    parser.add_argument("--repeat-long", type=int, default=5, help="best of N, longer prompts")
    parser.add_argument("--old-rev", help="also time BlockHasher as of this git revision")
    args = parser.parse_args(argv)
    sizes = [int(n) for n in args.tokens.split(",")]
    hasher = BlockHasher(HashSettings())
    prompts = {f"{d}-{n}": make_prompt(n, d) for d in DISTRIBUTIONS for n in sizes}
    cases = [
        (d, n, b, args.repeat_4k if n <= 4096 else args.repeat_long)
        for d in DISTRIBUTIONS
        for n in sizes
        for b in BLOCKS
    ]
    vllm, note = _vllm_child(args.vllm_python, prompts)
    old = _old_child(args.old_rev, prompts) if args.old_rev else None
    print(
        f"Python {platform.python_version()}, cbor2 {importlib.metadata.version('cbor2')}, "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; {args.clock} time, "
        f"median of {args.rounds} rounds of best-of-N, taking turns; {note}"
    )
    print(f"member_keys: {blockhash_native.status()}\n")
    old_head = (f" vs {args.old_rev} |", "---:|") if old else ("", "")
    print(
        "| tokens | ids | block | member_keys | vLLM | cbor2+hashlib | vs vLLM | vs cbor2 |"
        + old_head[0]
        + "\n|---:|---|---:|---:|---:|---:|---:|---:|"
        + old_head[1]
    )
    try:
        for case in cases:
            prompt = prompts[f"{case[0]}-{case[1]}"]
            print(_row(case, prompt, hasher, vllm, old, args), flush=True)
    finally:
        for child in (vllm, old):
            if child is not None:
                child.close()
    print(
        "\nPeak memory of one member_keys call (tracemalloc): "
        + ", ".join(
            f"{n:,} tokens at block {b}: "
            f"{peak_bytes(partial(hasher.member_keys, p, b)) / 2**20:.1f}"
            f" MB"
            for n in sizes
            for b in BLOCKS
            for p in [prompts[f"uniform-{n}"]]
        )
        + f"; {import_cost()}."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
