"""Every speculative-decoding lookahead vector through the HTTP API, fed through the L1
ingester by vLLM's own event publisher, for every release in the vectors (0.33.0, 0.34.0).

The vectors (tests/data/extra-keys/lookahead_<release>.json) were made by vLLM's own hasher;
each case's ``block_stored_event`` is the event its ``BlockPool`` emitted. Per release, one
driver process (tests/integration/vllm_kv_events_publisher.py, the vLLM engine venv's python
with that release's own ``kv_events.py``: ``scripts/setup_vllm_kv_events.sh``) runs a
``ZmqEventPublisher`` per simulated instance on loopback and publishes, as vLLM 0.33+ does,
``BlockStored`` with ``lookahead_token_ids``. Per (L, block size) in the vectors there are two
instances: ``full`` holds every hashed block of every such case, ``half`` the first half of
each case's blocks (at least one). A real in-process L1 ingester subscribes to them (live and
replay) and learns each instance's L from the events alone (no configuration); then every
case is asked of every instance in one question over HTTP, of a ``cache-indexer api``
(gunicorn) configured with the case's seed and algo: an instance of the case's L and block
size answers the part of the golden chain it holds, every other instance 0.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import yaml

from common.store import Instance
from tests.conftest import DATA, ROOT, RedisServer, require, reserve_port, reserve_ports, wait_for
from tests.integration import vllm_engine as ve
from tests.integration.l1_support import InProcessIngester
from tests.store_oracle import OracleStore

RELEASES = ("0.33.0", "0.34.0")
DRIVER = Path(__file__).with_name("vllm_kv_events_publisher.py")
KV_EVENTS = Path(os.environ.get("VLLM_KV_EVENTS_DIR", "/var/tmp/cache-indexer-vllm-kv-events"))
TOPIC = "kv-events"  # the ingester's topic in tests.integration.l1_support.FAST


def golden(release: str) -> list[dict[str, Any]]:
    doc = json.loads((DATA / "extra-keys" / f"lookahead_{release}.json").read_text())
    cases: list[dict[str, Any]] = doc["cases"]
    assert len(cases) == 26
    return cases


def held(case: dict[str, Any], part: str) -> int:
    """How many of the case's hashed blocks the ``part`` instance holds."""
    hashes = len(case["block_hashes_event_int"])
    return hashes if part == "full" else min(hashes, max(1, hashes // 2))


def event_fields(case: dict[str, Any], k: int) -> dict[str, Any]:
    """The case's BlockStored (vLLM's own), cut to its first ``k`` blocks, as vLLM's Struct
    takes it (``lora_id``, ``medium`` and ``lora_name`` have no default there)."""
    ev = case["block_stored_event"]
    size = ev["block_size"]
    return {
        "block_hashes": ev["block_hashes"][:k],
        "parent_block_hash": ev["parent_block_hash"],
        "token_ids": case["token_ids"][: k * size],
        "block_size": size,
        "lora_id": case["lora"]["int_id"] if case["lora"] else None,
        "medium": "GPU",
        "lora_name": ev["lora_name"],
        "extra_keys": ev["extra_keys"][:k],
        "lookahead_token_ids": ev["lookahead_token_ids"][:k],
    }


def ip_of(case: dict[str, Any], part: str) -> str:
    """The instance of the case's (L, block size) holding the ``part`` of its blocks."""
    return f"10.{case['lookahead_tokens']}.{case['block_size']}.{1 if part == 'full' else 2}"


@pytest.fixture()
def publishers(redis_client: redis.Redis) -> Iterator[Callable[[str], dict[str, tuple[int, int]]]]:
    """Start the release's driver for every (L, part) instance and register them; returns
    ip -> (L, block size). The driver is stopped (stdin closed, then its PID) afterwards."""
    missing = ve.engine_missing()
    require(missing is None, f"{missing} (scripts/setup.sh installs it)")
    procs: list[subprocess.Popen[str]] = []

    def start(release: str) -> dict[str, tuple[int, int]]:
        source = KV_EVENTS / release / "kv_events.py"
        require(source.is_file(), f"no {source} (scripts/setup_vllm_kv_events.sh extracts it)")
        cases = [c for c in golden(release) if c["block_stored_event"] is not None]
        ips = sorted({ip_of(c, part) for c in cases for part in ("full", "half")})
        base = reserve_ports(2 * len(ips))
        spec: dict[str, Any] = {"topic": TOPIC, "publishers": []}
        store = OracleStore(redis_client)
        expected: dict[str, tuple[int, int]] = {}
        for n, ip in enumerate(ips):
            pub = f"tcp://127.0.0.1:{base + 2 * n}"
            replay = f"tcp://127.0.0.1:{base + 2 * n + 1}"
            batches = [
                [event_fields(c, held(c, part))]
                for c in cases
                for part in ("full", "half")
                if ip_of(c, part) == ip
            ]
            spec["publishers"].append({"pub": pub, "replay": replay, "batches": batches})
            store.upsert_instance(
                Instance(ip=ip, uid=f"u-{ip}", pod=ip, zmq_endpoint=pub, replay_endpoint=replay)
            )
            _, lookahead, size, _ = map(int, ip.split("."))
            expected[ip] = (lookahead, size)
        proc = subprocess.Popen(
            [str(ve.engine_python()), str(DRIVER), str(source)],
            cwd=ROOT,
            env={k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        procs.append(proc)
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(json.dumps(spec) + "\n")
        proc.stdin.flush()
        line = proc.stdout.readline()
        assert line.startswith("{"), f"driver: {proc.stderr.read() if proc.stderr else ''}"
        assert json.loads(line)["published"] == 2 * len(cases)  # full and half
        return expected

    yield start
    for proc in procs:
        if proc.stdin is not None:
            proc.stdin.close()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def start_apis(
    release: str,
    cases: list[dict[str, Any]],
    redis_url: str,
    tmp_path: Path,
    env: dict[str, str],
    procs: list[subprocess.Popen[bytes]],
) -> dict[tuple[str, str | None], str]:
    """One ``cache-indexer api`` per (algo, seed) of the cases; their base URLs."""
    urls: dict[tuple[str, str | None], str] = {}
    for n, (algo, seed) in enumerate(sorted({(c["algo"], c["seed"]) for c in cases}, key=str)):
        port = reserve_port()
        config = tmp_path / f"api-{n}.yaml"
        doc = {
            "redis": {"url": redis_url},
            "http": {"addr": f"127.0.0.1:{port}", "workers": 1},
            "blockKey": {
                "vllmVersion": release,
                "pythonHashSeed": seed,
                "prefixCachingHashAlgo": algo,
            },
        }
        config.write_text(yaml.safe_dump(doc), encoding="utf-8")
        log = open(tmp_path / f"api-{n}.log", "ab")  # noqa: SIM115 - handed to the child
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "services.cli", "api", "--config", str(config)],
                cwd=ROOT,
                env=env,
                stdout=log,
                stderr=log,
            )
        )
        urls[algo, seed] = f"http://127.0.0.1:{port}"
    for url in urls.values():
        wait_for(lambda url=url: _ready(url), timeout=60, what=f"the API at {url}")
    return urls


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/readyz", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.mark.parametrize("release", RELEASES)
def test_every_lookahead_vector_through_the_api(
    release: str,
    redis_server: RedisServer,
    redis_client: redis.Redis,
    ingester: Callable[..., InProcessIngester],
    publishers: Callable[[str], dict[str, tuple[int, int]]],
    tmp_path: Path,
    subprocess_env: dict[str, str],
    procs: list[subprocess.Popen[bytes]],
) -> None:
    instances = publishers(release)
    ingester()
    store = OracleStore(redis_client)
    cases = golden(release)
    want: dict[str, set[int]] = {ip: set() for ip in instances}
    for case in cases:
        for part in ("full", "half"):
            if case["block_stored_event"] is not None:
                want[ip_of(case, part)].update(case["block_hashes_event_int"][: held(case, part)])
    for ip, (lookahead, _) in instances.items():  # learned from the events alone
        wait_for(
            lambda ip=ip, la=str(lookahead): (
                store.tier_members(ip) == want[ip] and store.groups(ip).get("la") == la
            ),
            timeout=60,
            what=f"{ip}'s blocks and L from vLLM {release}'s publisher",
        )
    ips = list(instances)
    urls = start_apis(release, cases, redis_server.url, tmp_path, subprocess_env, procs)
    for case in cases:
        scores = ask(urls[case["algo"], case["seed"]], ips, case)
        n_blocks = len(case["token_ids"]) // case["block_size"]
        for score in scores:
            ip = score["server_ip"]
            run = held(case, "full" if ip.endswith(".1") else "half")
            if instances[ip] != (case["lookahead_tokens"], case["block_size"]):
                run = 0  # another L never shares a hash; another block size is not asked
            tokens = min(run, (len(case["token_ids"]) - 1) // case["block_size"])
            assert (score["l1_hit_ratio"], score["l1_hit_tokens"]) == (
                run / n_blocks,
                tokens * case["block_size"],
            ), (case["name"], score)
            assert score["l1_exact"] == (instances[ip][1] == case["block_size"]), score
    report = httpx.get(f"{urls['sha256_cbor', '0']}/kv-cache/instances", timeout=10).json()
    shown = {i["server_ip"]: i["groups"] for i in report["instances"]}
    for ip, (lookahead, _) in instances.items():
        assert shown[ip]["lookahead_tokens"] == lookahead
        assert shown[ip]["lookahead_source"] == "events"


def ask(url: str, ips: list[str], case: dict[str, Any]) -> list[dict[str, Any]]:
    """One question: the case's prompt and hash inputs, every instance a candidate."""
    body: dict[str, Any] = {"token_ids": case["token_ids"], "block_size": case["block_size"]}
    if case["cache_salt"] is not None:
        body["cache_salt"] = case["cache_salt"]
    if case["lora"]:
        body["lora_name"], body["lora_path"] = case["lora"]["name"], case["lora"]["path"]
    if case["mm_features"]:
        body["mm_features"] = [
            {"identifier": m["identifier"], "offset": m["offset"], "length": m["length"]}
            for m in case["mm_features"]
        ]
    doc = {"server_ip": ips, "body": body}
    result = httpx.post(f"{url}/kv-cache/hit-rate?detail=1", json=doc, timeout=30)
    assert result.status_code == 200, (case["name"], result.text)
    scores: list[dict[str, Any]] = result.json()["server_score_list"]
    return scores
