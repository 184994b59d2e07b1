"""A flood of outcome reports — malformed, oversized, for unknown questions, for instances
that were no candidate, duplicates, and valid but wrong ones for many instances — at the real
``cache-indexer api`` (gunicorn) while a client keeps asking hit-rate: every report gets a
clear 4xx or its verdict (never a 5xx), every hit-rate answer stays correct, and what the
audit keeps in Redis stays within its caps (no key for a refused report)."""

from __future__ import annotations

import itertools
import random
import threading
from pathlib import Path

import httpx
import orjson
import redis

from common import keys
from common.blockhash import BlockHasher
from common.settings import ApiSettings
from common.store import Instance, Store, TierOps
from tests.conftest import RedisServer
from tests.integration.test_api_gunicorn import Api

BS = 16
PROMPT = list(range(500, 500 + 8 * BS))
IPS = [f"10.7.0.{i}" for i in range(1, 7)]  # instance i holds the first i blocks
RECENT, WORST = 10, 3
FLOOD = 1200


def _populate(store: Store) -> None:
    members = [int(m) for m in BlockHasher(ApiSettings().hash).member_keys(PROMPT, BS)]
    for i, ip in enumerate(IPS, 1):
        _, gen = store.upsert_instance(Instance(ip=ip, uid=f"uid-{ip}"))
        ops = TierOps()
        ops.store("l1", members[:i])
        assert store.apply_batch(ip, gen, 0, 1, ops).status == "applied"


def _bodies(rng: random.Random, n: int) -> list[tuple[str, bytes]]:
    """(kind, body) of the flood: refused ones and valid but wrong ones."""
    kinds = ["malformed", "unknown", "oversized", "not_candidate", "valid"]
    out = []
    for i in range(n):
        kind = rng.choice(kinds)
        if kind == "malformed":
            body = rng.choice([b"", b"{", b"[]", b'{"request_id": 5}', b'{"cached_tokens": -1}'])
        elif kind == "unknown":
            body = orjson.dumps(
                {"request_id": f"nope-{i}", "server_ip": IPS[0], "cached_tokens": 3}
            )
        elif kind == "oversized":
            body = orjson.dumps({"request_id": "x", "server_ip": "y" * 8000, "cached_tokens": 1})
        elif kind == "not_candidate":
            body = orjson.dumps({"request_id": "q-0", "server_ip": "10.9.9.9", "cached_tokens": 1})
        else:
            q = rng.randrange(40)
            body = orjson.dumps(
                {
                    "request_id": f"q-{q}",
                    "server_ip": IPS[q % 6],
                    "cached_tokens": 16 * rng.randrange(8),
                }
            )
        out.append((kind, body))
    return out


def test_a_flood_of_reports_is_refused_clearly_bounded_and_hit_rate_keeps_answering(
    tmp_path: Path, redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    _populate(Store(redis_client))
    api = Api(
        tmp_path,
        redis_server.url,
        extra_yaml=f"audit:\n  recent: {RECENT}\n  worstInstances: {WORST}\n",
    )
    try:
        with httpx.Client(base_url=api.url, timeout=30) as http:
            for q in range(40):  # the questions the valid reports refer to
                ask = {
                    "server_ip": IPS,
                    "request_id": f"q-{q}",
                    "body": {"token_ids": PROMPT, "block_size": BS},
                }
                assert http.post("/kv-cache/hit-rate", json=ask).status_code == 200
        statuses = _flood(api.url)
    finally:
        api.stop()
    assert set(statuses) <= {
        "malformed:400",
        "unknown:404",
        "oversized:413",
        "not_candidate:400",
        "valid:200",
        "valid:409",
        "valid:404",
        "hit-rate:ok",
    }, statuses
    assert statuses["hit-rate:ok"] > 0 and not any(k.startswith("hit-rate:wrong") for k in statuses)
    assert statuses.get("valid:200", 0) > 0 and statuses.get("unknown:404", 0) > 0
    names = {k.decode() for k in redis_client.scan_iter("ci:audit*")}
    names |= {k.decode() for k in redis_client.scan_iter("ci:{*}:audit")}
    questions = {keys.audit_question(f"q-{q}") for q in range(40)}
    reports = {keys.audit_reports(f"q-{q}") for q in range(40)}
    tallies = {keys.audit_instance(ip) for ip in IPS}
    fixed = {keys.AUDIT_TOTALS, keys.AUDIT_WORST, keys.AUDIT_RECENT}
    prefixes = {n for n in names if n.startswith("ci:audit:prefix:")}
    assert names - questions - reports - tallies - fixed - prefixes == set()
    assert len(prefixes) <= 2  # one prompt: its question set and its reported set
    assert redis_client.llen(keys.AUDIT_RECENT) == RECENT
    assert redis_client.zcard(keys.AUDIT_WORST) <= WORST


def _flood(url: str) -> dict[str, int]:
    """4 threads of reports, one of hit-rate questions until the reports are done."""
    counts: dict[str, int] = {}
    lock = threading.Lock()
    done = threading.Event()
    expected = [min(i, 7) / 8 for i in range(1, 7)]  # a prefix of i blocks, at most n - 1

    def count(key: str) -> None:
        with lock:
            counts[key] = counts.get(key, 0) + 1

    def report(seed: int) -> None:
        with httpx.Client(base_url=url, timeout=30) as http:
            for kind, body in _bodies(random.Random(seed), FLOOD // 4):
                count(f"{kind}:{http.post('/kv-cache/outcome', content=body).status_code}")

    def ask() -> None:
        body = {"server_ip": IPS, "body": {"token_ids": PROMPT, "block_size": BS}}
        with httpx.Client(base_url=url, timeout=30) as http:
            for _ in itertools.count():
                if done.is_set():
                    return
                resp = http.post("/kv-cache/hit-rate", json=body)
                ratios = [s["l1_hit_ratio"] for s in resp.json()["server_score_list"]]
                count(
                    "hit-rate:ok"
                    if resp.status_code == 200 and ratios == expected
                    else f"hit-rate:wrong {resp.status_code} {ratios}"
                )

    reporters = [threading.Thread(target=report, args=(s,)) for s in range(4)]
    asker = threading.Thread(target=ask)
    asker.start()
    for t in reporters:
        t.start()
    for t in reporters:
        t.join()
    done.set()
    asker.join()
    return counts
