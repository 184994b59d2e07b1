"""The prediction audit end to end: a router in the test asks hit-rate with a request id,
"sends" the request to a simulated vLLM pod (its engine model says what vLLM would reuse),
and reports the outcome to the API under gunicorn; a real Prometheus scrapes the API and
evaluates charts/cache-indexer/files/prometheus-rules.yaml (every ``for:`` cut to 2 s).

A correct router, waiting for each request's events like the issue's measurement, gets only
exact verdicts and CacheIndexerPredictionsOff stays quiet; a wrong block size or salt gets
unexplained reports naming it; a router that prepends a BOS token to what it asked about
(the engine then reuses another chain) gets unexplained ``prompt_length_differs`` reports
and the alert fires for ``source="router"``.
"""

from __future__ import annotations

import itertools
import math
import random
import shutil
import subprocess
from pathlib import Path
from typing import Any

import httpx
import redis

from services.simulator.cache_model import Request
from services.simulator.workload import Workload
from tests.conftest import RedisServer, require, wait_for
from tests.fake_master import FakeMaster
from tests.integration.fleet import BLOCK, Fleet, start_stack
from tests.integration.test_prometheus_stack import Prom, Stack, _start_prometheus
from tests.store_oracle import OracleStore

IP = "127.0.0.81"
BOS = 151643  # Qwen's <|endoftext|>, as a router's tokenizer adds it
REPORTS = 30
ALERT = "CacheIndexerPredictionsOff"
_OUTCOMES = "cache_indexer_api_audit_outcomes_total"
UNEXPLAINED_SHARE = (  # the alert's ratio, 0 (not absent) when nothing is unexplained
    f'(sum by (source) (rate({_OUTCOMES}{{explained="false"}}[30m]))'
    f" or sum by (source) (rate({_OUTCOMES}[30m])) * 0)"
    f" / sum by (source) (rate({_OUTCOMES}[30m]))"
)


class Router:
    """Asks, sends, reports: ``bos`` makes it send the engine one token more than it asked."""

    def __init__(self, api: int, fleet: Fleet, store: OracleStore) -> None:
        self.url = f"http://127.0.0.1:{api}"
        self.sim, self.store = fleet.sims[IP], store
        self.ids = itertools.count()
        self.http = httpx.Client(timeout=10)

    def route(
        self, asked: Request, *, bos: bool, sent: Request | None = None, block_size: int = BLOCK
    ) -> dict[str, Any]:
        """Ask about ``asked`` (with ``block_size``), send ``sent`` (default: ``asked``, with a
        BOS token in front if ``bos``), report what the engine reused."""
        rid = f"req-{next(self.ids)}"
        body = {
            "server_ip": [IP],
            "request_id": rid,
            "body": {
                "token_ids": list(asked.token_ids),
                "block_size": block_size,
                "cache_salt": asked.cache_salt or "",
            },
        }
        answer = self.http.post(f"{self.url}/kv-cache/hit-rate", json=body)
        assert answer.status_code == 200 and answer.json()["request_id"] == rid, answer.text
        if sent is None:
            sent = Request((BOS, *asked.token_ids), asked.cache_salt) if bos else asked
        cached = self.sim.true_hit_tokens(sent)  # what vLLM reports for the request it got
        self.sim.serve([sent])
        self.sim.flush()
        report = {
            "request_id": rid,
            "server_ip": IP,
            "cached_tokens": cached,
            "prompt_tokens": len(sent.token_ids),
        }

        def reported() -> dict[str, Any] | None:
            resp = self.http.post(f"{self.url}/kv-cache/outcome", json=report)
            if resp.status_code == 404:  # the record is written in the background
                return None
            assert resp.status_code == 200, resp.text
            doc: dict[str, Any] = resp.json()
            return doc

        verdict: dict[str, Any] = wait_for(reported, 10, what=f"the report of {rid}")
        # Like the sequential measurement: the next question sees this request's blocks.
        wait_for(
            lambda: self.store.last_seq(IP, 0) == self.sim.last_seq(0), 10, what="events indexed"
        )
        return verdict


def test_systematically_wrong_reports_fire_the_alert_and_correct_ones_do_not(
    tmp_path: Path,
    procs: list[subprocess.Popen[bytes]],
    subprocess_env: dict[str, str],
    redis_server: RedisServer,
) -> None:
    for tool in ("prometheus", "promtool"):
        require(shutil.which(tool), f"{tool} is not installed (scripts/setup.sh installs it)")
    store = OracleStore(redis.Redis.from_url(redis_server.url))
    master = FakeMaster("0.3.13").start()
    fleet = Fleet([IP], master)
    try:
        api = start_stack(tmp_path, procs, subprocess_env, {"url": redis_server.url}, fleet, store)
        prom = _start_prometheus(Stack(tmp_path, procs, subprocess_env), {"api": api})
        router = Router(api, fleet, store)
        _correct_router_is_exact_and_quiet(router, prom)
        _other_faults_are_named(router)
        _wrong_router_fires(router, prom)
    finally:
        fleet.close()
        master.stop()


def _correct_router_is_exact_and_quiet(router: Router, prom: Prom) -> None:
    workload = Workload("mixed", prompts=8, prompt_len=96, block_size=BLOCK, seed=7)
    verdicts = [router.route(workload.next(), bos=False) for _ in range(REPORTS)]

    def share() -> list[tuple[str, float]]:
        """The alert's ratio once Prometheus has seen reports arrive (a rate, not NaN)."""
        verdicts.append(router.route(workload.next(), bos=False))
        got = [(s["metric"]["source"], float(s["value"][1])) for s in prom.query(UNEXPLAINED_SHARE)]
        return got if got and not any(math.isnan(v) for _, v in got) else []

    assert wait_for(share, 90, 0.5, what="Prometheus to see the reports") == [("router", 0.0)]
    assert [v["verdict"] for v in verdicts] == ["exact"] * len(verdicts), verdicts
    assert sum(v["realized_tokens"] > 0 for v in verdicts) >= REPORTS // 2  # real hits
    assert prom.firing(ALERT) == []


def _other_faults_are_named(router: Router) -> None:
    """A wrong block size or salt: every report unexplained, with the cause that names it."""
    rng = random.Random(5)
    causes = []
    for i in range(3):
        prompt = Request(tuple(rng.randrange(150_000) for _ in range(5 * BLOCK + 3)))
        salted = Request(prompt.token_ids, f"tenant-{i}")
        assert router.route(prompt, bos=False)["verdict"] == "exact"  # now cached unsalted
        causes.append(router.route(prompt, bos=False, block_size=2 * BLOCK))
        causes.append(router.route(salted, bos=False, sent=prompt))  # salt asked, not sent
        causes.append(router.route(prompt, bos=False, sent=salted))  # salt sent, not asked
    named = [(c["verdict"], c["cause"], c["explained"]) for c in causes]
    assert (
        named
        == [
            ("under", "block_size_differs", False),
            ("under", "engine_blocks_not_indexed", False),
            ("over", "evicted_or_wrong_key", False),
        ]
        * 3
    ), causes


def _wrong_router_fires(router: Router, prom: Prom) -> None:
    workload = Workload("mixed", prompts=8, prompt_len=96, block_size=BLOCK, seed=8)
    verdicts = [router.route(workload.next(), bos=True) for _ in range(REPORTS)]

    def fired() -> list[dict[str, str]]:
        verdicts.append(router.route(workload.next(), bos=True))  # the router keeps at it
        return [a for a in prom.firing(ALERT) if a.get("source") == "router"]

    wait_for(fired, 120, 0.5, what=f"{ALERT} to fire")
    off = [v for v in verdicts if v["verdict"] != "exact"]
    assert len(off) >= len(verdicts) // 2, verdicts
    assert {(v["cause"], v["explained"]) for v in off} == {("prompt_length_differs", False)}
