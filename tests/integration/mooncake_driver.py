"""Runs one L3 scenario against a real ``mooncake_master``; prints the observations as JSON.

Must run inside a private network namespace, because store clients listen on all
interfaces (tests/integration/test_l3_mooncake.py starts it under ``unshare -n``)::

    python tests/integration/mooncake_driver.py run --scope segment
    python tests/integration/mooncake_driver.py client --host 127.0.0.2 --master 127.0.0.1:P

``run`` starts redis-server, the master (short ``--client_ttl``), one store client process
per "pod" (127.0.0.2 = A, 127.0.0.3 = B; 127.0.0.4 = C is registered but has no segment),
and ``cache-indexer l3-poll``; it writes vLLM keys built from the project's own block hashes
and reads what the API would (``Store.prefix_lengths``). It waits only for the poller to
have polled and written again (``write_seconds_count``), never for an expected value: the
test asserts those.
A ``client`` reads JSON commands on stdin (put/remove) and answers one JSON line each.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import redis  # noqa: E402

from common.blockhash import BlockHasher, HashSettings  # noqa: E402
from common.store import Instance  # noqa: E402
from tests.conftest import RedisServer, reserve_port, wait_for  # noqa: E402
from tests.store_oracle import OracleStore  # noqa: E402

A, B, C = "127.0.0.2", "127.0.0.3", "127.0.0.4"
BLOCK = 16
HASHER = BlockHasher(HashSettings())
POLL, STALE, TTL = 0.3, 4.0, 2


def keys_of(tokens: list[int], model: str = "Qwen2.5-0.5B-Instruct", tp: int = 0) -> list[str]:
    return [
        f"{model}@tp_rank:{tp}@pcp0@dcp0@pp_rank:0@group:0@{d.hex()}"
        for d in HASHER.digests(tokens, BLOCK)
    ]


def prompt(seed: int, blocks: int) -> list[int]:
    return [seed * 1000 + i for i in range(blocks * BLOCK)]


# -- a store client ("pod") -------------------------------------------------------------


def client_main(host: str, master: str) -> None:
    from mooncake.store import MooncakeDistributedStore, ReplicateConfig

    store = MooncakeDistributedStore()
    rc = store.setup(host, "P2PHANDSHAKE", 64 << 20, 16 << 20, "tcp", "", master)
    print(json.dumps({"setup": rc, "hostname": store.get_hostname()}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "put":
            config = ReplicateConfig()
            if cmd.get("pin"):
                config.preferred_segment = store.get_hostname()
            out = [store.put(k, b"kv" * 2048, config) for k in cmd["keys"]]
        elif cmd["op"] == "remove":
            out = [store.remove(k, True) for k in cmd["keys"]]
        else:
            out = store.batch_is_exist(cmd["keys"])
        print(json.dumps({"rc": out}), flush=True)


class Pod:
    def __init__(self, host: str, master: str, log: Path) -> None:
        self.host = host
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "client", "--host", host, "--master", master],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log.open("wb"),
            text=True,
        )
        self.hello = self._read()

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"store client {self.host} exited")
        return json.loads(line)  # type: ignore[no-any-return]

    def call(self, op: str, keys: list[str], pin: bool = False) -> list[int]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, "keys": keys, "pin": pin}) + "\n")
        self.proc.stdin.flush()
        return self._read()["rc"]  # type: ignore[no-any-return]


# -- the scenario -----------------------------------------------------------------------


class Scenario:
    def __init__(self, scope: str, tmp: Path) -> None:
        self.scope, self.tmp = scope, tmp
        self.out: dict[str, Any] = {"scope": scope}
        self.procs: list[subprocess.Popen[Any]] = []

    def start(self) -> None:
        self.redis = RedisServer().start()
        self.store = OracleStore(redis.Redis.from_url(self.redis.url))
        rpc, admin = reserve_port(), reserve_port()
        self.master_url = f"http://127.0.0.1:{admin}"
        self.master = self._spawn(
            [
                "mooncake_master",
                "--rpc_address=127.0.0.1",
                f"--rpc_port={rpc}",
                "--metrics_host=127.0.0.1",
                f"--metrics_port={admin}",
                "--enable_metric_reporting=false",
                f"--client_ttl={TTL}",
            ],
            "master.log",
        )
        wait_for(
            lambda: httpx.get(self.master_url + "/health").status_code == 200, what="master /health"
        )
        self.pods = {ip: Pod(ip, f"127.0.0.1:{rpc}", self.tmp / f"pod-{ip}.log") for ip in (A, B)}
        self.out["setup"] = {ip: p.hello for ip, p in self.pods.items()}
        for ip in (A, B, C):
            self.store.upsert_instance(Instance(ip=ip, uid=f"pod-{ip}"))
        self.store.set_masters({self.master_url: json.dumps({"pod": "mooncake-master"})})
        self.metrics_port = reserve_port()
        cfg = self.tmp / "config.yaml"
        cfg.write_text(
            f"redis:\n  url: {self.redis.url}\n"
            f"discovery:\n  segmentsFetchTimeout: 1s\n"
            f"ingest:\n  l3:\n    scope: {self.scope}\n    pollInterval: {int(POLL * 1000)}ms\n"
            f"    httpTimeout: 1s\n    staleAfter: {int(STALE * 1000)}ms\n    batchSize: 4\n"
        )
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self._spawn(
            [
                sys.executable,
                "-m",
                "services.cli",
                "l3-poll",
                "--config",
                str(cfg),
                "--metrics-port",
                str(self.metrics_port),
            ],
            "poller.log",
            env,
        )

    def _spawn(
        self, argv: list[str], log: str, env: dict[str, str] | None = None
    ) -> subprocess.Popen[Any]:
        proc = subprocess.Popen(
            argv, stdout=subprocess.DEVNULL, stderr=(self.tmp / log).open("wb"), env=env
        )
        self.procs.append(proc)
        return proc

    def stop(self) -> None:
        for pod in self.pods.values():
            if pod.proc.poll() is None:
                pod.proc.kill()
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(10)
        self.redis.cleanup()

    # -- observations ------------------------------------------------------------------

    def settle(self, polls: int = 2) -> None:
        """Wait until the poller has finished ``polls`` polls (and their Redis writes)
        since now. Counted with the writer's metric, not ``updated_ms``: an unchanged set
        is not rewritten, so its state hash does not move."""
        mark = wait_for(
            lambda: (self.counter("write_seconds_count"),), what="the poller's metrics"
        )[0]
        wait_for(
            lambda: self.counter("write_seconds_count") >= mark + polls,
            timeout=15 * polls,
            what=f"{polls} polls",
        )

    def ratios(self, tokens: list[int]) -> dict[str, float]:
        """The hit-rate API's L3 read: longest run from block 0, over the block count."""
        members = HASHER.member_keys(tokens, BLOCK)
        lengths = self.store.prefix_lengths([A, B, C], members)
        return {ip: l3 / len(members) for ip, (_, l3) in zip((A, B, C), lengths)}

    def counter(self, name: str) -> float:
        text = httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics").text
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith((f"cache_indexer_l3_{name}{{", f"cache_indexer_l3_{name} "))
        )

    def run(self) -> None:
        p1, p2, p3 = prompt(1, 8), prompt(2, 6), prompt(3, 8)
        pod_a, pod_b = self.pods[A], self.pods[B]
        # 1. five of eight blocks put by pod A, pinned to its own segment
        self.out["put_p1"] = pod_a.call("put", keys_of(p1)[:5], pin=True)
        self.settle()
        self.out["p1"] = self.ratios(p1)
        # 2. a TP=2 model: rank 0 on A, rank 1 on B; then one rank-1 shard is lost
        self.out["put_p2"] = pod_a.call("put", keys_of(p2, "TP2-Model", 0), pin=True) + pod_b.call(
            "put", keys_of(p2, "TP2-Model", 1), pin=True
        )
        self.settle()
        self.out["p2_full"] = self.ratios(p2)
        self.out["remove"] = pod_b.call("remove", [keys_of(p2, "TP2-Model", 1)[3]])
        self.settle()
        self.out["p2_missing_rank"] = self.ratios(p2)
        # 3. unpinned: the master places each block on any segment
        self.out["put_p3"] = pod_a.call("put", keys_of(p3))
        self.settle()
        self.out["p3"] = self.ratios(p3)
        p3_ints = HASHER.event_ints(p3, BLOCK)
        self.out["p3_on"] = {ip: [h in self.store.l3_members(ip) for h in p3_ints] for ip in (A, B)}
        # steady state: further polls locate nothing
        located = self.counter("keys_located_total")
        self.settle(3)
        self.out["located_total"] = located
        self.out["located_steady_delta"] = self.counter("keys_located_total") - located
        self.out["batch_calls"] = self.counter("locate_calls_total")
        self._moves()
        self._crash_and_stale(p1, p2, p3)

    def _moves(self) -> None:
        """Issue 20 item 2: keys removed on A and put again by B between two polls (pinned),
        then rounds of removals and unpinned re-puts by the other pod; the index is
        compared with where the master says each key is (``/batch_query_keys``)."""
        pod_a, pod_b = self.pods[A], self.pods[B]
        p4 = prompt(4, 6)
        ks = keys_of(p4)
        pod_a.call("put", ks, pin=True)
        self.settle()
        started = time.monotonic()
        self.out["move"] = pod_a.call("remove", ks[:3]) + pod_b.call("put", ks[:3], pin=True)
        self.settle()
        self.out["moved_seconds"] = time.monotonic() - started
        ints = HASHER.event_ints(p4, BLOCK)
        self.out["p4_on"] = {ip: [h in self.store.l3_members(ip) for h in ints] for ip in (A, B)}
        p5 = prompt(5, 24)
        ks5, ints5 = keys_of(p5), HASHER.event_ints(p5, BLOCK)
        pod_a.call("put", ks5)
        for r in range(6):  # churn: the holder of a third of the keys changes each round
            gone, comes = (pod_a, pod_b) if r % 2 == 0 else (pod_b, pod_a)
            gone.call("remove", ks5[r % 3 :: 3])
            comes.call("put", ks5[r % 3 :: 3])
            self.settle(1)
        started = time.monotonic()
        self.settle()
        self.out["churn_settle_seconds"] = time.monotonic() - started
        truth = self._holders(ks5)
        self.out["p5_truth"] = {ip: [ip in truth[k] for k in ks5] for ip in (A, B)}
        self.out["p5_index"] = {
            ip: [h in self.store.l3_members(ip) for h in ints5] for ip in (A, B)
        }

    def _eviction(self) -> None:
        """Real eviction pressure: A puts a prompt's blocks (unpinned), B fills both
        segments with other keys until the master evicts, then B puts the prompt again
        (the evicted blocks land anew, anywhere); the index is compared with the master."""
        pod_a, pod_b = self.pods[A], self.pods[B]
        p6 = prompt(6, 24)
        ks, ints = keys_of(p6), HASHER.event_ints(p6, BLOCK)
        pod_a.call("put", ks)
        self.settle()
        evicted = self.master_counter("master_evicted_key_count")
        filler = [f"filler-{i}" for i in range(40_000)]  # 4 KiB each: 160 MB > 2 × 64 MB
        for i in range(0, len(filler), 5_000):
            pod_b.call("put", filler[i : i + 5_000])
        self.out["evicted_keys"] = self.master_counter("master_evicted_key_count") - evicted
        self.out["p6_evicted"] = sum(not h for h in self._holders(ks).values())
        started = time.monotonic()
        pod_b.call("put", ks)
        self.settle()
        self.out["eviction_settle_seconds"] = time.monotonic() - started
        truth = self._holders(ks)
        self.out["p6_truth"] = {ip: [ip in truth[k] for k in ks] for ip in (A, B)}
        self.out["p6_index"] = {ip: [h in self.store.l3_members(ip) for h in ints] for ip in (A, B)}

    def master_counter(self, name: str) -> float:
        text = httpx.get(self.master_url + "/metrics").text
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith((f"{name} ", f"{name}{{"))
        )

    def _holders(self, ks: list[str]) -> dict[str, set[str]]:
        """key → the hosts of its replicas, as the master says now."""
        body = httpx.get(self.master_url + "/batch_query_keys", params={"keys": ",".join(ks)})
        data = body.json()["data"]
        return {
            k: {v["transport_endpoint_"].rsplit(":", 1)[0] for v in data[k]["values"] or []}
            for k in ks
        }

    def _crash_and_stale(self, p1: list[int], p2: list[int], p3: list[int]) -> None:
        pod_b = self.pods[B]
        pod_b.proc.send_signal(signal.SIGKILL)
        seg_b = self.out["setup"][B]["hostname"]
        wait_for(
            lambda: seg_b not in httpx.get(self.master_url + "/get_all_segments").text,
            timeout=TTL + 30,
            what="the killed client's segment to go",
        )
        self.settle()
        self.out["after_kill"] = {
            "p1": self.ratios(p1),
            "p2": self.ratios(p2),
            "p3": self.ratios(p3),
            "b_members": len(self.store.l3_members(B)),
        }
        self.out["p3_exists_after_kill"] = self.pods[A].call("exist", keys_of(p3))
        # the master stops: state kept through failed polls until staleAfter, then dropped
        # and flagged (seen by polling, not by timing it)
        errors = self.counter("errors_total")
        self.master.terminate()
        self.master.wait(10)
        wait_for(
            lambda: self.counter("errors_total") > errors,
            timeout=30,
            what="a failed poll of the stopped master",
        )
        self.out["after_stop"] = {"p1": self.ratios(p1), "state": self.store.l3_state(A)}
        wait_for(
            lambda: self.store.l3_state(A).get("stale") == "1",
            timeout=STALE + 30,
            what="stale flag",
        )
        self.out["after_stale"] = {
            "p1": self.ratios(p1),
            "state": self.store.l3_state(A),
            "a_members": len(self.store.l3_members(A)),
        }
        self.out["errors_total"] = self.counter("errors_total")


def run_main(scope: str, eviction: bool = False) -> int:
    with tempfile.TemporaryDirectory(prefix="l3-mooncake-") as tmp:
        scenario = Scenario(scope, Path(tmp))
        try:
            scenario.start()
            if eviction:  # on its own: the filler evicts the other steps' blocks too
                scenario._eviction()
            else:
                scenario.run()
        except Exception as exc:  # noqa: BLE001 - reported to the test with the logs
            scenario.out["error"] = repr(exc)
            scenario.out["logs"] = {
                p.name: p.read_text(errors="replace")[-3000:] for p in Path(tmp).glob("*.log")
            }
        finally:
            scenario.stop()
        print(json.dumps(scenario.out), flush=True)
    return 0


def main() -> int:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run")
    run.add_argument("--scope", choices=["segment", "pool"], default="segment")
    run.add_argument("--eviction", action="store_true", help="the eviction scenario only")
    client = sub.add_parser("client")
    client.add_argument("--host", required=True)
    client.add_argument("--master", required=True)
    args = p.parse_args()
    if args.cmd == "client":
        client_main(args.host, args.master)
        return 0
    return run_main(args.scope, args.eviction)


if __name__ == "__main__":
    sys.exit(main())
