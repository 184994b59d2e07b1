"""The real ``cache-indexer api`` (gunicorn, 2 gthread workers) against a real redis-server."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from common.blockhash import BlockHasher
from common.settings import ApiSettings
from common.store import Instance, Store, TierOps
from services.api.hit_rate import UNREACHABLE
from tests.conftest import DATA, ROOT, RedisServer, reserve_port, wait_for

PATH = "/kv-cache/hit-rate"
BS = 128
LIMIT = 65536
SHUTDOWN = 5
IP = "10.1.0.7"
MAX_CANDIDATES = 8


class Api:
    """One ``python -m services.cli api`` process that this test started."""

    def __init__(
        self,
        tmp: Path,
        redis_url: str,
        http_extra: str = "",
        log_level: str = "info",
        extra_yaml: str = "",
    ) -> None:
        self.port = reserve_port()
        self.log_path = tmp / "api.log"
        self.url = f"http://127.0.0.1:{self.port}"
        config = tmp / "config.yaml"
        config.write_text(
            f'http:\n  addr: "127.0.0.1:{self.port}"\n  shutdownTimeout: {SHUTDOWN}s\n'
            f"  maxHitRateBodyBytes: {LIMIT}\n  workers: 2\n  threads: 4\n"
            f"  maxCandidates: {MAX_CANDIDATES}\n{http_extra}log:\n  level: {log_level}\n"
            f"redis:\n  url: {redis_url}\n  socketTimeout: 1s\n  connectTimeout: 1s\n" + extra_yaml
        )
        env = {k: v for k, v in os.environ.items() if not k.startswith("CACHE_INDEXER_")}
        env["PYTHONPATH"] = str(ROOT)
        self.log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "api", "--config", str(config)],
            cwd=ROOT,
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        try:
            wait_for(
                lambda: httpx.get(f"{self.url}/healthz").status_code == 200,
                timeout=20,
                what="the API to answer /healthz",
            )
        except AssertionError:
            self.stop()
            raise

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(SHUTDOWN + 5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


@pytest.fixture(scope="module")
def api(redis_srv: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Api]:
    server = Api(tmp_path_factory.mktemp("api"), redis_srv.url)
    yield server
    server.stop()


def _hit_rate(api: Api, tokens: list[int], ips: list[str]) -> httpx.Response:
    body = {"server_ip": ips, "body": {"token_ids": tokens, "cache_salt": "", "block_size": BS}}
    return httpx.post(f"{api.url}{PATH}", json=body)


def test_hit_rate_over_http(api: Api, redis_srv: RedisServer) -> None:
    tokens = [(i * 7919) % 150_000 for i in range(10 * BS + 5)]
    members = [int(m) for m in BlockHasher(ApiSettings().hash).member_keys(tokens[: 10 * BS], BS)]
    store = Store(redis.Redis.from_url(redis_srv.url))
    _, gen = store.upsert_instance(Instance(ip=IP, uid="pod-uid"))
    ops = TierOps()
    ops.store("l1", members[:7])
    store.apply_batch(IP, gen, 0, 1, ops)
    store.replace_l3(IP, members[:3] + members[4:])
    resp = _hit_rate(api, tokens, [IP, "10.9.9.9", IP])
    assert resp.status_code == 200
    assert resp.json() == {
        "server_score_list": [
            {"server_ip": IP, "l1_hit_ratio": 0.7, "l3_hit_ratio": 0.3},
            {"server_ip": "10.9.9.9", "l1_hit_ratio": 0.0, "l3_hit_ratio": 0.0},
            {"server_ip": IP, "l1_hit_ratio": 0.7, "l3_hit_ratio": 0.3},
        ],
        "message": "",
        "status": 0,
    }


def test_instances_over_http(api: Api, redis_srv: RedisServer) -> None:
    store = Store(redis.Redis.from_url(redis_srv.url))
    store.upsert_instance(Instance(ip="10.1.0.8", uid="pod-uid-8", pod="vllm-8"))
    for _ in range(3):  # every worker, whatever registry it saw before, answers in full
        resp = httpx.get(f"{api.url}/kv-cache/instances")
        assert resp.status_code == 200
        doc = resp.json()
        inst = next(i for i in doc["instances"] if i["server_ip"] == "10.1.0.8")
        assert inst["pod"] == "vllm-8" and inst["l1"]["state"] == "unassigned"
        assert doc["masters"] == []
    assert "cache_indexer_instance_l1_state" in httpx.get(f"{api.url}/metrics").text


def test_error_statuses_over_http(api: Api) -> None:
    for method in ("GET", "OPTIONS", "FOO"):
        resp = httpx.request(method, f"{api.url}{PATH}")
        assert (resp.status_code, resp.json()["status"], resp.headers["allow"]) == (
            405,
            405,
            "POST",
        )
    resp = httpx.post(f"{api.url}{PATH}", content=b"{not json")
    assert (resp.status_code, resp.json()["status"]) == (400, 400)
    resp = httpx.post(f"{api.url}{PATH}", content=b" " * (LIMIT + 1))
    assert resp.json() == {
        "server_score_list": [],
        "status": 413,
        "message": f"the request body is larger than the limit of {LIMIT} bytes",
    }
    assert httpx.post(f"{api.url}{PATH}", content=_padded(LIMIT)).status_code == 200
    assert httpx.post(f"{api.url}{PATH}", content=_padded(LIMIT + 1)).status_code == 413
    assert httpx.post(f"{api.url}{PATH}", content=_pieces(_padded(LIMIT))).status_code == 200
    assert httpx.post(f"{api.url}{PATH}", content=_pieces(_padded(LIMIT + 1))).status_code == 413
    chunks = (b" " * 8192 for _ in range(3 * LIMIT // 8192))  # an iterator: sent chunked
    resp = httpx.post(f"{api.url}{PATH}", content=chunks)
    assert (resp.status_code, resp.json()["status"]) == (413, 413)
    resp = httpx.get(f"{api.url}/no/such/path")
    assert (resp.status_code, resp.json()["status"]) == (404, 404)


def test_candidate_limit_over_http(api: Api) -> None:
    ips = [f"10.2.0.{i}" for i in range(MAX_CANDIDATES + 1)]
    resp = _hit_rate(api, list(range(BS)), ips[:MAX_CANDIDATES] * 3)
    assert resp.status_code == 200 and len(resp.json()["server_score_list"]) == 3 * MAX_CANDIDATES
    resp = _hit_rate(api, list(range(BS)), ips)
    assert resp.status_code == 400
    assert resp.json() == {
        "server_score_list": [],
        "status": 400,
        "message": (
            f"server_ip names {MAX_CANDIDATES + 1} distinct instances, more than the limit of "
            f"{MAX_CANDIDATES} (http.maxCandidates)"
        ),
    }


def _padded(size: int) -> bytes:
    """A valid hit-rate request padded with JSON whitespace to exactly ``size`` bytes."""
    doc = json.dumps({"server_ip": [IP], "body": {"token_ids": [1] * BS, "block_size": BS}})
    return doc.encode() + b" " * (size - len(doc))


def _pieces(data: bytes, size: int = 4096) -> Iterator[bytes]:
    """The body as an iterator: httpx sends it chunked, without a Content-Length."""
    return (data[i : i + size] for i in range(0, len(data), size))


def test_a_large_content_length_is_refused_before_the_body_is_sent(api: Api) -> None:
    """The client declares a 1 GB body and sends none of it: the 413 must come back anyway
    (an API that read the body first would wait for it until the client gave up)."""
    head = (
        f"POST {PATH} HTTP/1.1\r\nHost: 127.0.0.1:{api.port}\r\n"
        "Content-Type: application/json\r\nContent-Length: 1000000000\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", api.port), timeout=30) as sock:
        sock.sendall(head.encode())
        answer = b""
        while b"\r\n\r\n" not in answer:
            chunk = sock.recv(4096)
            assert chunk, f"connection closed without an answer: {answer!r}"
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 413 "), answer[:200]


def _healthz_405s(api: Api) -> int:
    text = httpx.get(f"{api.url}/metrics").text
    m = re.search(
        r'^cache_indexer_api_requests_total\{path="/healthz",status="405"\} (\S+)$',
        text,
        re.MULTILINE,
    )
    return int(float(m.group(1))) if m else 0


def test_metrics_are_summed_over_workers(api: Api) -> None:
    served_by: list[str] = []

    def both_workers_served() -> bool:
        # A new connection each time, so that both workers take some; each answer names
        # the worker that gave it (X-Served-By).
        resp = httpx.post(f"{api.url}/healthz")
        assert resp.status_code == 405
        served_by.append(resp.headers["x-served-by"])
        return len(served_by) >= 20 and len(set(served_by)) == 2

    wait_for(both_workers_served, timeout=60, interval=0, what="both workers to answer")
    assert all(int(pid) != api.proc.pid for pid in served_by), "the master never serves"
    n = len(served_by)
    wait_for(lambda: _healthz_405s(api) == n, timeout=10, what=f"the metrics to count {n} 405s")
    scrapers = set()

    def both_workers_scraped() -> bool:  # whichever worker answers sees every worker's counts
        resp = httpx.get(f"{api.url}/metrics")
        scrapers.add(resp.headers["x-served-by"])
        assert _healthz_405s(api) == n
        return len(scrapers) == 2

    wait_for(both_workers_scraped, timeout=60, interval=0, what="both workers to scrape")
    text = httpx.get(f"{api.url}/metrics").text
    assert "cache_indexer_api_request_duration_seconds_bucket" in text


def test_readyz_follows_redis(api: Api, redis_srv: RedisServer) -> None:
    assert httpx.get(f"{api.url}/readyz").status_code == 200
    redis_srv.stop()
    try:
        resp = httpx.get(f"{api.url}/readyz")
        assert resp.status_code == 503 and resp.json()["status"] == "unavailable"
        resp = _hit_rate(api, list(range(BS)), [IP])
        assert resp.status_code == 500
        assert resp.json() == {"server_score_list": [], "message": UNREACHABLE, "status": 500}
        assert httpx.get(f"{api.url}/healthz").status_code == 200
    finally:
        redis_srv.start()  # the same port: the API's pooled clients reconnect by themselves
    wait_for(
        lambda: all(httpx.get(f"{api.url}/readyz").status_code == 200 for _ in range(4)),
        timeout=10,
        what="readyz to recover on every worker",
    )


def test_sigterm_stops_cleanly(redis_srv: RedisServer, tmp_path: Path) -> None:
    """SIGTERM: the master and its workers exit 0 and the port is released. (How long the
    workers get to finish is gunicorn's graceful_timeout, set from http.shutdownTimeout.)"""
    api = Api(tmp_path, redis_srv.url)
    api.proc.send_signal(signal.SIGTERM)
    assert api.proc.wait(60) == 0
    api.stop()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{api.url}/healthz")


VECTORS = json.loads((DATA / "vllm_hash_vectors.json").read_text(encoding="utf-8"))["versions"]


def test_api_process_hashes_with_the_configured_block_key(
    redis_srv: RedisServer, tmp_path: Path
) -> None:
    """A non-default blockKey in the config file (vLLM 0.34, pickle-based sha256, no
    PYTHONHASHSEED): Redis holds the hashes real vLLM made for the prompt, read from the
    vectors file, and the API process must find them all."""
    case = next(c for c in VECTORS["0.34.0"] if c["name"] == "pickle_no_seed")
    members = [int(h[-16:], 16) for h in case["block_hashes_hex"]]
    store = Store(redis.Redis.from_url(redis_srv.url))
    ip = "10.1.0.34"
    _, gen = store.upsert_instance(Instance(ip=ip, uid="pod-034"))
    ops = TierOps()
    ops.store("l1", members)
    assert store.apply_batch(ip, gen, 0, 1, ops).status == "applied"
    api = Api(
        tmp_path,
        redis_srv.url,
        "blockKey:\n  prefixCachingHashAlgo: sha256\n"
        "  pythonHashSeed: null\n  vllmVersion: 0.34.0\n",
    )
    try:
        body = {
            "server_ip": [ip],
            "body": {"token_ids": case["token_ids"], "block_size": case["block_size"]},
        }
        resp = httpx.post(f"{api.url}{PATH}", json=body)
        assert resp.status_code == 200, resp.text
        assert resp.json()["server_score_list"] == [
            {"server_ip": ip, "l1_hit_ratio": 1.0, "l3_hit_ratio": 0.0}
        ]
    finally:
        assert api.stop() == 0


@pytest.mark.parametrize(
    ("yaml_text", "expected"),
    [
        ("http:\n  addr: ':0'\n  workerz: 3\n", b"http.workerz: unknown key"),
        ("blockKey:\n  pythonHashSeed: null\n  vllmVersion: 0.28.0\n", b"PYTHONHASHSEED is unset"),
    ],
)
def test_config_error_exits_2_before_serving(
    tmp_path: Path, yaml_text: str, expected: bytes
) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text(yaml_text)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CACHE_INDEXER_")}
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run(
        [sys.executable, "-m", "services.cli", "api", "--config", str(config)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 2
    assert expected in done.stderr
    assert b"Booting worker" not in done.stderr
