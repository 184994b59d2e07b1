"""Benchmark the API's per-request metric cost and its scrape, for one or more source trees.

Per request the API records three things (:mod:`services.api.app` and ``hit_rate``):
``requests.inc(path, status)``, ``latency.observe(seconds, path)`` and
``hashed_blocks.inc(n)``. This times exactly those calls on an :class:`ApiMetrics` built the
way a gunicorn worker builds it, in a fresh child process per tree (so each tree's
``prometheus_client`` import sees the environment a worker sees), and then one ``/metrics``
render summed over ``--workers`` processes' worth of data. Trees are run alternately,
``--rounds`` times, so that a loaded machine affects them alike; compare within one run.

Usage: ``python scripts/bench_api_metrics.py TREE [TREE ...] [--calls 200000] [--rounds 3]``
where TREE is a checkout of this repository (e.g. ``.`` and an older ``git archive``).
Trees whose ``ApiMetrics`` takes a shared directory use it as that tree's gunicorn hooks
would (``PROMETHEUS_MULTIPROC_DIR`` or the older per-pid JSON snapshot directory).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

_CHILD = r"""
import json, os, sys, time
calls, workers = int(sys.argv[1]), int(sys.argv[2])
from services.api import api_metrics as am
shared = os.environ.get("PROMETHEUS_MULTIPROC_DIR") or os.environ.get("CACHE_INDEXER_METRICS_DIR")
def build():
    return am.ApiMetrics(shared)
m = build()
if hasattr(m, "start_flusher"):  # the older tree's worker also ran its snapshot writer
    m.start_flusher()
path = "/kv-cache/hit-rate"
started = time.perf_counter()
for i in range(calls):
    m.requests.inc(path=path, status="200")
    m.latency.observe(0.0021, path=path)
    m.hashed_blocks.inc(32)
per_request = (time.perf_counter() - started) / calls
for pid in range(workers - 1):  # the other workers' data: fork writers
    if os.fork() == 0:
        w = build()
        for i in range(1000):
            w.requests.inc(path=path, status="200")
            w.latency.observe(0.003, path=path)
        (getattr(w, "flush", None) or w.registry.flush)()  # the older tree / this one
        os._exit(0)
    os.wait()
if hasattr(m, "flush"):
    m.flush()
started = time.perf_counter()
for _ in range(50):
    text = m.render()
scrape = (time.perf_counter() - started) / 50
print(json.dumps({"per_request_us": per_request * 1e6, "scrape_ms": scrape * 1e3,
                  "bytes": len(text)}))
"""


def _run(tree: str, calls: int, workers: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="bench-api-metrics-") as shared:
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in ("PROMETHEUS_MULTIPROC_DIR", "CACHE_INDEXER_METRICS_DIR")
        }
        env["PYTHONPATH"] = tree
        with open(os.path.join(tree, "services", "api", "api_metrics.py")) as f:
            multiproc = "PROMETHEUS_MULTIPROC_DIR" in f.read()
        env["PROMETHEUS_MULTIPROC_DIR" if multiproc else "CACHE_INDEXER_METRICS_DIR"] = shared
        out = subprocess.run(
            [sys.executable, "-c", _CHILD, str(calls), str(workers)],
            cwd=tree,
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        return dict(json.loads(out.stdout.splitlines()[-1]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trees", nargs="+")
    parser.add_argument("--calls", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=4)
    args = parser.parse_args()
    results: dict[str, list[dict[str, float]]] = {t: [] for t in args.trees}
    for _ in range(args.rounds):
        for tree in args.trees:
            results[tree].append(_run(os.path.abspath(tree), args.calls, args.workers))
    print(
        f"{args.calls} simulated requests per round, {args.rounds} rounds, scrape over "
        f"{args.workers} workers' data; Python {sys.version.split()[0]}, {os.cpu_count()} CPUs\n"
    )
    print("| tree | metric cost per request µs (median) | scrape ms (median) | bytes |")
    print("|---|---:|---:|---:|")
    for tree, runs in results.items():
        print(
            f"| {tree} | {statistics.median(r['per_request_us'] for r in runs):.2f} | "
            f"{statistics.median(r['scrape_ms'] for r in runs):.2f} | {int(runs[-1]['bytes'])} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
