"""A real Prometheus scraping real processes runs every dashboard query and alert expression,
and induced faults fire the matching alerts.

The stack, all on loopback: redis-server, a real ``mooncake_master`` plus a master URL where
nothing listens, three ``simulate-vllm`` pods — A healthy and dropping a batch now and then
(gaps that replay fills), B a hybrid model hashing with the wrong ``PYTHONHASHSEED``, C
healthy until the test stops it — and discovery (static), ``l1-ingest``, ``l3-poll`` and
the API under gunicorn.
Debian's ``prometheus`` scrapes all four cache-indexer processes every second and evaluates
charts/cache-indexer/files/prometheus-rules.yaml rendered with every ``for:`` cut to 2 s
(the only change). The test then checks, in order:

1. every target is up; every metric and label name that a rule or a dashboard query selects
   has series in Prometheus (no misspelling survives), every dashboard query returns data;
2. the faults present from the start fire their alerts, for the faulty instance or master
   only: CacheIndexerHashMismatch and CacheIndexerInexactAnswers (B, a hybrid model whose
   hash unit the failing self-check cannot confirm), CacheIndexerL3MasterStale and
   CacheIndexerL3PollErrors (the dead master); nothing fires for A;
3. stopping pod C fires CacheIndexerInstanceNotSynced for C;
4. a Redis ``maxmemory`` just above its use fires CacheIndexerRedisMemoryHigh;
5. stopping the only ingester fires CacheIndexerInstanceUnassigned;
6. stopping Redis fires CacheIndexerRedisUnreachable (API, discovery, poller) and
   CacheIndexerHitRateErrors, and the API's Redis error counter that the dashboard and that
   rule select has series.

Not induced here (their rules are unit-tested with promtool, their gauges elsewhere): a
stuck worker loop, unparsed Mooncake keys (they need store clients in a network
namespace), a slow API.
"""

from __future__ import annotations

import importlib.util
import itertools
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import redis
import yaml

from tests.conftest import ROOT, RedisServer, require, reserve_port, wait_for
from tests.metric_catalog import grouping_labels, selectors
from tests.unit.test_alert_rules import RULES, load_rules

A, B, C = "127.0.0.71", "127.0.0.72", "127.0.0.73"
BLOCK = 16
JOBS = ("api", "discovery", "l1-ingest", "l3-poll")
RATE_INTERVAL = "15s"  # what the dashboard's $__rate_interval stands for at a 1 s scrape
# Series that exist only once their fault happened: checked after step 4.
AFTER_REDIS_STOPS = {"cache_indexer_api_redis_errors_total"}


def _dashboard_queries() -> list[tuple[str, str]]:
    require(
        importlib.util.find_spec("grafana_foundation_sdk"),
        "grafana-foundation-sdk is not installed (scripts/setup.sh)",
    )
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import make_dashboard
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    return [(t, q.replace("$__rate_interval", RATE_INTERVAL)) for t, q in make_dashboard.queries()]


class Prom:
    """A Prometheus server's HTTP API."""

    def __init__(self, url: str) -> None:
        self.url = url

    def query(self, expr: str) -> list[dict[str, Any]]:
        resp = httpx.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=5)
        doc = resp.json()
        assert doc["status"] == "success", (expr, doc)
        result: list[dict[str, Any]] = doc["data"]["result"]
        return result

    def firing(self, alert: str) -> list[dict[str, str]]:
        doc = httpx.get(f"{self.url}/api/v1/alerts", timeout=5).json()
        return [
            a["labels"]
            for a in doc["data"]["alerts"]
            if a["labels"]["alertname"] == alert and a["state"] == "firing"
        ]

    def targets_up(self) -> dict[str, str]:
        doc = httpx.get(f"{self.url}/api/v1/targets", timeout=5).json()
        return {t["labels"]["job"]: t["health"] for t in doc["data"]["activeTargets"]}


class Stack:
    def __init__(self, tmp: Path, procs: list[subprocess.Popen[bytes]], env: dict[str, str]):
        self.tmp, self.procs, self.env = tmp, procs, env
        self.pods: dict[str, subprocess.Popen[bytes]] = {}

    def spawn(self, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        log = open(self.tmp / f"{name}.log", "ab")  # noqa: SIM115 - handed to the child
        proc = subprocess.Popen(argv, cwd=ROOT, env=self.env, stdout=log, stderr=log)
        self.procs.append(proc)
        return proc

    def cli(self, name: str, *args: str) -> subprocess.Popen[bytes]:
        return self.spawn(name, [sys.executable, "-m", "services.cli", *args])

    def pod(self, ip: str, pub: int, replay: int, *extra: str) -> None:
        self.pods[ip] = self.cli(
            f"pod-{ip}",
            "simulate-vllm",
            "--endpoint",
            f"tcp://*:{pub}",
            "--replay-endpoint",
            f"tcp://*:{replay}",
            "--bind-host",
            ip,
            "--topic",
            "kv-events",
            "--block-size",
            str(BLOCK),
            "--num-blocks",
            "512",
            "--rate",
            "10",
            "--prompt-len",
            "128",
            "--warm-prompt",
            "64",
            *extra,
        )


def _config(
    tmp: Path, redis_url: str, api: int, pods: dict[str, tuple[int, int]], masters: list[str]
) -> Path:
    cfg = {
        "redis": {"url": redis_url, "socketTimeout": "1s", "connectTimeout": "1s"},
        "http": {"addr": f"127.0.0.1:{api}", "workers": 2},
        "blockKey": {"pythonHashSeed": "0"},
        "discovery": {
            "mode": "static",
            "static": {
                "vllm": [
                    {
                        "ip": ip,
                        "zmqEndpoint": f"tcp://{ip}:{pub}",
                        "replayEndpoint": f"tcp://{ip}:{replay}",
                    }
                    for ip, (pub, replay) in pods.items()
                ],
                "mooncakeMasters": [{"url": url} for url in masters],
            },
        },
        "ingest": {
            "l1": {
                "topic": "kv-events",
                "backoffInitial": "100ms",
                "backoffMax": "1s",
                "leaseTTL": "2s",
                "heartbeatInterval": "500ms",
                "noEventsAfter": "3s",
            },
            "l3": {"pollInterval": "1s", "httpTimeout": "500ms", "staleAfter": "3s"},
        },
    }
    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump(cfg), encoding="utf-8")
    return path


def _short_rules(tmp: Path) -> Path:
    """The rules file with every ``for:`` cut to 2 s — nothing else changes."""
    doc = yaml.safe_load(RULES.read_text(encoding="utf-8"))
    for group in doc["groups"]:
        for rule in group["rules"]:
            rule["for"] = "2s"
    path = tmp / "rules.yaml"
    path.write_text(yaml.safe_dump(doc), encoding="utf-8")
    return path


def _start_prometheus(stack: Stack, targets: dict[str, int]) -> Prom:
    port = reserve_port()
    cfg = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "900ms"},
        "rule_files": [str(_short_rules(stack.tmp))],
        "scrape_configs": [
            {"job_name": job, "static_configs": [{"targets": [f"127.0.0.1:{p}"]}]}
            for job, p in targets.items()
        ],
    }
    (stack.tmp / "prometheus.yml").write_text(yaml.safe_dump(cfg), encoding="utf-8")
    check = subprocess.run(
        ["promtool", "check", "config", str(stack.tmp / "prometheus.yml")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert check.returncode == 0, check.stdout + check.stderr
    stack.spawn(
        "prometheus",
        [
            "prometheus",
            f"--config.file={stack.tmp / 'prometheus.yml'}",
            f"--storage.tsdb.path={stack.tmp / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
    )
    prom = Prom(f"http://127.0.0.1:{port}")
    wait_for(
        lambda: httpx.get(f"{prom.url}/-/ready", timeout=1).status_code == 200,
        30,
        0.2,
        what="prometheus ready",
    )
    return prom


def _start_master(stack: Stack) -> str:
    rpc, admin = reserve_port(), reserve_port()
    stack.spawn(
        "mooncake-master",
        [
            "mooncake_master",
            "--rpc_address=127.0.0.1",
            f"--rpc_port={rpc}",
            "--metrics_host=127.0.0.1",
            f"--metrics_port={admin}",
            "--enable_metric_reporting=false",
        ],
    )
    url = f"http://127.0.0.1:{admin}"
    wait_for(
        lambda: httpx.get(url + "/health", timeout=1).status_code == 200, 30, 0.2, what="master"
    )
    return url


def _missing_selectors(prom: Prom, exprs: list[str], skip: set[str]) -> list[str]:
    """Metric and label names in ``exprs`` that Prometheus has no series for."""
    missing: list[str] = []
    for expr in exprs:
        for name, labels in selectors(expr):
            if name in skip:
                continue
            series = prom.query(name)
            if not series:
                missing.append(f"{name} (in {expr!r})")
                continue
            have = set().union(*(s["metric"] for s in series))
            missing += [f"{name}{{{lb}}}" for lb in sorted(labels - have)]
        names = {n for n, _ in selectors(expr)}
        if names & skip:
            continue  # its `by` labels may come from the skipped metric
        have_all: set[str] = set()
        for n in names:
            have_all |= set().union(*(s["metric"] for s in prom.query(n)))
        missing += [f"by ({lb}) in {expr!r}" for lb in grouping_labels(expr) - have_all - {"le"}]
    return missing


def _names(exprs: list[str]) -> set[str]:
    return {n for e in exprs for n, _ in selectors(e)}


_ASKED = itertools.count()


def _hit_rate(api: int) -> None:
    """A hit-rate question with a request id, and the outcome report of the previous one
    (recorded by now): the audit's series exist too."""
    n = next(_ASKED)
    body = {
        "server_ip": [A, B, C],
        "request_id": f"stack-{n}",
        "body": {"token_ids": list(range(1, 65)), "block_size": BLOCK, "cache_salt": ""},
    }
    httpx.post(f"http://127.0.0.1:{api}/kv-cache/hit-rate", json=body, timeout=5)
    if n:
        report = {"request_id": f"stack-{n - 1}", "server_ip": A, "cached_tokens": 0}
        httpx.post(f"http://127.0.0.1:{api}/kv-cache/outcome", json=report, timeout=5)
    httpx.get(f"http://127.0.0.1:{api}/kv-cache/instances", timeout=5)


def test_prometheus_runs_every_query_and_faults_fire_their_alerts(
    tmp_path: Path, procs: list[subprocess.Popen[bytes]], subprocess_env: dict[str, str]
) -> None:
    for tool in ("prometheus", "promtool", "mooncake_master", "redis-server"):
        require(shutil.which(tool), f"{tool} is not installed (scripts/setup.sh installs it)")
    queries = _dashboard_queries()
    rules = load_rules()
    redis_server = RedisServer().start()
    try:
        _run(tmp_path, procs, subprocess_env, redis_server, queries, rules)
    finally:
        redis_server.cleanup()


def _run(
    tmp: Path,
    procs: list[subprocess.Popen[bytes]],
    env: dict[str, str],
    redis_server: RedisServer,
    queries: list[tuple[str, str]],
    rules: list[dict[str, Any]],
) -> None:
    stack = Stack(tmp, procs, env)
    master = _start_master(stack)
    dead_master = f"http://127.0.0.1:{reserve_port()}"
    ports = {ip: (reserve_port(), reserve_port()) for ip in (A, B, C)}
    api = reserve_port()
    config = _config(tmp, redis_server.url, api, ports, [master, dead_master])
    stack.pod(A, *ports[A], "--seed", "1", "--drop-every", "25")
    # B: a hybrid model (Gemma 3's groups) whose engine hashes with seed 1, the config says 0:
    # the self-check finds a mismatch, and with no confirmed hash unit B's answers are inexact.
    stack.pod(
        B,
        *ports[B],
        "--seed",
        "2",
        "--hash-seed",
        "1",
        "--model-shape",
        "gemma3",
        "--vllm-version",
        "0.30.0",
    )
    stack.pod(C, *ports[C], "--seed", "3")
    metrics = {job: reserve_port() for job in JOBS if job != "api"}
    workers = {
        job: stack.cli(job, job, "--config", str(config), "--metrics-port", str(port))
        for job, port in metrics.items()
    }
    stack.cli("api", "api", "--config", str(config))
    wait_for(
        lambda: httpx.get(f"http://127.0.0.1:{api}/readyz", timeout=1).status_code == 200,
        60,
        0.2,
        what="the API",
    )
    prom = _start_prometheus(stack, {"api": api, **metrics})
    exprs = [r["expr"] for r in rules] + [q for _, q in queries]
    _check_every_selector_and_query_has_data(prom, api, exprs, queries)
    _check_standing_faults(prom, master, dead_master)
    _check_induced_faults(prom, stack, redis_server, workers["l1-ingest"], api)
    # The per-instance gauges are gone now (the API cannot read Redis); the error counters
    # that only a Redis outage creates are there, with the labels the queries select.
    late = [e for e in exprs if _names([e]) & AFTER_REDIS_STOPS]
    assert late and _missing_selectors(prom, late, _names(exprs) - AFTER_REDIS_STOPS) == []


def _fired(prom: Prom, alert: str, **labels: str) -> bool:
    return any(all(a.get(k) == v for k, v in labels.items()) for a in prom.firing(alert))


def _check_every_selector_and_query_has_data(
    prom: Prom, api: int, exprs: list[str], queries: list[tuple[str, str]]
) -> None:
    """1. every target up; every selector has series; every dashboard query returns data."""
    wait_for(lambda: prom.targets_up() == {j: "up" for j in JOBS}, 60, 0.5, what="targets up")
    now = [q for _, q in queries if not _names([q]) & AFTER_REDIS_STOPS]

    def all_data() -> bool:
        _hit_rate(api)
        missing = _missing_selectors(prom, exprs, AFTER_REDIS_STOPS)
        return not missing and all(prom.query(q) for q in now)

    try:
        wait_for(all_data, 90, 1.0, what="every selector and dashboard query to have data")
    except AssertionError:
        missing = _missing_selectors(prom, exprs, AFTER_REDIS_STOPS)
        empty = [t for t, q in queries if q in now and not prom.query(q)]
        raise AssertionError(f"no data: selectors {missing}; panels {empty}") from None


def _check_standing_faults(prom: Prom, master: str, dead_master: str) -> None:
    """2. faults present from the start fire for the faulty instance / master only."""
    wait_for(
        lambda: _fired(prom, "CacheIndexerHashMismatch", server_ip=B), 90, 1.0, what="mismatch"
    )
    assert not _fired(prom, "CacheIndexerHashMismatch", server_ip=A)
    wait_for(
        lambda: _fired(prom, "CacheIndexerInexactAnswers", server_ip=B), 60, 1.0, what="inexact"
    )
    assert not _fired(prom, "CacheIndexerInexactAnswers", server_ip=A)
    wait_for(
        lambda: _fired(prom, "CacheIndexerL3MasterStale", url=dead_master), 60, 1.0, what="stale"
    )
    wait_for(
        lambda: _fired(prom, "CacheIndexerL3PollErrors", master=dead_master), 60, 1.0, what="errors"
    )
    assert not _fired(prom, "CacheIndexerL3MasterStale", url=master)
    for alert in ("CacheIndexerInstanceNotSynced", "CacheIndexerInstanceUnassigned"):
        assert not any(a.get("server_ip") in (A, C) for a in prom.firing(alert)), alert
    assert prom.firing("CacheIndexerWorkerNotLive") == []
    assert prom.firing("CacheIndexerRedisUnreachable") == []


def _check_induced_faults(
    prom: Prom,
    stack: Stack,
    redis_server: RedisServer,
    ingester: subprocess.Popen[bytes],
    api: int,
) -> None:
    """3.-6.: a pod stops, Redis fills up, the ingester stops, Redis stops."""
    stack.pods[C].terminate()
    stack.pods[C].wait(15)
    wait_for(lambda: _fired(prom, "CacheIndexerInstanceNotSynced", server_ip=C), 90, 1.0, what="C")
    assert not _fired(prom, "CacheIndexerInstanceNotSynced", server_ip=A)

    client = redis.Redis.from_url(redis_server.url)  # maxmemory just above what it uses
    client.config_set("maxmemory", int(int(client.info("memory")["used_memory"]) * 1.05))
    client.close()
    wait_for(lambda: prom.firing("CacheIndexerRedisMemoryHigh"), 60, 1.0, what="memory alert")

    ingester.terminate()  # the only one: nobody follows A any more
    ingester.wait(15)
    wait_for(lambda: _fired(prom, "CacheIndexerInstanceUnassigned", server_ip=A), 60, 1.0, what="A")

    redis_server.stop()

    def redis_alert() -> bool:
        _hit_rate(api)
        jobs = {a.get("job") for a in prom.firing("CacheIndexerRedisUnreachable")}
        return {"api", "discovery", "l3-poll"} <= jobs

    try:
        wait_for(redis_alert, 90, 1.0, what="Redis unreachable alert from the API and the workers")
    except AssertionError:
        alerts = prom.firing("CacheIndexerRedisUnreachable")
        conditions = prom.query("cache_indexer_worker_condition")
        raise AssertionError(f"firing: {alerts}; conditions: {conditions}") from None
    wait_for(lambda: prom.firing("CacheIndexerHitRateErrors"), 60, 1.0, what="5xx alert")
