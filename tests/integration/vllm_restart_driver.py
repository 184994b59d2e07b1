"""Restarts a real vLLM engine on the same address under the whole cache-indexer (issue 20);
prints one JSON line per scenario.

Must run inside a private network namespace (vLLM binds ``tcp://*:PORT``;
tests/integration/test_vllm_restart.py starts it under ``unshare -n``)::

    python tests/integration/vllm_restart_driver.py [--scenarios no-replay,ingester-killed]

Each scenario uses the dense model of :data:`tests.integration.vllm_engine.MODELS` and the
processes of :class:`tests.integration.vllm_engine_driver.Run` (static discovery: the engine
is the same ``server_ip`` before and after, no AllBlocksCleared, nothing tells discovery):

* ``no-replay``: the ingester has no replay endpoint (openFuyao's default) and the default
  backoff (1 s → 30 s); a short first lifetime (4 prompts), the engine killed, 20 s down,
  restarted on the same ports; the new engine serves prompts of its own before the old
  prompts are asked again.
* ``ingester-killed``: with replay; the engine and ``l1-ingest`` are killed together, the new
  engine serves prompts (its sequence passes the old one) before ``l1-ingest`` starts again.
* ``live-first``: with replay; the engine is killed and restarted at once (the restart is
  first seen on the live stream after the SUB socket reconnects).
* ``no-replay-ingester-killed``: as ``ingester-killed`` without a replay endpoint: the new
  session's first live batch is past the stored cursor and nothing can verify the lifetime
  (a possible restart: the rank is reset); what the new engine stored before the ingester
  came back is lost to it, so the index may under-report those blocks, never over-report.

After the restart (and, but for ``ingester-killed``, once the ingester reports its SUB socket
connected again: without replay a batch published before that is lost) the new engine
serves one prompt (eight for ``ingester-killed``), then one a second (traffic: a lifetime is
only seen once it publishes), and the driver measures how long after the first the index
still holds a block the new engine does not (by the engine's own events; printed, not
asserted), then runs
old and new prompts through :meth:`Run.run`: for each, what the index predicts and what the
engine reuses. It compares nothing: the test asserts.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import redis  # noqa: E402
import yaml  # noqa: E402

from tests.conftest import Node, RedisServer, wait_for  # noqa: E402
from tests.integration import vllm_engine as ve  # noqa: E402
from tests.integration.vllm_engine_driver import IP, Run, workload  # noqa: E402

SCENARIOS = ("no-replay", "ingester-killed", "live-first", "no-replay-ingester-killed")
NO_REPLAY = ("no-replay", "no-replay-ingester-killed")
INGESTER_KILLED = ("ingester-killed", "no-replay-ingester-killed")


class RestartRun(Run):
    """:class:`Run` whose engine (and ingester) can be killed and started again."""

    def __init__(self, scenario: str, tmp: Path, redis_url: str) -> None:
        super().__init__("dense", tmp / scenario, redis_url)
        self.scenario = scenario

    def _write_config(self) -> Path:
        path = super()._write_config()
        doc = yaml.safe_load(path.read_text(encoding="utf-8"))
        if self.scenario in NO_REPLAY:
            del doc["discovery"]["static"]["vllm"][0]["replayEndpoint"]
            doc["ingest"]["l1"].update(backoffInitial="1s", backoffMax="30s")  # the defaults
        path.write_text(yaml.safe_dump(doc), encoding="utf-8")
        self.config = path
        return path

    def kill(self, proc: Any) -> None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()

    def restart_engine(self) -> None:
        """Start the engine again with the same argv; returns when it answers /health."""
        assert self.capture is not None
        self.capture.close()
        self.capture = None
        self.engine = self._spawn("engine.log", self.engine_argv, self.engine_env)

        def engine_up() -> bool:
            if self.engine.poll() is not None:
                raise RuntimeError(f"the engine exited with {self.engine.returncode}")
            return httpx.get(f"http://{IP}:{self.engine_port}/health", timeout=2).is_success

        wait_for(engine_up, timeout=300, interval=0.5, what="the new engine's /health")
        self.capture = ve.Capture(f"tcp://{IP}:{self.pub}", f"tcp://{IP}:{self.replay}")

    def start(self) -> None:
        self.engine_argv = ve.engine_argv(
            ve.write_model(self.tmp, self.name),
            self.name,
            IP,
            self.engine_port,
            self.pub,
            self.replay,
        )
        self.engine_env = ve.engine_env(IP, None)
        super().start()

    def start_ingester(self) -> None:
        from tests.conftest import child_env

        self.ingester = self._spawn(
            "l1-ingest.log",
            [sys.executable, "-m", "services.cli", "l1-ingest", "--config", str(self.config)],
            child_env(),
        )

    def ingester_proc(self) -> Any:
        return next(p for p in self.procs if "l1-ingest" in str(p.args))

    def wait_reconnected(self) -> None:
        """Until the ingester reports its SUB socket connected to the new engine (a batch
        published before that is lost without replay: the slow joiner, spec §1.2)."""
        since = int(time.time() * 1000)

        def connected() -> bool:
            state = self.store.l1_state(IP)
            return state.get("conn") == "connected" and int(state.get("status_ms", 0)) > since

        wait_for(connected, timeout=60, interval=0.2, what="the ingester to reconnect")
        time.sleep(0.5)  # the subscription reaches the engine's PUB socket

    def engine_holds(self) -> set[int]:
        """The GPU blocks the new engine holds, by its own events (our SUB + replay)."""
        assert self.capture is not None
        with self.capture.lock:
            return {h for h, n in self.capture.held.get(0, {}).items() if n > 0}

    def l1_tokens(self, prompt: list[int]) -> int:
        return int(self.ask_index(prompt).get("l1_hit_tokens", 0))


def scenario_run(scenario: str, tmp: Path, server: Node) -> dict[str, Any]:
    redis.Redis.from_url(server.url).flushall()
    run = RestartRun(scenario, tmp, server.url)
    prompts = workload(20, 24)
    old, fresh = prompts[:4], prompts[4:]
    try:
        run.start()
        if scenario in NO_REPLAY:
            run.wait_reconnected()  # without replay a batch sent before that is lost
        first = run.run(old)  # the first lifetime: a few batches
        held = [p for p in old if run.l1_tokens(p) > 0]
        ingester = run.ingester_proc()
        run.kill(run.engine)
        if scenario in INGESTER_KILLED:
            run.kill(ingester)
        if scenario == "no-replay":
            time.sleep(20)  # the outage: nothing to poll for, the engine is down
        run.restart_engine()
        if scenario not in INGESTER_KILLED:
            run.wait_reconnected()
        first_batch = time.monotonic()
        for p in fresh[: 8 if scenario in INGESTER_KILLED else 1]:
            run.ask_engine(p)  # the new lifetime's first batches (past the old seq: 8)
        if scenario in INGESTER_KILLED:
            run.start_ingester()
        traffic = iter(workload(21, 60))

        def old_gone() -> float | bool:
            if run.store.tier_members(IP) <= run.engine_holds():
                return time.monotonic()
            # a lifetime is seen from what it publishes, and a batch sent before the SUB
            # socket reconnected is lost (slow joiner): keep serving, as a live engine does
            run.ask_engine(next(traffic))
            return False

        dropped = wait_for(
            old_gone, timeout=120, interval=1.0, what="the old lifetime's blocks to stop counting"
        )
        second = run.run(old + fresh)
        return {
            "scenario": scenario,
            "first_rows": first["rows"],
            "held_before": len(held),
            "dropped_after_s": round(dropped - first_batch, 2),
            "rows": second["rows"],
            "l1_state": run.store.l1_state(IP),
        }
    except Exception as exc:  # noqa: BLE001 - reported to the test with the logs
        return {
            "scenario": scenario,
            "error": repr(exc),
            "l1_state": run.store.l1_state(IP),
            "logs": {p.name: p.read_text(errors="replace")[-4000:] for p in run.tmp.glob("*.log")},
        }
    finally:
        run.stop()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="vllm-restart-") as tmp:
        server = RedisServer().start()
        try:
            for name in args.scenarios.split(","):
                print(json.dumps(scenario_run(name, Path(tmp), server)), flush=True)
        finally:
            server.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
