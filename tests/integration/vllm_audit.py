"""The prediction audit against the real vLLM engine: a small router, faults, and the prober.

Run by tests/integration/vllm_engine_driver.py inside a model's run, after its workload (the
same engine and index: no extra engine start). The router asks ``POST /kv-cache/hit-rate``
with a ``request_id``, sends the engine the request and reports ``cached_tokens`` to
``POST /kv-cache/outcome`` (source ``router``); the API's verdicts are collected.

* :func:`concurrent_phase`: :data:`STREAMS` streams that do not wait for each other's events;
  every report that is not exact is classified here: ``raced`` when another stream's request
  ran between this question and this answer, or had answered less than :data:`RACE_S` before
  the question (its events may not be indexed yet) — a legitimate difference; else
  ``unexplained``.
* :func:`fault_phase`: routers with a bug, one request each after a correct warm-up of the
  same prompt: an extra BOS token sent but not asked about (→ over), a salt sent but not asked
  about (→ over), a wrong ``block_size`` asked with (→ under).
* :func:`probe_phase`: ``cache-indexer audit-probe`` against the engine; first exact probes,
  then the L1 ingester is frozen (SIGSTOP) and the prober must report ``events_missing``.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from typing import TYPE_CHECKING, Any

import httpx

from tests.conftest import wait_for
from tests.integration import vllm_engine as ve

if TYPE_CHECKING:
    from tests.integration.vllm_engine_driver import Run

STREAMS = 4
PER_STREAM = 10
RACE_S = 1.0
BOS = 1
PROBE_INTERVAL_S = 1.0
PROBE_DEADLINE_S = 3.0


def ask(run: Run, prompt: list[int], rid: str, block: int = ve.BLOCK, salt: str = "") -> int:
    """The router's question; the tokens the index says the engine will reuse."""
    body: dict[str, Any] = {"token_ids": prompt, "block_size": block}
    if salt:
        body["cache_salt"] = salt
    doc = httpx.post(
        f"http://127.0.0.1:{run.api}/kv-cache/hit-rate",
        params={"detail": 1},
        json={"server_ip": [run.ip], "body": body, "request_id": rid},
        timeout=30,
    ).json()
    assert doc.get("request_id") == rid, doc
    score = doc["server_score_list"][0]
    l3 = int(score["l3_hit_tokens"]) if run.spec["mooncake"] else 0
    return max(int(score["l1_hit_tokens"]), l3)


def send(run: Run, prompt: list[int], salt: str = "") -> int:
    body: dict[str, Any] = {"model": run.model, "prompt": prompt, "max_tokens": 1}
    if salt:
        body["cache_salt"] = salt
    resp = httpx.post(
        f"http://{run.ip}:{run.engine_port}/v1/completions",
        json=body | {"temperature": 0},
        timeout=120,
    )
    resp.raise_for_status()
    return int(resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def report(run: Run, rid: str, cached: int, prompt_tokens: int) -> dict[str, Any]:
    """The router's report; a 404 (the API writes its records in the background) is retried."""
    body = {
        "request_id": rid,
        "server_ip": run.ip,
        "cached_tokens": cached,
        "prompt_tokens": prompt_tokens,
        "source": "router",
    }
    url = f"http://127.0.0.1:{run.api}/kv-cache/outcome"

    def answered() -> httpx.Response | None:
        resp = httpx.post(url, json=body, timeout=30)
        return None if resp.status_code == 404 else resp

    resp = wait_for(answered, timeout=10, interval=0.05, what=f"the record of {rid}")
    assert resp.status_code == 200, resp.text
    return dict(resp.json())


def routed(run: Run, prompt: list[int], **fault: Any) -> dict[str, Any]:
    """One request through the router: ask (as the fault says), send, report."""
    rid = f"router-{uuid.uuid4().hex}"
    asked = prompt[1:] if fault.get("bos") else prompt
    started = time.monotonic()
    predicted = ask(run, asked, rid, fault.get("block", ve.BLOCK), fault.get("ask_salt", ""))
    cached = send(run, prompt, fault.get("send_salt", ""))
    verdict = report(run, rid, cached, len(prompt))
    return {
        "rid": rid,
        "asked_at": started,
        "answered_at": time.monotonic(),
        "predicted": predicted,
        "cached_tokens": cached,
        "verdict": verdict.get("verdict"),
        "explained": verdict.get("explained"),
        "cause": verdict.get("cause"),
        "reported": {k: verdict.get(k) for k in ("predicted_tokens", "realized_tokens")},
    }


# -- concurrent streams ------------------------------------------------------------------


def concurrent_phase(run: Run, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1, 1000) for _ in range(n)] for n in (64, 96, 128)]
    streams = [
        [
            rng.choice(prefixes) + [rng.randrange(1, 1000) for _ in range(rng.randrange(1, 90))]
            for _ in range(PER_STREAM)
        ]
        for _ in range(STREAMS)
    ]
    rows: list[dict[str, Any]] = []
    lock = threading.Lock()
    errors: list[str] = []

    def stream(i: int) -> None:
        try:
            for prompt in streams[i]:
                row = routed(run, prompt) | {"stream": i, "prompt": prompt}
                with lock:
                    rows.append(row)
        except Exception as exc:  # noqa: BLE001 - reported with the phase
            errors.append(repr(exc))

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(STREAMS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    for row in rows:
        row["class"] = _classify(row, rows)
    return {
        "errors": errors,
        "requests": len(rows),
        "verdicts": _count(r["verdict"] for r in rows),
        "classes": _count(r["class"] for r in rows),
        "api_causes": _count(r["cause"] for r in rows if r["verdict"] != "exact"),
        "api_unexplained": sum(r["explained"] is False for r in rows),
        "mean_difference": round(
            sum(abs(r["predicted"] - r["cached_tokens"]) for r in rows) / max(1, len(rows)), 2
        ),
        "consistent": all(_consistent(r) for r in rows),
        "rows": [{k: v for k, v in r.items() if k != "prompt"} for r in rows],
    }


def _classify(row: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    if row["verdict"] == "exact":
        return "exact"
    for other in rows:
        if other is row or other["stream"] == row["stream"]:
            continue
        overlaps = other["asked_at"] < row["answered_at"] and (
            other["answered_at"] + RACE_S > row["asked_at"]
        )
        if overlaps:
            return "raced"
    return "unexplained"


def _consistent(row: dict[str, Any]) -> bool:
    """The API's verdict agrees with the router's own numbers."""
    p, c = row["predicted"], row["cached_tokens"]
    want = "exact" if p == c else ("over" if p > c else "under")
    return bool(row["verdict"] == want)


def _count(values: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in values:
        out[str(v)] = out.get(str(v), 0) + 1
    return out


# -- faulty routers ----------------------------------------------------------------------

FAULTS: dict[str, dict[str, Any]] = {
    "extra_bos": {"bos": True},
    "salt_not_asked": {"send_salt": "tenant-a"},
    "wrong_block_size": {"block": ve.BLOCK // 2},
}


def fault_phase(run: Run, seed: int, per_fault: int = 3) -> dict[str, Any]:
    rng = random.Random(seed)
    out: dict[str, Any] = {}
    for name, fault in FAULTS.items():
        rows = []
        for _ in range(per_fault):
            prompt = [rng.randrange(1, 1000) for _ in range(rng.randrange(3, 6) * ve.BLOCK + 5)]
            _settled(run, lambda p=prompt: routed(run, p))  # a correct router warms it up
            sent = [BOS, *prompt] if fault.get("bos") else prompt
            rows.append(_settled(run, lambda s=sent, f=fault: routed(run, s, **f)))
        out[name] = {
            "verdicts": [r["verdict"] for r in rows],
            "rows": [
                {k: r[k] for k in ("predicted", "cached_tokens", "verdict", "explained", "cause")}
                for r in rows
            ],
        }
    return out


def _settled(run: Run, request: Any) -> dict[str, Any]:
    assert run.capture is not None
    run.settle(None, time.monotonic())
    row: dict[str, Any] = request()
    run.capture.wait_quiet(row["answered_at"])
    return row


# -- the prober ---------------------------------------------------------------------------


def probe_config(run: Run) -> dict[str, Any]:
    return {
        "enabled": True,
        "apiUrl": f"http://127.0.0.1:{run.api}",
        "interval": f"{PROBE_INTERVAL_S}s",
        "concurrency": 1,
        "timeout": "60s",
        "indexDeadline": f"{PROBE_DEADLINE_S}s",
        "promptBlocks": 2,
    }


def probe_phase(run: Run, freeze_ingester: bool) -> dict[str, Any]:
    """Start the prober; count its outcomes until two exact probes, then (``freeze_ingester``)
    SIGSTOP the L1 ingester and time how long until it reports ``events_missing``."""
    port = run.probe_metrics
    proc = run.spawn(
        "audit-probe.log",
        [
            sys.executable,
            "-m",
            "services.cli",
            "audit-probe",
            "--config",
            str(run.config),
            "--metrics-port",
            str(port),
        ],
    )
    out: dict[str, Any] = {}
    try:
        wait_for(
            lambda: _outcomes(port).get("exact", 0) >= 2,
            timeout=120,
            interval=0.5,
            what="two exact probes",
        )
        out["before"] = _outcomes(port)
        if freeze_ingester:
            ingester = run.by_log["l1-ingest.log"]
            os.kill(ingester.pid, signal.SIGSTOP)
            frozen = time.monotonic()
            try:
                wait_for(  # the index deadline plus a few probe intervals (a loaded machine)
                    lambda: _outcomes(port).get("events_missing", 0) >= 1,
                    timeout=PROBE_DEADLINE_S + 20 * PROBE_INTERVAL_S,
                    interval=0.2,
                    what="the probe to report events_missing",
                )
                out["events_missing_after_s"] = round(time.monotonic() - frozen, 1)
            finally:
                os.kill(ingester.pid, signal.SIGCONT)
            out["after"] = _outcomes(port)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            out["exit"] = proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            out["exit"] = proc.wait()
    return out


def _outcomes(port: int) -> dict[str, float]:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("cache_indexer_probe_outcomes_total{"):
            label = line.split('outcome="', 1)[1].split('"', 1)[0]
            out[label] = float(line.rsplit(" ", 1)[1])
    return out


PHASES: dict[str, tuple[str, ...]] = {
    "dense": ("concurrent", "faults", "probe_events_missing"),
    "linear": ("concurrent", "probe"),
    "swa": ("probe",),
}
"""Which phases each model's run adds (the Mooncake run audits its workload only)."""


def run_phases(run: Run, name: str, seed: int) -> dict[str, Any]:
    """The model's audit phases; a phase that fails is recorded as its error."""
    out: dict[str, Any] = {}
    for phase in PHASES.get(name, ()):
        started = time.monotonic()
        try:
            if phase == "concurrent":
                out[phase] = concurrent_phase(run, seed + 1)
            elif phase == "faults":
                out[phase] = fault_phase(run, seed + 2)
            else:
                out[phase] = probe_phase(run, freeze_ingester=phase == "probe_events_missing")
        except Exception as exc:  # noqa: BLE001 - the test shows it with the logs
            out[phase] = {"error": repr(exc)}
        out[phase]["seconds"] = round(time.monotonic() - started, 1)
    return out
