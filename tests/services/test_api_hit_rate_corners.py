"""Corners of the hit-rate answer that mutation testing found unpinned (issue 33,
docs/testing.md): Mooncake groups the events never described, a change of the L3 groups alone
between two requests (the worker's cached view), two inexact reasons joined, a prompt shorter
than a block in the detail form, ``score`` called with its defaults, and the exact 400
messages naming a JSON value's kind. Through the Falcon app (and ``score``/``parse_request``,
the API's public functions) over fakeredis and a real redis-server."""

from __future__ import annotations

import io

import falcon
import falcon.testing
import pytest

from common.blockhash import BlockHasher
from common.errors import RequestError
from common.settings import ApiSettings
from common.store import Store
from services.api.api_metrics import ApiMetrics
from services.api.hit_rate import PATH, HitRateResource, parse_request, score
from tests.metrics_oracle import value_of
from tests.services.test_api_hybrid import BS, DENSE, HYB, PROMPT, _ask, _client, _index, _members


@pytest.fixture(scope="module")
def hasher() -> BlockHasher:
    return BlockHasher(ApiSettings().hash)


@pytest.fixture()
def store(any_store: Store) -> Store:
    return any_store


DENSE_SHAPE = ((0, "full_attention", None),)


def test_l3_groups_the_events_never_described_answer_zero_and_say_so(
    store: Store, hasher: BlockHasher
) -> None:
    m = _members(hasher)
    _index(store, DENSE, {0: list(range(8))}, m, DENSE_SHAPE)
    store.replace_l3(DENSE, {0: m[:5], 1: m[:5]})
    metrics = ApiMetrics()
    (score_,) = _ask(_client(store, hasher, metrics), [DENSE])
    assert (score_["l1_hit_tokens"], score_["l1_exact"]) == (128, True)
    assert (score_["l3_hit_tokens"], score_["l3_exact"]) == (0, False)
    assert score_["l3_inexact_reason"] == "l3_groups_unknown"
    assert value_of(metrics.inexact, tier="l3", reason="l3_groups_unknown") == 1
    assert value_of(metrics.inexact, tier="l1", reason="l3_groups_unknown") == 0


def test_a_change_of_the_l3_groups_alone_is_seen_by_the_next_request(
    store: Store, hasher: BlockHasher
) -> None:
    """The worker caches each instance's view; only the L3 ``groups`` field changes here."""
    m = _members(hasher)
    _index(store, DENSE, {0: list(range(8))}, m, DENSE_SHAPE)
    store.replace_l3(DENSE, {0: m[:3]})
    client = _client(store, hasher)
    (first,) = _ask(client, [DENSE])
    assert (first["l3_hit_tokens"], first["l3_exact"]) == (48, True)
    store.replace_l3(DENSE, {0: m[:3], 1: m[:3]})
    (second,) = _ask(client, [DENSE])
    assert (second["l3_hit_tokens"], second["l3_inexact_reason"]) == (0, "l3_groups_unknown")
    store.replace_l3(DENSE, {0: m[:5]})
    (third,) = _ask(client, [DENSE])
    assert (third["l3_hit_tokens"], third["l3_exact"]) == (80, True)


def test_two_inexact_reasons_are_joined_with_a_comma(store: Store, hasher: BlockHasher) -> None:
    m = _members(hasher)
    shape = ((0, "sliding_window", 32), (1, "future_kind", None))
    _index(store, HYB, {0: list(range(8)), 1: list(range(8))}, m, shape, dp=2)
    (score_,) = _ask(_client(store, hasher), [HYB])
    assert score_["l1_inexact_reason"] == "unknown_group_kind,dp_union,unconfirmed_hash_unit"
    assert score_["l1_exact"] is False


def test_a_prompt_shorter_than_a_block_is_zero_tokens_in_the_detail(
    store: Store, hasher: BlockHasher
) -> None:
    m = _members(hasher)
    _index(store, DENSE, {0: list(range(8))}, m, DENSE_SHAPE)
    (score_,) = _ask(_client(store, hasher), [DENSE], PROMPT[: BS - 1])
    assert score_ == {
        "server_ip": DENSE,
        "l1_hit_ratio": 0.0,
        "l3_hit_ratio": 0.0,
        "l1_hit_tokens": 0,
        "l3_hit_tokens": 0,
        "l1_exact": True,
        "l3_exact": True,
        "l1_inexact_reason": None,
        "l3_inexact_reason": None,
    }


def test_score_with_its_defaults_answers_the_plain_form(store: Store, hasher: BlockHasher) -> None:
    m = _members(hasher)
    _index(store, DENSE, {0: list(range(8))}, m, DENSE_SHAPE)
    request = parse_request(
        b'{"server_ip": ["%s"], "body": {"token_ids": %s, "block_size": %d}}'
        % (DENSE.encode(), str(PROMPT).encode(), BS)
    )
    assert score(request, store, hasher, ApiMetrics()) == [
        {"server_ip": DENSE, "l1_hit_ratio": 1.0, "l3_hit_ratio": 0.0}
    ]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b'{"server_ip": null, "body": {}}', "server_ip must be a list of strings, got null"),
        (b'{"server_ip": {}, "body": {}}', "server_ip must be a list of strings, got an object"),
        (b'{"server_ip": [null], "body": {}}', "server_ip[0] must be a string, got null"),
        (
            b'{"server_ip": ["a"], "body": {"token_ids": {}, "block_size": 16}}',
            "body.token_ids must be a list of integers, got an object",
        ),
        (
            b'{"server_ip": ["a"], "body": {"token_ids": null, "block_size": 16}}',
            "body.token_ids must be a list of integers, got null",
        ),
        (
            b'{"server_ip": ["a"], "body": {"token_ids": [1], "block_size": null}}',
            "body.block_size must be an integer, got null",
        ),
        (b'{"server_ip": ["a"], "body": null}', "body must be a JSON object, got null"),
        (b"[]", "the request body must be a JSON object, got a list"),
        (b" \n ", "the request body is empty"),
        (b'{"server_ip": [], "body": {}}', "server_ip must not be empty"),
    ],
)
def test_a_bad_value_is_named_by_its_json_kind(body: bytes, message: str) -> None:
    with pytest.raises(RequestError) as err:
        parse_request(body)
    assert (err.value.status, err.value.message) == (400, message)


def test_a_chunked_body_over_the_limit_names_the_limit(store: Store, hasher: BlockHasher) -> None:
    app = falcon.App()
    app.add_route(PATH, HitRateResource(store, hasher, ApiMetrics(), body_limit=100))
    app.add_error_handler(RequestError, _as_json)
    result = falcon.testing.TestClient(app).simulate_post(
        PATH,
        headers={"Transfer-Encoding": "chunked"},
        extras={"wsgi.input": io.BytesIO(b" " * 101)},
    )
    assert result.status_code == 413
    assert result.json["message"] == "the request body is larger than the limit of 100 bytes"


def _as_json(req: falcon.Request, resp: falcon.Response, ex: RequestError, params: object) -> None:
    resp.status = ex.status
    resp.media = {"message": ex.message}


@pytest.mark.parametrize(("version", "hit"), [((0, 25, 0), 0), ((0, 28, 0), 96)])
def test_the_configured_vllm_version_decides_partial_hits(
    store: Store, hasher: BlockHasher, version: tuple[int, ...], hit: int
) -> None:
    """Mamba and FA at 64 tokens, prefixMatchUnit 16, the state saved at 96 tokens: vLLM
    0.26+ hits it (partial hits), 0.25 only at multiples of 64 (none saved)."""
    m = _members(hasher)
    shape = ((0, "mamba", None), (1, "full_attention", None))
    _index(store, HYB, {0: [5], 1: list(range(8))}, m, shape, h_cfg=16, block=64)
    app = falcon.App()
    app.add_route(PATH, HitRateResource(store, hasher, ApiMetrics(), 1 << 20, vllm_version=version))
    (score_,) = _ask(falcon.testing.TestClient(app), [HYB])
    assert score_["l1_hit_tokens"] == hit
