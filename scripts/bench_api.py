"""Benchmark ``POST /kv-cache/hit-rate`` under gunicorn against a trivial Falcon app, side by side.

Starts its own redis-server, ``cache-indexer api`` (2 workers) and, on the same gunicorn
settings, a trivial Falcon app (:func:`baseline_app`, stock ``gthread``) that only parses
the same body and reads the same sets with members hashed once at start-up:

- ``/trivial``: one pipelined SMISMEMBER per candidate (L1) — issue 12's yardstick;
- ``/floor``: one pipelined SMISMEMBER per candidate and tier — what any answer must cost
  without hashing.

Throughput (needs ``wrk``, Debian package ``wrk``): 8 candidates × 4,096 tokens, block 128,
half the candidates holding the whole prompt in L1; wrk runs on the API and on
``/trivial`` in turns, ``--rounds`` times, and the ratio of each pair is printed with
their median. Long prompts: 16 candidates × 131,072 tokens, one client, requests to the
API and to ``/floor`` in turns; p50/p99 of both, next to vLLM's own time to hash that
prompt (``--vllm-python``, see ``scripts/setup_vllm_bench_venv.sh``) and an in-process
breakdown of the API's stages. Prints Markdown.

Usage: ``python scripts/bench_api.py [--rounds 3] [--seconds 8] [--connections 8]
[--requests-128k 60] [--vllm-python /tmp/vllm-venv/bin/python]``. Needs ``redis-server``.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import orjson
import redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common import blockhash_native, keys
from common.blockhash import BlockHasher
from common.config import Redis
from common.settings import ApiSettings
from common.store import Instance, Store, TierOps
from services.api import hit_rate
from services.api.api_metrics import ApiMetrics
from tests.store_oracle import OracleStore

from bench_util import free_port, stop, wait_for

BLOCK = 128
NOISE = 20_000  # unrelated block hashes per instance and tier
_STARTING = (OSError, httpx.HTTPError, redis.RedisError)  # a server still starting
MEMBERS_ENV = "BENCH_API_MEMBERS"  # file: {"<token count>": [members...]} for the baseline


def _members() -> dict[int, list[bytes]]:
    return {
        int(k): [m.encode() for m in v]
        for k, v in orjson.loads(Path(os.environ[MEMBERS_ENV]).read_bytes()).items()
    }


class Precomputed:
    """A hasher that knows the bench prompts' member keys: the API with hashing taken out."""

    def __init__(self, members: dict[int, list[bytes]]) -> None:
        self.members = members

    def member_keys(
        self, token_ids: list[int], block_size: int, cache_salt: str | None = None
    ) -> list[bytes]:
        return self.members[len(token_ids)]


def api_without_hashing_app() -> Any:
    """The real API app (gunicorn entry point) over a :class:`Precomputed` hasher."""
    from services.api.app import create_app, redis_client

    settings = ApiSettings(max_hit_rate_body_bytes=8388608)
    redis_cfg = Redis(url=os.environ["BENCH_API_REDIS"])
    return create_app(
        settings, Store(redis_client(redis_cfg)), Precomputed(_members()), ApiMetrics()
    )


def baseline_app() -> Any:
    """The trivial app (gunicorn entry point): parse, one pipelined read, tiny answer."""
    import falcon

    members = _members()
    client = redis.Redis.from_url(os.environ["BENCH_API_REDIS"])

    class Read:
        def __init__(self, tiers: tuple[Callable[[str], str], ...]) -> None:
            self.tiers = tiers

        def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
            doc = orjson.loads(req.bounded_stream.read())
            wanted = members[len(doc["body"]["token_ids"])]
            pipe = client.pipeline(transaction=False)
            for ip in doc["server_ip"]:
                for key in self.tiers:
                    pipe.smismember(key(ip), wanted)
            resp.data = orjson.dumps({"held": [sum(r) for r in pipe.execute()]})

    app = falcon.App()
    app.add_route("/trivial", Read((keys.tier_set,)))
    app.add_route("/floor", Read((keys.tier_set, keys.l3_set)))
    return app


def _populate(store: Store, rng: random.Random, prompt: list[int], ips: list[str]) -> None:
    """Even candidates hold the whole prompt in L1, odd ones none of it; every candidate
    holds the first half in L3; all sets also hold unrelated blocks."""
    for i, ip in enumerate(ips):
        _, gen = store.upsert_instance(Instance(ip=ip, uid=f"bench-{ip}"))
        ops = TierOps()
        ops.store(
            "l1", (prompt if i % 2 == 0 else []) + [rng.getrandbits(63) for _ in range(NOISE)]
        )
        store.apply_batch(ip, gen, 0, 1, ops)
        store.replace_l3(
            ip, prompt[: len(prompt) // 2] + [rng.getrandbits(63) for _ in range(NOISE)]
        )


def _prompt(
    hasher: BlockHasher, store: Store, tokens: int, candidates: int, subnet: int
) -> tuple[bytes, list[str], list[int], list[bytes]]:
    rng = random.Random(tokens)
    prompt = [rng.randrange(151_936) for _ in range(tokens)]
    members = hasher.member_keys(prompt, BLOCK)
    ips = [f"10.{subnet}.0.{i + 1}" for i in range(candidates)]
    _populate(store, rng, [int(m) for m in members], ips)
    body = orjson.dumps(
        {"server_ip": ips, "body": {"token_ids": prompt, "cache_salt": "", "block_size": BLOCK}}
    )
    return body, ips, prompt, members


def _wrk(url: str, body_file: Path, args: argparse.Namespace) -> float:
    script = body_file.with_suffix(".lua")
    script.write_text(
        f'wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\n'
        f'local f = io.open("{body_file}", "rb")\nwrk.body = f:read("*a")\n'
        f"f:close()\n"
    )
    out = subprocess.run(
        ["wrk", "-t1", f"-c{args.connections}", f"-d{args.seconds}s", "-s", str(script), url],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    if "Non-2xx" in out:
        raise SystemExit(f"bench: non-2xx answers from {url}:\n{out}")
    match = re.search(r"Requests/sec:\s+([\d.]+)", out)
    if not match:
        raise SystemExit(f"bench: no rate in wrk output:\n{out}")
    return float(match.group(1))


def _cpu_seconds(master: int) -> float:
    """User + system CPU of a gunicorn master's worker processes, from /proc."""
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == master:  # ppid
            total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / os.sysconf("SC_CLK_TCK")


def _one(client: httpx.Client, url: str, body: bytes) -> float:
    start = time.perf_counter()
    resp = client.post(url, content=body, headers={"Content-Type": "application/json"})
    elapsed = time.perf_counter() - start
    if resp.status_code != 200:
        raise SystemExit(f"bench: {url} answered {resp.status_code}: {resp.text[:200]}")
    return elapsed


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


def _stages(body: bytes, store: Store, hasher: BlockHasher, repeat: int) -> list[str]:
    """Best and median in-process time of each stage of the API's work on ``body``."""
    request = hit_rate.parse_request(body)
    metrics = ApiMetrics()
    members = hasher.member_keys(request.token_ids, BLOCK)
    scores = hit_rate.score(request, store, hasher, metrics)
    stages: list[tuple[str, Callable[[], object]]] = [
        ("orjson.loads", lambda: orjson.loads(body)),
        ("parse_request (loads + validation)", lambda: hit_rate.parse_request(body)),
        ("member_keys (hashing)", lambda: hasher.member_keys(request.token_ids, BLOCK)),
        (
            "prefix_lengths (one pipelined round trip, Store.execute)",
            lambda: store.prefix_lengths(request.server_ips, members),
        ),
        (
            "response orjson.dumps",
            lambda: orjson.dumps({"server_score_list": scores, "message": "", "status": 0}),
        ),
        (
            "all of the above (score + parse + dumps)",
            lambda: orjson.dumps(
                {
                    "server_score_list": hit_rate.score(
                        hit_rate.parse_request(body), store, hasher, metrics
                    ),
                    "message": "",
                    "status": 0,
                }
            ),
        ),
    ]
    rows = ["| stage (in-process, one thread) | best ms | median ms |", "|---|---:|---:|"]
    for name, func in stages:
        func()
        times = []
        for _ in range(repeat):
            start = time.perf_counter()
            func()
            times.append(time.perf_counter() - start)
        rows.append(f"| {name} | {min(times) * 1000:.2f} | {statistics.median(times) * 1000:.2f} |")
    return rows


def _cpu_per_request(
    body: bytes, store: Store, hasher: BlockHasher, batches: int = 60, per_batch: int = 20
) -> list[str]:
    """CPU time of this thread per request through each WSGI app, in-process, no HTTP: the
    apps take turns batch by batch and each keeps its best batch (time waiting for Redis or
    for a CPU another process holds is not counted), so the machine's load moves it little."""
    import io

    from services.api.app import create_app

    apps = [
        ("API", create_app(ApiSettings(), store, hasher, ApiMetrics()), hit_rate.PATH),
        ("API, hashing taken out", api_without_hashing_app(), hit_rate.PATH),
        ("trivial app (/trivial)", baseline_app(), "/trivial"),
        ("floor (/floor)", baseline_app(), "/floor"),
    ]

    def caller(app: Any, path: str) -> Callable[[], bytes]:
        def call() -> bytes:
            env = {
                "REQUEST_METHOD": "POST",
                "PATH_INFO": path,
                "QUERY_STRING": "",
                "CONTENT_LENGTH": str(len(body)),
                "CONTENT_TYPE": "application/json",
                "wsgi.input": io.BytesIO(body),
                "wsgi.errors": sys.stderr,
                "SERVER_NAME": "b",
                "SERVER_PORT": "80",
                "wsgi.url_scheme": "http",
                "SERVER_PROTOCOL": "HTTP/1.1",
            }
            return b"".join(app(env, lambda status, headers: None))

        return call

    calls = {name: caller(app, path) for name, app, path in apps}
    best = dict.fromkeys(calls, float("inf"))
    for _ in range(batches):
        for name, call in calls.items():
            start = time.thread_time()
            for _ in range(per_batch):
                call()
            best[name] = min(best[name], (time.thread_time() - start) / per_batch)
    trivial = best["trivial app (/trivial)"]
    rows = [
        f"| WSGI app (in-process, no HTTP; best of {batches} batches of {per_batch}) "
        "| CPU µs per request | trivial app / this |",
        "|---|---:|---:|",
    ]
    rows += [f"| {name} | {cpu * 1e6:,.0f} | {trivial / cpu:.2f} |" for name, cpu in best.items()]
    return rows


def _throughput(
    http: dict[str, tuple[str, int]], body: bytes, tmp: Path, args: argparse.Namespace
) -> list[str]:
    """wrk on each server in turn, ``args.rounds`` times; req/s, CPU per request, ratios."""
    (tmp / "small.json").write_bytes(body)
    names = list(http)
    lines = [
        "**Throughput**: 8 candidates × 4,096 tokens, block 128 "
        f"(body {len(body) / 1024:.0f} KiB), wrk -t1 -c{args.connections} "
        f"-d{args.seconds}s, {args.workers} workers each; req/s, and the workers' CPU ms "
        "per request; ratio = vs the trivial app",
        "",
        "| round | " + " | ".join(names) + " | API ratio | API CPU ratio | API without "
        "hashing ratio |",
        "|---|" + "---:|" * (len(names) + 3),
    ]
    ratios: list[list[float]] = [[], [], []]
    for n in range(args.rounds):
        rate, cpu = {}, {}
        for name, (url, pid) in http.items():
            path = url if name != "trivial app" else f"{url}/trivial"
            before = _cpu_seconds(pid)
            rate[name] = _wrk(path, tmp / "small.json", args)
            cpu[name] = (_cpu_seconds(pid) - before) / (rate[name] * args.seconds) * 1000
        trivial = "trivial app"
        row = [
            rate["API"] / rate[trivial],
            cpu[trivial] / cpu["API"],
            rate["API, hashing taken out"] / rate[trivial],
        ]
        for i, value in enumerate(row):
            ratios[i].append(value)
        lines.append(
            f"| {n + 1} | "
            + " | ".join(f"{rate[k]:,.0f} ({cpu[k]:.2f} ms)" for k in names)
            + " | "
            + " | ".join(f"{v:.2f}" for v in row)
            + " |"
        )
    lines.append(
        "| median | "
        + " | " * (len(names) - 1)
        + " | "
        + " | ".join(f"**{statistics.median(r):.2f}**" for r in ratios)
        + " |"
    )
    return lines


def _vllm_ms(python: str | None, prompt: list[int]) -> tuple[float | None, str]:
    """vLLM's own best time to hash ``prompt`` (ms, thread CPU time in a child process that
    scripts/bench_hash.py drives), or None and why it was not measured."""
    if not python:
        return None, "not measured (no --vllm-python)"
    sys.path.insert(0, str(Path(__file__).parent))
    from bench_hash import VLLM_CHILD, ChildHasher

    try:
        child = ChildHasher(python, VLLM_CHILD, {"p": prompt})
    except RuntimeError as exc:
        return None, f"not measured ({exc})"
    try:
        ms = min(child.time_ns("cpu", "p", BLOCK) for _ in range(20)) / 1e6
    finally:
        child.close()
    return ms, f"{ms:.2f} ms (vLLM {child.version}, best of 20, CPU time)"


class Servers:
    """redis-server, the API and the baseline app; everything this script started."""

    def __init__(self, tmp: Path, workers: int) -> None:
        self.tmp, self.workers = tmp, workers
        self.procs: list[subprocess.Popen[bytes]] = []
        self.redis_port, self.api_port, self.base_port = free_port(), free_port(), free_port()
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("CACHE_INDEXER_")}
        self.env["PYTHONPATH"] = str(ROOT)
        self._start(
            [
                "redis-server",
                "--port",
                str(self.redis_port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(tmp),
            ]
        )
        self.client = redis.Redis(port=self.redis_port)
        wait_for(self.client.ping, "redis-server", 30, tolerate=_STARTING)

    def _start(self, argv: list[str], env: dict[str, str] | None = None) -> None:
        self.procs.append(
            subprocess.Popen(argv, cwd=ROOT, env=env or self.env, stdout=subprocess.DEVNULL)
        )

    def start_http(self, members: dict[int, list[bytes]]) -> dict[str, tuple[str, int]]:
        """The API, the API without hashing and the trivial app: name → (url, master pid)."""
        ports = [free_port() for _ in range(3)]
        config = self.tmp / "config.yaml"
        config.write_text(
            f'http:\n  addr: "127.0.0.1:{ports[0]}"\n  workers: {self.workers}\n'
            f"  maxHitRateBodyBytes: 8388608\nlog:\n  level: warning\n"
            f"redis:\n  url: redis://127.0.0.1:{self.redis_port}/0\n"
        )
        self._start([sys.executable, "-m", "services.cli", "api", "--config", str(config)])
        members_file = self.tmp / "members.json"
        members_file.write_bytes(
            orjson.dumps({str(k): [m.decode() for m in v] for k, v in members.items()})
        )
        os.environ[MEMBERS_ENV] = str(members_file)
        os.environ["BENCH_API_REDIS"] = f"redis://127.0.0.1:{self.redis_port}/0"
        env = {
            **self.env,
            MEMBERS_ENV: str(members_file),
            "BENCH_API_REDIS": os.environ["BENCH_API_REDIS"],
        }
        for port, worker, app in (
            (ports[1], "services.api.transport.worker.DeadlineWorker", "api_without_hashing_app()"),
            (ports[2], "gthread", "baseline_app()"),
        ):
            self._start(
                [
                    sys.executable,
                    "-m",
                    "gunicorn",
                    "--workers",
                    str(self.workers),
                    "--worker-class",
                    worker,
                    "--threads",
                    "4",
                    "--log-level",
                    "warning",
                    "--bind",
                    f"127.0.0.1:{port}",
                    "--pythonpath",
                    "scripts",
                    f"bench_api:{app}",
                ],
                env,
            )
        for port in ports:
            wait_for(
                lambda p=port: (
                    httpx.get(f"http://127.0.0.1:{p}/healthz").status_code in (200, 404, 405)
                ),
                f"the server on {port}",
                30,
                tolerate=_STARTING,
            )
        urls = [
            f"http://127.0.0.1:{ports[0]}{hit_rate.PATH}",
            f"http://127.0.0.1:{ports[1]}{hit_rate.PATH}",
            f"http://127.0.0.1:{ports[2]}",
        ]
        names = ("API", "API, hashing taken out", "trivial app")
        return {name: (url, proc.pid) for name, url, proc in zip(names, urls, self.procs[1:])}

    def stop(self) -> None:
        for proc in reversed(self.procs):
            stop(proc)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=int, default=8)
    parser.add_argument("--connections", type=int, default=8)
    parser.add_argument("--requests-128k", type=int, default=60)
    parser.add_argument("--vllm-python")
    args = parser.parse_args()
    if not shutil.which("wrk"):
        raise SystemExit("bench: wrk is not installed (apt-get install -y wrk)")
    tmp = Path(tempfile.mkdtemp(prefix="bench-api-"))
    servers = Servers(tmp, args.workers)
    try:
        store, hasher = OracleStore(servers.client), BlockHasher(ApiSettings().hash)
        small, _, _, small_members = _prompt(hasher, store, 4096, 8, 41)
        large, _, large_prompt, large_members = _prompt(hasher, store, 131072, 16, 42)
        http = servers.start_http({4096: small_members, 131072: large_members})
        api, base = http["API"][0], http["trivial app"][0]
        lines = [
            f"redis-server {servers.client.info()['redis_version']}, Python "
            f"{sys.version.split()[0]}, {os.cpu_count()} CPUs shared by wrk, the servers "
            f"and Redis; the API's {blockhash_native.status()}",
            "",
        ]
        lines += _throughput(http, small, tmp, args) + [""]
        lines += _cpu_per_request(small, store, hasher) + [""]
        targets = {
            "API": api,
            "API, hashing taken out": http["API, hashing taken out"][0],
            "floor (parse + one pipelined read of both tiers, no hashing)": f"{base}/floor",
        }
        lat: dict[str, list[float]] = {name: [] for name in targets}
        with httpx.Client(timeout=60) as client:
            for _ in range(3):  # warm-up
                for url in targets.values():
                    _one(client, url, large)
            for _ in range(args.requests_128k):
                for name, url in targets.items():
                    lat[name].append(_one(client, url, large))
        floor = list(lat.values())[-1]
        lines += [
            "**Long prompt**: 16 candidates × 131,072 tokens, block 128 "
            f"(body {len(large) / 1024:.0f} KiB), one client, {args.requests_128k} "
            "requests each, in turns",
            "",
            "| path | p50 ms | p99 ms | p50 − floor p50 | p50 / floor p50 |",
            "|---|---:|---:|---:|---:|",
        ]
        lines += [
            f"| {name} | {_pct(v, 0.5):.1f} | {_pct(v, 0.99):.1f} | "
            f"{_pct(v, 0.5) - _pct(floor, 0.5):.1f} | {_pct(v, 0.5) / _pct(floor, 0.5):.2f} |"
            for name, v in lat.items()
        ]
        vllm, text = _vllm_ms(args.vllm_python, large_prompt)
        lines += ["", f"vLLM's own hashing of this prompt: {text}"]
        if vllm:
            extra = _pct(lat["API"], 0.5) - _pct(floor, 0.5)
            lines.append(
                f"API p50 − floor p50 = {extra:.1f} ms = {extra / vllm:.2f}× vLLM's "
                "hashing time (target: at most 1×)"
            )
        lines.append("")
        lines += _stages(large, store, hasher, 20)
        print("\n".join(lines))
    finally:
        servers.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
