"""The Falcon app over a real redis-server (and fakeredis): every status code and message case."""

from __future__ import annotations

import io
import itertools
import json
from pathlib import Path
from typing import Any

import falcon.testing
import orjson
import pytest
import redis

from common.blockhash import BlockHasher, HashSettings
from common.config import Redis, load_config
from common.settings import ApiSettings
from common.store import Instance, Store, TierOps
from services.api.api_metrics import ApiMetrics
from services.api.app import create_app, redis_client
from services.api.hit_rate import UNREACHABLE
from tests.conftest import DATA, reserve_port
from tests.metrics_oracle import value_of

BS = 16  # a small block size keeps the prompts short; the hashing is the same
PATH = "/kv-cache/hit-rate"
A, B, UNKNOWN = "10.0.0.5", "10.0.0.6", "10.0.0.99"
PROMPT = list(range(1000, 1000 + 4 * BS))  # exactly 4 full blocks


@pytest.fixture(scope="module")
def hasher() -> BlockHasher:
    return BlockHasher(ApiSettings().hash)


def _members(hasher: BlockHasher, tokens: list[int], salt: str | None = None) -> list[int]:
    return [int(m) for m in hasher.member_keys(tokens, BS, salt)]


def _populate(store: Store, ip: str, l1: list[int], l3: list[int]) -> None:
    _, gen = store.upsert_instance(Instance(ip=ip, uid=f"uid-{ip}"))
    ops = TierOps()
    ops.store("l1", l1)
    assert store.apply_batch(ip, gen, 0, 1, ops).status == "applied"
    assert store.replace_l3(ip, l3)


def _client(
    store: Store,
    hasher: BlockHasher,
    limit: int = 4194304,
    metrics: ApiMetrics | None = None,
    max_candidates: int = 1024,
) -> falcon.testing.TestClient:
    settings = ApiSettings(max_hit_rate_body_bytes=limit, max_candidates=max_candidates)
    return falcon.testing.TestClient(create_app(settings, store, hasher, metrics or ApiMetrics()))


@pytest.fixture()
def store(any_store: Store) -> Store:
    return any_store


@pytest.fixture()
def dead_store() -> Store:
    """A store whose Redis port has nobody listening, with the API's client settings."""
    return Store(redis_client(Redis(url=f"redis://127.0.0.1:{reserve_port()}/0")))


def _ask(
    client: falcon.testing.TestClient, ips: list[str], tokens: list[int], **body: Any
) -> falcon.testing.Result:
    doc = {"server_ip": ips, "body": {"token_ids": tokens, "block_size": BS, **body}}
    return client.simulate_post(PATH, body=orjson.dumps(doc))


def _ratios(result: falcon.testing.Result) -> list[tuple[str, float, float]]:
    assert result.status_code == 200, result.text
    assert result.headers["content-type"] == "application/json"
    doc = result.json
    assert (doc["message"], doc["status"]) == ("", 0)
    scores = doc["server_score_list"]
    return [(s["server_ip"], s["l1_hit_ratio"], s["l3_hit_ratio"]) for s in scores]


def test_exact_ratios_in_input_order_with_duplicates_and_unknown(
    store: Store, hasher: BlockHasher
) -> None:
    m = _members(hasher, PROMPT)
    _populate(store, A, l1=m[:3], l3=m)
    _populate(store, B, l1=[m[0], m[2], m[3]], l3=[m[1]])  # a hole after block 0; no block 0
    client = _client(store, hasher)
    assert _ratios(_ask(client, [B, UNKNOWN, A, B], PROMPT)) == [
        (B, 0.25, 0.0),
        (UNKNOWN, 0.0, 0.0),
        (A, 0.75, 1.0),
        (B, 0.25, 0.0),
    ]
    # A trailing partial block does not count: n stays 4.
    assert _ratios(_ask(client, [A], PROMPT + [1, 2, 3])) == [(A, 0.75, 1.0)]
    # A different first token changes every hash of the chain.
    assert _ratios(_ask(client, [A], [7] + PROMPT[1:])) == [(A, 0.0, 0.0)]
    # The best candidate's ratio per request and tier: 0.75, 0.75, 0.0 in L1; 1, 1, 0 in L3.
    text = client.simulate_get("/metrics").text
    assert 'cache_indexer_api_best_hit_ratio_bucket{le="0.7",tier="l1"} 1.0' in text
    assert 'cache_indexer_api_best_hit_ratio_bucket{le="0.8",tier="l1"} 3.0' in text
    assert 'cache_indexer_api_best_hit_ratio_bucket{le="0.99",tier="l3"} 1.0' in text
    assert 'cache_indexer_api_best_hit_ratio_sum{tier="l3"} 2.0' in text


def test_no_full_block_scores_zero_without_touching_redis(
    dead_store: Store, hasher: BlockHasher
) -> None:
    client = _client(dead_store, hasher)
    assert _ratios(_ask(client, [A, A], PROMPT[: BS - 1])) == [(A, 0.0, 0.0), (A, 0.0, 0.0)]
    assert _ratios(_ask(client, [A], [])) == [(A, 0.0, 0.0)]


def test_salt_changes_the_hashes_and_empty_salt_is_no_salt(
    redis_client: redis.Redis, hasher: BlockHasher
) -> None:
    store = Store(redis_client)
    salted = _members(hasher, PROMPT, "tenant-1")
    plain = _members(hasher, PROMPT)
    assert salted[0] != plain[0] and salted[1:] != plain[1:]
    _populate(store, A, l1=salted, l3=plain[:2])
    client = _client(store, hasher)
    assert _ratios(_ask(client, [A], PROMPT, cache_salt="tenant-1")) == [(A, 1.0, 0.0)]
    assert _ratios(_ask(client, [A], PROMPT, cache_salt="tenant-2")) == [(A, 0.0, 0.0)]
    for no_salt in ({"cache_salt": ""}, {"cache_salt": None}, {}):
        assert _ratios(_ask(client, [A], PROMPT, **no_salt)) == [(A, 0.0, 0.5)]


def test_a_bool_deep_in_a_long_prompt_is_named(store: Store, hasher: BlockHasher) -> None:
    raw = (
        b'{"server_ip": ["a"], "body": {"token_ids": ['
        + b"7, 1, 0, " * 2000
        + b'false, 9], "block_size": 16}}'
    )
    result = _client(store, hasher).simulate_post(PATH, body=raw)
    assert result.status_code == 400
    message = "body.token_ids[6000] must be a non-negative integer, got False"
    assert result.json["message"] == message


def test_ids_0_and_1_next_to_true_in_a_string_are_ids(store: Store, hasher: BlockHasher) -> None:
    """Only a JSON ``true``/``false`` in token_ids is refused: ids 0 and 1 in a body that says
    "true" or "false" elsewhere (a salt here) are hashed as the ints they are."""
    prompt = [0, 1] * (2 * BS)
    salt = "true or false"
    _populate(store, A, l1=_members(hasher, prompt, salt), l3=[])
    assert _ratios(_ask(_client(store, hasher), [A], prompt, cache_salt=salt)) == [(A, 1.0, 0.0)]


BAD_REQUESTS = [
    (b"", "the request body is empty"),
    (b"  \n", "the request body is empty"),
    (b"{", "not valid JSON"),
    (b"[]", "the request body must be a JSON object, got a list"),
    (b'{"server_ip": ["a"]}', "the required field body is missing"),
    (b'{"body": {"token_ids": [], "block_size": 1}}', "the required field server_ip is missing"),
    (b'{"server_ip": ["a"], "body": {}, "x": 1}', "unknown field x"),
    (
        b'{"server_ip": ["a"], "body": {"token_ids": [], "block_size": 1, "lora": 1}}',
        "unknown field body.lora",
    ),
    (
        b'{"server_ip": "a", "body": {"token_ids": [], "block_size": 1}}',
        "server_ip must be a list of strings, got a string",
    ),
    (
        b'{"server_ip": [], "body": {"token_ids": [], "block_size": 1}}',
        "server_ip must not be empty",
    ),
    (
        b'{"server_ip": ["a", 5], "body": {"token_ids": [], "block_size": 1}}',
        "server_ip[1] must be a string, got an integer",
    ),
    (b'{"server_ip": ["a"], "body": [1]}', "body must be a JSON object, got a list"),
    (
        b'{"server_ip": ["a"], "body": {"block_size": 1}}',
        "the required field body.token_ids is missing",
    ),
    (
        b'{"server_ip": ["a"], "body": {"token_ids": []}}',
        "the required field body.block_size is missing",
    ),
    (
        b'{"server_ip": ["a"], "body": {"token_ids": [], "block_size": 0}}',
        "body.block_size must be greater than 0, got 0",
    ),
    (
        b'{"server_ip": ["a"], "body": {"token_ids": [], "block_size": -128}}',
        "body.block_size must be greater than 0, got -128",
    ),
    (
        b'{"server_ip": ["a"], "body": {"token_ids": [], "block_size": "128"}}',
        "body.block_size must be an integer, got a string",
    ),
    (
        b'{"server_ip": ["a"], "body": {"token_ids": [], "block_size": true}}',
        "body.block_size must be an integer, got a boolean",
    ),
    (
        b'{"server_ip": ["a"], "body": {"token_ids": [], "block_size": 128.0}}',
        "body.block_size must be an integer, got a number",
    ),
    (
        b'{"server_ip": ["a"], "body": {"token_ids": "1 2", "block_size": 1}}',
        "body.token_ids must be a list of integers, got a string",
    ),
    (
        b'{"server_ip": ["a"], "body": {"token_ids": [1.0], "block_size": 1}}',
        "body.token_ids[0] must be a non-negative integer, got 1.0",
    ),
    (
        b'{"server_ip": ["a"], "body": {"token_ids": [1, true], "block_size": 1}}',
        "body.token_ids[1] must be a non-negative integer, got True",
    ),
    (
        b'{"server_ip": ["a"], "body": {"token_ids": [false], "block_size": 1}}',
        "body.token_ids[0] must be a non-negative integer, got False",
    ),
    (
        b'{"server_ip": ["a"], "body": {"token_ids": [0, 1, 0, 5, 1, true, 0], "block_size": 1}}',
        "body.token_ids[5] must be a non-negative integer, got True",
    ),
    (
        b'{"server_ip": ["a"], "body": {"token_ids": ["7"], "block_size": 1}}',
        "body.token_ids[0] must be a non-negative integer, got '7'",
    ),
    (
        b'{"server_ip": ["a"], "body": {"token_ids": [null], "block_size": 1}}',
        "body.token_ids[0] must be a non-negative integer, got None",
    ),
    (
        b'{"server_ip": ["a"], "body": {"token_ids": [18446744073709551616], "block_size": 1}}',
        "body.token_ids[0] must be a non-negative integer, got 1.8446744073709552e+19",
    ),
    (
        b'{"server_ip": ["a"], "body": {"token_ids": [1, -1], "block_size": 1}}',
        "body.token_ids cannot be hashed for vLLM: token id -1 is out of range",
    ),
    (
        b'{"server_ip": ["a"], "body": {"token_ids": [1, 2, -1], "block_size": 2}}',
        "body.token_ids cannot be hashed for vLLM: token id -1 is out of range",
    ),  # in the tail
    (
        b'{"server_ip": ["a"], "body": {"token_ids": [-1], "block_size": 2}}',
        "body.token_ids cannot be hashed for vLLM: token id -1 is out of range",
    ),  # n == 0
    (
        b'{"server_ip": ["a"], "body": {"token_ids": [], "block_size": 1, "cache_salt": 5}}',
        "body.cache_salt must be a string or null, got an integer",
    ),
]


@pytest.mark.parametrize(("raw", "message"), BAD_REQUESTS)
def test_bad_requests_are_400_in_the_contract_shape(
    redis_client: redis.Redis, hasher: BlockHasher, raw: bytes, message: str
) -> None:
    result = _client(Store(redis_client), hasher).simulate_post(PATH, body=raw)
    assert result.status_code == 400
    doc = result.json
    assert doc["status"] == 400 and doc["server_score_list"] == []
    assert message in doc["message"] and "\n" not in doc["message"]


class _CountingHasher:
    def __init__(self, inner: BlockHasher) -> None:
        self.inner, self.calls = inner, 0

    def member_keys(
        self, token_ids: list[int], block_size: int, cache_salt: str | None = None
    ) -> list[bytes]:
        self.calls += 1
        return self.inner.member_keys(token_ids, block_size, cache_salt)


def test_more_distinct_candidates_than_max_candidates_is_400_before_any_work(
    dead_store: Store, redis_client: redis.Redis, hasher: BlockHasher
) -> None:
    limit = 5
    ips = [f"10.0.1.{i}" for i in range(limit + 1)]
    counting = _CountingHasher(hasher)
    result = _ask(_client(dead_store, counting, max_candidates=limit), ips, PROMPT)  # type: ignore[arg-type]
    assert result.status_code == 400
    assert result.json == {
        "server_score_list": [],
        "status": 400,
        "message": (
            f"server_ip names {limit + 1} distinct instances, more than the limit of {limit} "
            "(http.maxCandidates)"
        ),
    }
    assert counting.calls == 0  # refused before hashing (and the dead Redis was not asked)
    client = _client(Store(redis_client), hasher, max_candidates=limit)
    assert len(_ratios(_ask(client, ips[:limit], PROMPT))) == limit
    # Duplicates cost no extra read: limit distinct ips named many times are accepted.
    assert len(_ratios(_ask(client, ips[:limit] * 20, PROMPT))) == limit * 20


def test_block_lookups_past_max_candidates_times_4096_are_400_before_any_work(
    dead_store: Store, redis_client: redis.Redis, hasher: BlockHasher
) -> None:
    counting = _CountingHasher(hasher)
    tokens = list(range(4096 + 1))
    doc = {"server_ip": [A, B, A], "body": {"token_ids": tokens, "block_size": 1}}
    result = _client(dead_store, counting, max_candidates=2).simulate_post(  # type: ignore[arg-type]
        PATH, body=orjson.dumps(doc)
    )
    assert result.status_code == 400 and counting.calls == 0
    assert result.json["message"] == (
        "the request needs 8194 block look-ups per tier (2 instances × 4097 blocks), more "
        "than the limit of 8192 (http.maxCandidates × 4096)"
    )
    doc["body"]["token_ids"] = tokens[:4096]  # type: ignore[index]
    result = _client(Store(redis_client), hasher, max_candidates=2).simulate_post(
        PATH, body=orjson.dumps(doc)
    )
    assert _ratios(result) == [(A, 0.0, 0.0), (B, 0.0, 0.0), (A, 0.0, 0.0)]


def test_largest_token_id_is_accepted(redis_client: redis.Redis, hasher: BlockHasher) -> None:
    client = _client(Store(redis_client), hasher)
    assert _ratios(_ask(client, [A], [2**64 - 1] * BS)) == [(A, 0.0, 0.0)]


@pytest.mark.filterwarnings("ignore:Unknown REQUEST_METHOD")  # wsgiref's lint, about FOO
@pytest.mark.parametrize("method", ["GET", "PUT", "DELETE", "PATCH", "OPTIONS", "TRACE", "FOO"])
def test_other_methods_are_405_with_allow(
    redis_client: redis.Redis, hasher: BlockHasher, method: str
) -> None:
    result = _client(Store(redis_client), hasher).simulate_request(method, PATH)
    assert result.status_code == 405
    assert result.headers["Allow"] == "POST"
    assert result.json == {
        "server_score_list": [],
        "status": 405,
        "message": f"method {method} is not allowed on {PATH}; allowed: POST",
    }


def test_body_over_the_limit_is_413_by_content_length(
    redis_client: redis.Redis, hasher: BlockHasher
) -> None:
    client = _client(Store(redis_client), hasher, limit=100)
    result = client.simulate_post(PATH, body=b" " * 101)
    assert result.status_code == 413
    assert result.json == {
        "server_score_list": [],
        "status": 413,
        "message": "the request body is larger than the limit of 100 bytes",
    }


def _exactly(size: int) -> bytes:
    """A valid request padded with JSON whitespace to exactly ``size`` bytes."""
    doc = orjson.dumps({"server_ip": [A], "body": {"token_ids": PROMPT[:BS], "block_size": BS}})
    assert len(doc) <= size
    return doc + b" " * (size - len(doc))


def test_body_of_exactly_the_limit_is_accepted_one_more_byte_is_413(
    redis_client: redis.Redis, hasher: BlockHasher
) -> None:
    limit = 1000
    client = _client(Store(redis_client), hasher, limit=limit)
    assert _ratios(client.simulate_post(PATH, body=_exactly(limit))) == [(A, 0.0, 0.0)]
    assert client.simulate_post(PATH, body=_exactly(limit + 1)).status_code == 413
    # The same sizes sent chunked (no Content-Length), read whole or 8 bytes at a time.
    for size, max_read in itertools.product((limit, limit + 1), (0, 8)):
        result, stream = _chunked(client, _exactly(size), max_read)
        assert result.status_code == (200 if size == limit else 413), (size, max_read)
        assert stream.consumed == size


def test_a_content_length_over_the_limit_is_refused_before_reading_the_body(
    redis_client: redis.Redis, hasher: BlockHasher
) -> None:
    limit = 1000
    client = _client(Store(redis_client), hasher, limit=limit)
    for declared in (limit + 1, 10 * limit, 2**40):
        stream = _CountingStream(_exactly(limit + 1) + b" " * 5000)
        result = client.simulate_post(
            PATH, headers={"Content-Length": str(declared)}, extras={"wsgi.input": stream}
        )
        assert result.status_code == 413 and result.json["status"] == 413
        assert stream.consumed == 0, f"read {stream.consumed} bytes of a refused body"
    stream = _CountingStream(_exactly(limit))  # at the limit: read, exactly that much
    result = client.simulate_post(
        PATH, headers={"Content-Length": str(limit)}, extras={"wsgi.input": stream}
    )
    assert _ratios(result) == [(A, 0.0, 0.0)] and stream.consumed == limit


class _CountingStream(io.BytesIO):
    """A request body that records how many bytes the app read; ``max_read`` caps what
    one read returns, as a socket delivering the body in pieces does."""

    def __init__(self, data: bytes, max_read: int = 0) -> None:
        super().__init__(data)
        self.consumed = 0
        self.max_read = max_read

    def read(self, size: int | None = -1) -> bytes:
        if self.max_read and (size is None or size < 0 or size > self.max_read):
            size = self.max_read
        chunk = super().read(size)
        self.consumed += len(chunk)
        return chunk


def _chunked(
    client: falcon.testing.TestClient, data: bytes, max_read: int = 0
) -> tuple[Any, _CountingStream]:
    stream = _CountingStream(data, max_read)
    result = client.simulate_post(
        PATH, headers={"Transfer-Encoding": "chunked"}, extras={"wsgi.input": stream}
    )
    return result, stream


def test_chunked_body_is_read_capped_and_413_over_the_limit(
    redis_client: redis.Redis, hasher: BlockHasher
) -> None:
    limit = 200_000
    client = _client(Store(redis_client), hasher, limit=limit)
    result, stream = _chunked(client, b" " * (limit * 5))
    assert result.status_code == 413 and result.json["status"] == 413
    assert stream.consumed == limit + 1
    doc = orjson.dumps({"server_ip": [A], "body": {"token_ids": PROMPT, "block_size": BS}})
    result, _ = _chunked(client, doc)
    assert _ratios(result) == [(A, 0.0, 0.0)]


def test_redis_down_is_500_without_a_stack_trace(dead_store: Store, hasher: BlockHasher) -> None:
    metrics = ApiMetrics()
    result = _ask(_client(dead_store, hasher, metrics=metrics), [A], PROMPT)
    assert result.status_code == 500
    assert result.json == {"server_score_list": [], "status": 500, "message": UNREACHABLE}
    assert value_of(metrics.redis_errors, op="hit_rate") == 1


def test_health_and_readiness(
    redis_client: redis.Redis, dead_store: Store, hasher: BlockHasher
) -> None:
    client = _client(Store(redis_client), hasher)
    assert client.simulate_get("/healthz").status_code == 200
    port = redis_client.connection_pool.connection_kwargs["port"]
    assert client.simulate_get("/readyz").json == {
        "status": "ok",
        "redis": f"master at {redis_client.connection_pool.connection_kwargs['host']}:{port}",
    }
    down = _client(dead_store, hasher)
    assert down.simulate_get("/healthz").status_code == 200, "liveness does not need Redis"
    result = down.simulate_get("/readyz")
    assert result.status_code == 503
    assert result.json["status"] == "unavailable"
    assert result.json["reason"].startswith("the state store is unreachable")


def test_unknown_path_is_json_404(redis_client: redis.Redis, hasher: BlockHasher) -> None:
    result = _client(Store(redis_client), hasher).simulate_get("/kv-cache/nope")
    assert result.status_code == 404
    assert result.json == {"status": 404, "message": "there is no resource at /kv-cache/nope"}


def test_metrics_count_requests_latency_and_hashed_blocks(
    redis_client: redis.Redis, hasher: BlockHasher
) -> None:
    client = _client(Store(redis_client), hasher)
    _ask(client, [A], PROMPT)
    _ask(client, [A, B], PROMPT + PROMPT)
    client.simulate_post(PATH, body=b"{")
    client.simulate_get("/nope")
    text = client.simulate_get("/metrics").text
    assert f'cache_indexer_api_requests_total{{path="{PATH}",status="200"}} 2' in text
    assert f'cache_indexer_api_requests_total{{path="{PATH}",status="400"}} 1' in text
    assert 'cache_indexer_api_requests_total{path="unmatched",status="404"} 1' in text
    assert "cache_indexer_api_hashed_blocks_total 12" in text
    assert f'cache_indexer_api_request_duration_seconds_count{{path="{PATH}"}} 3' in text


def test_ids_the_configured_vllm_cannot_hold_are_400(redis_client: redis.Redis) -> None:
    int32_hasher = BlockHasher(HashSettings.from_strings("sha256_cbor", "0", "0.34.0"))
    client = _client(Store(redis_client), int32_hasher)
    assert _ratios(_ask(client, [A], [2**31 - 1] * BS)) == [(A, 0.0, 0.0)]
    result = _ask(client, [A], [2**31] * BS)
    assert result.status_code == 400 and result.json["status"] == 400
    message = result.json["message"]  # the hasher words the reason; the id must be named
    assert message.startswith("body.token_ids cannot be hashed for vLLM: token id 2147483648 ")


class _BrokenHasher:
    def member_keys(
        self, token_ids: list[int], block_size: int, cache_salt: str | None = None
    ) -> list[bytes]:
        raise RuntimeError("secret internals")


def test_an_unexpected_error_is_a_json_500_without_details(redis_client: redis.Redis) -> None:
    app = create_app(ApiSettings(), Store(redis_client), _BrokenHasher(), ApiMetrics())
    result = _ask(falcon.testing.TestClient(app), [A], PROMPT)
    assert result.status_code == 500
    assert result.json == {
        "server_score_list": [],
        "status": 500,
        "message": "the request could not be processed: internal error",
    }


# -- blockKey: the API hashes as the configured vLLM does (vectors made by real vLLM) ------

VECTORS = json.loads((DATA / "vllm_hash_vectors.json").read_text(encoding="utf-8"))["versions"]
DEFAULT_KEY = ("sha256_cbor", "0", "0.28.0")
NON_DEFAULT_CASES = [
    pytest.param(version, case, id=f"{version}-{case['name']}")
    for version, cases in VECTORS.items()
    for case in cases
    if case["deterministic"]
    and case["lora_name"] is None  # the API takes no LoRA
    and (case["algo"], case["seed"], version) != DEFAULT_KEY
]


def vector_members(case: dict[str, Any]) -> list[int]:
    """vLLM's block hashes as KV events carry them: the digest's last 8 bytes, big-endian
    (decoded here from the vectors file, not by the project's hasher)."""
    return [int(h[-16:], 16) for h in case["block_hashes_hex"]]


def block_key_config(tmp_path: Path, version: str, case: dict[str, Any]) -> ApiSettings:
    seed = "null" if case["seed"] is None else json.dumps(case["seed"])
    path = tmp_path / "config.yaml"
    path.write_text(
        f"blockKey:\n  prefixCachingHashAlgo: {case['algo']}\n"
        f'  pythonHashSeed: {seed}\n  vllmVersion: "{version}"\n',
        encoding="utf-8",
    )
    return ApiSettings.from_config(load_config(path, env={}))  # the file, as the API reads it


@pytest.mark.parametrize(("version", "case"), NON_DEFAULT_CASES)
def test_api_hashes_with_the_configured_block_key(
    redis_client: redis.Redis, tmp_path: Path, version: str, case: dict[str, Any]
) -> None:
    """Redis holds vLLM's own hashes for the prompt; the API, configured with that vLLM's
    blockKey from a config file, must find every block."""
    assert len(NON_DEFAULT_CASES) >= 15
    settings = block_key_config(tmp_path, version, case)
    store = Store(redis_client)
    members = vector_members(case)
    n = len(members)
    _populate(store, A, l1=members, l3=members[: n - 1])
    app = create_app(settings, store, BlockHasher(settings.hash), ApiMetrics())
    doc = {
        "server_ip": [A],
        "body": {
            "token_ids": case["token_ids"],
            "block_size": case["block_size"],
            "cache_salt": case["cache_salt"],
        },
    }
    result = falcon.testing.TestClient(app).simulate_post(PATH, body=orjson.dumps(doc))
    assert _ratios(result) == [(A, 1.0, (n - 1) / n)]


def test_every_answer_names_the_worker_process(
    redis_client: redis.Redis, hasher: BlockHasher
) -> None:
    import os

    client = _client(Store(redis_client), hasher)
    for result in (
        _ask(client, [A], PROMPT),
        client.simulate_get("/nope"),
        client.simulate_get(PATH),
        client.simulate_get("/healthz"),
    ):
        assert result.headers["x-served-by"] == str(os.getpid())
