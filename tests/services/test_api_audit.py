"""The prediction audit through the Falcon app over a real redis-server: hit-rate answers
recorded under a request id, outcome reports classified, the audit view, bad input."""

from __future__ import annotations

import time
from typing import Any

import falcon.testing
import orjson
import pytest
import redis

from common import keys
from common.blockhash import BlockHasher
from common.config import Audit, Redis
from common.settings import ApiSettings
from common.store import Instance, Store, TierOps
from services.api.api_metrics import ApiMetrics
from services.api.app import create_app, redis_client
from services.api.audit_record import Recorder
from services.api.scoring import Hit
from tests.conftest import reserve_port, wait_for
from tests.metrics_oracle import count_of, value_of

BS = 16
HIT_RATE, OUTCOME, VIEW = "/kv-cache/hit-rate", "/kv-cache/outcome", "/kv-cache/audit"
A, B = "10.0.0.5", "10.0.0.6"
PROMPT = list(range(1000, 1000 + 4 * BS))  # 4 full blocks; vLLM can reuse at most 3 (48)


@pytest.fixture(scope="module")
def hasher() -> BlockHasher:
    return BlockHasher(ApiSettings().hash)


@pytest.fixture()
def store(redis_client: redis.Redis) -> Store:
    return Store(redis_client)


def _members(hasher: BlockHasher, tokens: list[int] = PROMPT) -> list[int]:
    return [int(m) for m in hasher.member_keys(tokens, BS)]


def _populate(store: Store, ip: str, l1: list[int], seq: int = 1) -> None:
    _, gen = store.upsert_instance(Instance(ip=ip, uid=f"uid-{ip}"))
    ops = TierOps()
    ops.store("l1", l1)
    assert store.apply_batch(ip, gen, 0, seq, ops).status == "applied"


def _client(
    store: Store, hasher: BlockHasher, metrics: ApiMetrics | None = None, **audit: Any
) -> falcon.testing.TestClient:
    settings = ApiSettings(audit=Audit(**audit))
    return falcon.testing.TestClient(create_app(settings, store, hasher, metrics or ApiMetrics()))


def _ask(
    client: falcon.testing.TestClient,
    ips: list[str],
    rid: str | None = None,
    tokens: list[int] = PROMPT,
    headers: dict[str, str] | None = None,
) -> falcon.testing.Result:
    doc: dict[str, Any] = {"server_ip": ips, "body": {"token_ids": tokens, "block_size": BS}}
    if rid is not None:
        doc["request_id"] = rid
    return client.simulate_post(HIT_RATE, body=orjson.dumps(doc), headers=headers)


def _recorded(r: redis.Redis, rid: str) -> dict[str, Any]:
    raw = wait_for(lambda: r.get(keys.audit_question(rid)), what=f"record {rid}")
    doc: dict[str, Any] = orjson.loads(raw)
    return doc


def _report(client: falcon.testing.TestClient, **body: Any) -> falcon.testing.Result:
    return client.simulate_post(OUTCOME, body=orjson.dumps(body))


def test_without_a_request_id_the_answer_is_unchanged_and_nothing_is_recorded(
    store: Store, hasher: BlockHasher, redis_client: redis.Redis
) -> None:
    _populate(store, A, _members(hasher)[:2])
    off = _client(store, hasher, enabled=False)
    on = _client(store, hasher)
    assert _ask(on, [A]).content == _ask(off, [A]).content
    assert b"request_id" not in _ask(on, [A]).content
    assert not redis_client.keys("ci:audit*")


def test_the_answer_is_recorded_per_distinct_candidate_and_the_id_echoed(
    store: Store, hasher: BlockHasher, redis_client: redis.Redis
) -> None:
    m = _members(hasher)
    _populate(store, A, m[:2])
    client = _client(store, hasher)
    result = _ask(client, [A, B, A], "req-1")
    assert result.status_code == 200, result.text
    assert result.json["request_id"] == "req-1"
    q = _recorded(redis_client, "req-1")
    assert (q["n"], q["bs"], q["salt"], q["fp"]) == (64, BS, False, str(m[0]))
    assert q["c"] == {
        A: {"l1": 32, "l3": 0, "r1": [], "r3": []},
        B: {"l1": 0, "l3": 0, "r1": [], "r3": []},
    }
    assert q["k"] == {"2": str(m[2]), "0": str(m[0])}  # where A's and B's predictions stop
    assert 0 < redis_client.ttl(keys.audit_question("req-1")) <= 600
    assert redis_client.zscore(keys.audit_prefix(str(m[0])), "req-1") == q["t"]


def test_the_header_names_the_request_and_the_body_wins(
    store: Store, hasher: BlockHasher, redis_client: redis.Redis
) -> None:
    client = _client(store, hasher)
    assert _ask(client, [A], headers={"X-Request-Id": "hdr-1"}).json["request_id"] == "hdr-1"
    both = _ask(client, [A], "body-1", headers={"X-Request-Id": "hdr-2"})
    assert both.json["request_id"] == "body-1"
    _recorded(redis_client, "hdr-1")
    _recorded(redis_client, "body-1")
    assert not redis_client.exists(keys.audit_question("hdr-2"))


@pytest.mark.parametrize(
    ("rid", "message"),
    [
        ("", "request_id must be 1 to 128 printable ASCII characters"),
        ("x" * 129, "request_id must be 1 to 128 printable ASCII characters"),
        ("a\nb", "request_id must be 1 to 128 printable ASCII characters"),
        ("é", "request_id must be 1 to 128 printable ASCII characters"),
        (17, "request_id must be a string"),
    ],
)
def test_a_malformed_request_id_is_400(
    store: Store, hasher: BlockHasher, rid: Any, message: str
) -> None:
    result = _ask(_client(store, hasher), [A], rid)
    assert result.status_code == 400
    assert result.json["message"].startswith(message)


def test_exact_report(store: Store, hasher: BlockHasher, redis_client: redis.Redis) -> None:
    metrics = ApiMetrics()
    _populate(store, A, _members(hasher))  # all 4 blocks: vLLM reuses 3 (the last token)
    client = _client(store, hasher, metrics)
    assert _ask(client, [A, B], "r-exact").status_code == 200
    _recorded(redis_client, "r-exact")
    result = _report(client, request_id="r-exact", server_ip=A, cached_tokens=48)
    assert result.status_code == 200, result.text
    doc = result.json
    assert (doc["verdict"], doc["predicted_tokens"], doc["realized_tokens"]) == ("exact", 48, 48)
    assert (doc["difference"], doc["explained"], doc["cause"]) == (0, True, None)
    labels = {"verdict": "exact", "source": "router", "explained": "true"}
    assert value_of(metrics.audit_outcomes, **labels) == 1
    assert count_of(metrics.audit_difference, verdict="exact", source="router") == 1
    assert redis_client.hgetall(keys.audit_instance(A))[b"exact"] == b"1"
    assert redis_client.llen(keys.AUDIT_RECENT) == 0  # only discrepancies are listed


def test_under_is_explained_when_the_index_now_holds_the_missing_block(
    store: Store, hasher: BlockHasher, redis_client: redis.Redis
) -> None:
    m = _members(hasher)
    _populate(store, A, m[:1])
    client = _client(store, hasher)
    _ask(client, [A], "r-late")
    _recorded(redis_client, "r-late")
    _populate(store, A, m, seq=2)  # another request stored the rest after the answer
    doc = _report(client, request_id="r-late", server_ip=A, cached_tokens=48).json
    assert (doc["verdict"], doc["difference"], doc["first_differing_block"]) == ("under", 32, 1)
    assert (doc["cause"], doc["explained"]) == ("indexed_after_question", True)


def test_under_is_unexplained_when_the_engine_reused_blocks_the_index_never_saw(
    store: Store, hasher: BlockHasher, redis_client: redis.Redis
) -> None:
    """An extra BOS: the engine's chain is not the one asked about, so the block where the
    prediction stopped never appears in the index; the reported prompt length names it."""
    metrics = ApiMetrics()
    _populate(store, A, _members(hasher)[:1])
    client = _client(store, hasher, metrics)
    _ask(client, [A], "r-bos")
    _ask(client, [A], "r-bos-2")
    _recorded(redis_client, "r-bos-2")
    doc = _report(client, request_id="r-bos", server_ip=A, cached_tokens=48).json
    assert (doc["verdict"], doc["cause"], doc["explained"]) == (
        "under",
        "engine_blocks_not_indexed",
        False,
    )
    doc = _report(
        client, request_id="r-bos-2", server_ip=A, cached_tokens=48, prompt_tokens=65
    ).json
    assert (doc["cause"], doc["explained"], doc["reported_prompt_tokens"]) == (
        "prompt_length_differs",
        False,
        65,
    )
    labels = {"verdict": "under", "source": "router", "explained": "false"}
    assert value_of(metrics.audit_outcomes, **labels) == 2
    assert redis_client.zscore(keys.AUDIT_WORST, A) == 2


def test_over_is_explained_only_by_a_concurrent_question_on_the_same_prefix(
    store: Store, hasher: BlockHasher, redis_client: redis.Redis
) -> None:
    _populate(store, A, _members(hasher))
    client = _client(store, hasher)
    _ask(client, [A], "r-alone", tokens=[5] + PROMPT[1:])  # another prefix: alone on it
    _ask(client, [A], "r-1")
    _ask(client, [A], "r-2")
    _recorded(redis_client, "r-2")
    doc = _report(client, request_id="r-1", server_ip=A, cached_tokens=16).json
    assert (doc["verdict"], doc["cause"], doc["explained"]) == ("over", "concurrent_question", True)
    assert doc["first_differing_block"] == 1
    doc = _report(client, request_id="r-2", server_ip=A, cached_tokens=16).json
    assert (doc["cause"], doc["explained"]) == ("concurrent_question", True)  # r-1 in flight
    # Asked after every other question on the prefix was reported: nothing raced it.
    done = redis_client.zscore(keys.audit_prefix_done(str(_members(hasher)[0])), "r-2")
    wait_for(lambda: time.time() * 1000 > (done or 0) + 1, what="the clock to pass the report")
    _ask(client, [A], "r-seq")
    _recorded(redis_client, "r-seq")
    doc = _report(client, request_id="r-seq", server_ip=A, cached_tokens=16).json
    assert (doc["cause"], doc["explained"]) == ("evicted_or_wrong_key", False)
    _recorded(redis_client, "r-alone")
    doc = _report(client, request_id="r-alone", server_ip=A, cached_tokens=16).json
    assert (doc["verdict"], doc["cause"]) == ("under", "engine_blocks_not_indexed")


def test_over_is_explained_by_another_report_on_the_instance_while_in_flight(
    store: Store, hasher: BlockHasher, redis_client: redis.Redis
) -> None:
    """Concurrent requests on one instance evict each other's blocks between routing and
    scheduling; a router that sends one request at a time never sees that."""
    _populate(store, A, _members(hasher))
    client = _client(store, hasher)
    _ask(client, [A], "t-a")
    asked = _recorded(redis_client, "t-a")["t"]
    _ask(client, [A], "t-b", tokens=[9] + PROMPT[1:])  # another prefix: no race on it
    _recorded(redis_client, "t-b")
    wait_for(lambda: time.time() * 1000 > asked + 1, what="the clock to pass the question")
    assert _report(client, request_id="t-b", server_ip=A, cached_tokens=0).status_code == 200
    doc = _report(client, request_id="t-a", server_ip=A, cached_tokens=16).json
    assert (doc["verdict"], doc["cause"], doc["explained"]) == ("over", "concurrent_traffic", True)
    assert redis_client.zcard(keys.audit_instance_reports(A)) == 2


def test_reports_for_unknown_questions_and_non_candidates(
    store: Store, hasher: BlockHasher, redis_client: redis.Redis
) -> None:
    client = _client(store, hasher)
    result = _report(client, request_id="never", server_ip=A, cached_tokens=0)
    assert result.status_code == 404
    assert "no hit-rate answer is recorded under request_id 'never'" in result.json["message"]
    _ask(client, [A], "r-c")
    _recorded(redis_client, "r-c")
    result = _report(client, request_id="r-c", server_ip=B, cached_tokens=0)
    assert result.status_code == 400
    assert result.json["message"] == "server_ip '10.0.0.6' was not a candidate of request_id 'r-c'"


def test_a_second_report_is_idempotent_and_a_different_one_is_409(
    store: Store, hasher: BlockHasher, redis_client: redis.Redis
) -> None:
    metrics = ApiMetrics()
    client = _client(store, hasher, metrics)
    _ask(client, [A], "r-dup")
    _recorded(redis_client, "r-dup")
    first = _report(client, request_id="r-dup", server_ip=A, cached_tokens=16)
    again = _report(client, request_id="r-dup", server_ip=A, cached_tokens=16)
    assert (first.status_code, again.status_code) == (200, 200)
    assert again.json == {**first.json, "duplicate": True}
    other = _report(client, request_id="r-dup", server_ip=A, cached_tokens=32)
    assert other.status_code == 409
    assert "already reported cached_tokens 16" in other.json["message"]
    labels = {"verdict": "under", "source": "router", "explained": "false"}
    assert value_of(metrics.audit_outcomes, **labels) == 1


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"", "the request body is empty"),
        (b"[1]", "the request body must be a JSON object"),
        (b"{nope", "the request body is not valid JSON"),
        (b'{"request_id": "r", "server_ip": "x"}', "the required field cached_tokens is missing"),
        (b'{"request_id": "r", "server_ip": "x", "cached_tokens": -1}', "cached_tokens must be"),
        (b'{"request_id": "r", "server_ip": "x", "cached_tokens": 1.0}', "cached_tokens must be"),
        (b'{"request_id": "r", "server_ip": "x", "cached_tokens": true}', "cached_tokens must be"),
        (b'{"request_id": "r", "server_ip": 5, "cached_tokens": 1}', "server_ip must be"),
        (b'{"request_id": "", "server_ip": "x", "cached_tokens": 1}', "request_id must be"),
        (
            b'{"request_id": "r", "server_ip": "x", "cached_tokens": 9, "prompt_tokens": 8}',
            "cached_tokens (9) exceeds prompt_tokens (8)",
        ),
        (
            b'{"request_id": "r", "server_ip": "x", "cached_tokens": 1, "source": "me"}',
            "source must be one of ['router', 'probe']",
        ),
        (
            b'{"request_id": "r", "server_ip": "x", "cached_tokens": 1, "extra": 1}',
            "the report has an unknown field extra",
        ),
    ],
)
def test_malformed_reports_are_400(
    store: Store, hasher: BlockHasher, body: bytes, message: str
) -> None:
    result = _client(store, hasher).simulate_post(OUTCOME, body=body)
    assert result.status_code == 400
    assert result.json["message"].startswith(message), result.json
    assert result.json["status"] == 400


def test_a_report_over_the_limit_is_413_and_get_is_405(store: Store, hasher: BlockHasher) -> None:
    client = _client(store, hasher, max_report_bytes=64)
    body = orjson.dumps({"request_id": "r" * 60, "server_ip": A, "cached_tokens": 1})
    assert client.simulate_post(OUTCOME, body=body).status_code == 413
    assert client.simulate_get(OUTCOME).status_code == 405


def test_audit_off_records_nothing_and_reports_are_404(
    store: Store, hasher: BlockHasher, redis_client: redis.Redis
) -> None:
    client = _client(store, hasher, enabled=False)
    assert _ask(client, [A], "r-off").json["request_id"] == "r-off"
    result = _report(client, request_id="r-off", server_ip=A, cached_tokens=0)
    assert result.status_code == 404
    assert result.json["message"] == "the prediction audit is off (audit.enabled: false)"
    assert not redis_client.keys("ci:audit*")


def test_the_view_lists_worst_instances_and_recent_discrepancies(
    store: Store, hasher: BlockHasher, redis_client: redis.Redis
) -> None:
    _populate(store, A, _members(hasher)[:1])
    client = _client(store, hasher)
    for i in range(3):
        _ask(client, [A], f"v-{i}")
        _recorded(redis_client, f"v-{i}")
    _report(client, request_id="v-0", server_ip=A, cached_tokens=16)  # exact
    _report(client, request_id="v-1", server_ip=A, cached_tokens=48)  # under, unexplained
    _report(client, request_id="v-2", server_ip=A, cached_tokens=32, source="probe")
    view = client.simulate_get(VIEW).json
    assert view["totals"]["exact"] == 1 and view["totals"]["under"] == 2
    assert view["totals"]["under:unexplained:probe"] == 1
    (worst,) = view["worst_instances"]
    assert (worst["server_ip"], worst["reports"], worst["unexplained"]) == (A, 3, 2)
    assert worst["difference_tokens"] == 32 + 16
    latest = view["recent_discrepancies"][0]
    assert (latest["request_id"], latest["realized_tokens"], latest["predicted_tokens"]) == (
        "v-2",
        32,
        16,
    )
    assert (latest["block_size"], latest["salt"], latest["first_differing_block"]) == (BS, False, 1)
    assert len(client.simulate_get(VIEW, params={"recent": "1"}).json["recent_discrepancies"]) == 1
    assert client.simulate_get(VIEW, params={"recent": "x"}).status_code == 400


def test_a_dead_redis_loses_records_counted_and_never_fails(hasher: BlockHasher) -> None:
    metrics = ApiMetrics()
    dead = redis_client(Redis(url=f"redis://127.0.0.1:{reserve_port()}/0"))
    recorder = Recorder(dead, Audit(), metrics)
    hits = {A: (Hit(16, 0.25), Hit(0, 0.0))}
    recorder.offer("r", 64, BS, False, hits, hasher.member_keys(PROMPT, BS))
    assert recorder.flush(30)
    assert value_of(metrics.audit_records, result="redis_error") == 1
    assert value_of(metrics.redis_errors, op="audit_record") == 1


def test_records_over_the_rate_or_the_queue_are_dropped_and_counted(hasher: BlockHasher) -> None:
    metrics = ApiMetrics()
    recorder = Recorder(
        redis_client(Redis(url=f"redis://127.0.0.1:{reserve_port()}/0")),
        Audit(max_records_per_second=3),
        metrics,
        clock=lambda: 1000.0,
    )
    hits = {A: (Hit(16, 0.25), Hit(0, 0.0))}
    for i in range(5):
        recorder.offer(f"r{i}", 64, BS, False, hits, hasher.member_keys(PROMPT, BS))
    assert value_of(metrics.audit_records, result="rate_limited") == 2
    recorder.flush(30)
    held = Recorder(recorder.client, Audit(queue_size=2), metrics)
    held.stop()  # its writer never drains: the buffer fills
    for i in range(5):
        held.offer(f"q{i}", 64, BS, False, hits, hasher.member_keys(PROMPT, BS))
    assert value_of(metrics.audit_records, result="queue_full") == 3


def test_a_hybrid_under_report_is_checked_at_the_instance_hash_unit(
    store: Store, hasher: BlockHasher, redis_client: redis.Redis
) -> None:
    """Blocks of 32 tokens hashed every 16 (vLLM's --prefix-match-unit): the block after the
    prediction is looked up by its hash at 16 tokens in group 0's set, not at the request's
    block size."""
    from tests.services.test_api_hybrid import GPTOSS, _index

    prompt = list(range(7000, 7000 + 8 * BS + 5))
    m16 = [int(m) for m in hasher.member_keys(prompt, BS)]
    gen = _index(store, A, {0: [1, 3], 1: [1, 3]}, m16, GPTOSS, h_cfg=BS, block=2 * BS)
    client = _client(store, hasher)
    asked = _ask(client, [A], "hy-1", tokens=prompt)
    asked_twice = client.simulate_post(
        HIT_RATE + "?detail=1",
        body=orjson.dumps({"server_ip": [A], "body": {"token_ids": prompt, "block_size": 2 * BS}}),
    )
    assert asked.status_code == 200
    assert asked_twice.json["server_score_list"][0]["l1_hit_tokens"] == 64
    assert asked_twice.json["server_score_list"][0]["l1_exact"] is True
    _recorded(redis_client, "hy-1")
    ops = TierOps()  # another request stored blocks 2 and 3 after the answer
    for group in (0, 1):
        ops.store("l1", [m16[5], m16[7]], group=group)
    assert store.apply_batch(A, gen, 0, 1, ops).status == "applied"
    doc = _report(client, request_id="hy-1", server_ip=A, cached_tokens=128).json
    assert (doc["verdict"], doc["predicted_tokens"]) == ("under", 64)
    assert (doc["cause"], doc["explained"]) == ("indexed_after_question", True)
