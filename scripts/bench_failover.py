"""How long the index takes to heal after Redis fails over or loses writes (issue 19).

Runs the failover suite's scenarios (tests/integration/test_failover_*.py) with every
cache-indexer process (discovery, l1-ingest, l3-poll, the API under gunicorn) against
simulated vLLM pods — a busy one that keeps publishing and a quiet one that does not — and a
fake Mooncake master, on real redis-server / redis-sentinel processes on loopback:

* ``sentinel-kill``: Sentinel (1 master, 1 replica, 3 sentinels, down-after 1 s); kill -9
  of the master while the busy pod publishes, then the old master back empty on its port;
* ``sentinel-lost``: the replica stopped (SIGSTOP, its link filled) while writes are
  acknowledged, the master killed, the replica resumed and promoted: those writes are lost;
* ``cluster-lost``: the same on a Redis Cluster with replicas (3 + 3, node timeout 2 s),
  then the old master back empty;
* ``aof-crash``: one server, ``appendfsync everysec``, the unsynced tail of the AOF lost.

For each failure it prints the seconds to the promotion (from the kill, or from the stopped
replica resuming) and then, per phase, from the promotion seen (or the restart) to every
probe of every instance equal to the publishers' truth (each rank's stored sequence, every
served prompt's L1 ratio, the L3 ratio of the blocks each pod put), polled every 0.1 s.

Usage: ``python scripts/bench_failover.py [--rounds 3] [--only sentinel-kill,...]``.
Needs redis-server and redis-sentinel (scripts/setup.sh). Prints Markdown.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.conftest import Node, child_env
from tests.fake_master import FakeMaster
from tests.integration import test_failover_aof as aof
from tests.integration import test_failover_cluster as cluster_suite
from tests.integration import test_failover_sentinel as sentinel_suite
from tests.integration.fleet import Fleet
from tests.redis_nodes import Cluster, SentinelSet

Scenario = Callable[[Path, list[subprocess.Popen[bytes]]], dict[str, float]]


def _sentinel(run: Callable[..., dict[str, float]]) -> Scenario:
    def scenario(tmp: Path, procs: list[subprocess.Popen[bytes]]) -> dict[str, float]:
        s = SentinelSet().start()
        master = FakeMaster("0.3.13").start()
        fleet = Fleet(sentinel_suite.IPS, master)
        try:
            return run(s, fleet, tmp, procs, child_env())
        finally:
            _stop(procs)
            fleet.close()
            master.stop()
            s.cleanup()

    return scenario


def _cluster(tmp: Path, procs: list[subprocess.Popen[bytes]]) -> dict[str, float]:
    c = Cluster(6, replicas=1, extra=cluster_suite.CLUSTER_ARGS).start()
    try:
        return cluster_suite.run_cluster_lost_writes(c, tmp, procs, child_env())
    finally:
        _stop(procs)
        c.cleanup()


def _aof(tmp: Path, procs: list[subprocess.Popen[bytes]]) -> dict[str, float]:
    node = Node("redis-server", aof.AOF).start()
    try:
        return aof.run_aof_crash(node, tmp, procs, child_env())
    finally:
        _stop(procs)
        node.cleanup()


SCENARIOS: dict[str, Scenario] = {
    "sentinel-kill": _sentinel(sentinel_suite.run_kill_master_while_publishing),
    "sentinel-lost": _sentinel(sentinel_suite.run_lost_writes),
    "cluster-lost": _cluster,
    "aof-crash": _aof,
}


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM the processes this script started (by PID), SIGKILL after 15 s."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    procs.clear()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", default=",".join(SCENARIOS))
    args = parser.parse_args(argv)
    results: dict[tuple[str, str], list[float]] = {}
    for name in args.only.split(","):
        for i in range(args.rounds):
            with tempfile.TemporaryDirectory(prefix="bench-failover-") as tmp:
                procs: list[subprocess.Popen[bytes]] = []
                times = SCENARIOS[name](Path(tmp), procs)
            print(f"{name} round {i + 1}: {_fmt(times)}", file=sys.stderr, flush=True)
            for phase, seconds in times.items():
                if phase != "start":
                    results.setdefault((name, phase), []).append(seconds)
    print("| scenario | phase | seconds (median; min–max) |")
    print("|---|---|---|")
    for (name, phase), values in results.items():
        print(
            f"| {name} | {phase} | {statistics.median(values):.1f} "
            f"({min(values):.1f}–{max(values):.1f}, {len(values)} runs) |"
        )
    return 0


def _fmt(times: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v:.2f}s" for k, v in times.items())


if __name__ == "__main__":
    sys.exit(main())
