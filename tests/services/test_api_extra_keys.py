"""The hit-rate body's ``lora_name``, ``lora_path`` and ``mm_features`` through the Falcon app
over a real redis-server: every golden extra-keys case of every release, hybrid hash units,
``?detail=1``, and every refusal."""

from __future__ import annotations

import json
from typing import Any

import falcon.testing
import orjson
import pytest
import redis

from common.blockhash import BlockHasher, HashInputs, HashSettings, MmItem
from common.blockhash_extra import MAX_MM_ITEMS
from common.settings import ApiSettings
from common.store import Instance, Store, TierOps
from services.api.api_metrics import ApiMetrics
from services.api.app import create_app
from tests.conftest import DATA

PATH = "/kv-cache/hit-rate"
A, B, C = "10.0.2.1", "10.0.2.2", "10.0.2.3"
VECTOR_FILES = sorted((DATA / "extra-keys").glob("vectors_*.json"))
CASES = [
    pytest.param(case, id=f"{doc['release']}-{case['name']}")
    for doc in (json.loads(p.read_text(encoding="utf-8")) for p in VECTOR_FILES)
    for case in doc["cases"]
]


def _settings(case: dict[str, Any]) -> ApiSettings:
    release = tuple(int(part) for part in case["release"].split("."))
    return ApiSettings(hash=HashSettings(case["algo"], case["seed"], release))  # type: ignore[arg-type]


def _client(store: Store, settings: ApiSettings) -> falcon.testing.TestClient:
    app = create_app(settings, store, BlockHasher(settings.hash), ApiMetrics())
    return falcon.testing.TestClient(app)


def _populate(store: Store, ip: str, l1: list[int], l3: list[int]) -> None:
    _, gen = store.upsert_instance(Instance(ip=ip, uid=f"uid-{ip}"))
    ops = TierOps()
    ops.store("l1", l1)
    assert store.apply_batch(ip, gen, 0, 1, ops).status == "applied"
    assert store.replace_l3(ip, l3)


def _body(case: dict[str, Any]) -> dict[str, Any]:
    """The case as a router sends it: items in vLLM's order reversed (the API sorts them)."""
    body: dict[str, Any] = {
        "token_ids": case["token_ids"],
        "block_size": case["block_size"],
        "cache_salt": case["cache_salt"],
    }
    if case["lora"]:
        body["lora_name"] = case["lora"]["name"]
        body["lora_path"] = case["lora"]["path"]
    if case["mm_features"]:
        body["mm_features"] = [
            {"identifier": f["identifier"], "offset": f["offset"], "length": f["length"]}
            for f in reversed(case["mm_features"])
        ]
    return body


def _post(
    client: falcon.testing.TestClient, ips: list[str], body: dict[str, Any], detail: bool = False
) -> falcon.testing.Result:
    return client.simulate_post(
        PATH,
        body=orjson.dumps({"server_ip": ips, "body": body}),
        params={"detail": "1"} if detail else None,
    )


@pytest.mark.parametrize("case", CASES)
def test_golden_cases_through_the_api(redis_client: redis.Redis, case: dict[str, Any]) -> None:
    """A holds vLLM's own hashes (all in L1, the first half in L3); C holds the chain of the
    same tokens hashed without the request's LoRA and items: it must not be credited with
    the blocks whose keys differ."""
    settings, store = _settings(case), Store(redis_client)
    golden = case["block_hashes_event_int"]
    n = len(golden)
    assert n == len(case["token_ids"]) // case["block_size"]
    if not n:  # no full block: nothing hashed, every ratio 0
        result = _post(_client(store, settings), [A], _body(case))
        assert result.json["server_score_list"][0]["l1_hit_ratio"] == 0.0, result.text
        return
    _populate(store, A, l1=golden, l3=golden[: n // 2])
    plain = BlockHasher(settings.hash).event_ints(
        case["token_ids"], case["block_size"], case["cache_salt"]
    )
    _populate(store, C, l1=plain, l3=plain)
    shared = next((i for i, (g, p) in enumerate(zip(golden, plain)) if g != p), n)
    result = _post(_client(store, settings), [A, B, C], _body(case), detail=True)
    assert result.status_code == 200, result.text
    scores = {s["server_ip"]: s for s in result.json["server_score_list"]}
    assert (scores[A]["l1_hit_ratio"], scores[A]["l3_hit_ratio"]) == (1.0, (n // 2) / n)
    assert (scores[B]["l1_hit_ratio"], scores[B]["l3_hit_ratio"]) == (0.0, 0.0)
    assert scores[C]["l1_hit_ratio"] == scores[C]["l3_hit_ratio"] == shared / n
    if case["lora"] or any(b["extra_keys"] for b in case["blocks"]):
        assert shared < n  # the case's keys change the chain: C is not credited with it
    assert scores[A]["l3_hit_tokens"] == (n // 2) * case["block_size"]


def test_hybrid_hash_unit_uses_the_same_inputs(redis_client: redis.Redis) -> None:
    """Groups of 64-token blocks: the request (block_size 16) is hashed again at 64, with the
    LoRA and items; the chain hashed without them is not found."""
    settings = ApiSettings(hash=HashSettings(vllm_version=(0, 34, 0)))
    hasher = BlockHasher(settings.hash)
    tokens = list(range(7000, 7000 + 4 * 64 + 9))
    inputs = HashInputs("ad", "/p", (MmItem("img", 70, 100), MmItem("img", 200, 8)))
    keyed = [int(m) for m in hasher.member_keys(tokens, 64, "s", inputs=inputs)]
    plain = [int(m) for m in hasher.member_keys(tokens, 64, "s")]
    store = Store(redis_client)
    for ip, members in ((A, keyed), (C, plain)):
        gen = store.upsert_instance(Instance(ip=ip, uid=f"u-{ip}"))[1]
        ops = TierOps()
        for group, kind in ((0, "sliding_window"), (1, "full_attention")):
            ops.describe(group, kind, 64, 64 if group == 0 else None)
            ops.store("l1", members[:3], group=group)
        ops.settings(0, 0, 1)
        assert store.apply_batch(ip, gen, 0, 0, ops).status == "applied"
    body = {
        "token_ids": tokens,
        "block_size": 16,
        "cache_salt": "s",
        "lora_name": "ad",
        "lora_path": "/p",
        "mm_features": [
            {"identifier": "img", "offset": 200, "length": 8, "modality": "image"},
            {"identifier": "img", "offset": 70, "length": 100},
        ],
    }
    result = _post(_client(store, settings), [A, C], body, detail=True)
    assert result.status_code == 200, result.text
    a, c = result.json["server_score_list"]
    assert a["l1_hit_tokens"] == 3 * 64 and c["l1_hit_tokens"] == 0


def test_no_new_field_means_the_same_answer(redis_client: redis.Redis) -> None:
    settings = ApiSettings(hash=HashSettings(vllm_version=(0, 34, 0)))
    tokens = list(range(64))
    members = [int(m) for m in BlockHasher(settings.hash).member_keys(tokens, 16)]
    _populate(Store(redis_client), A, l1=members, l3=[])
    client = _client(Store(redis_client), settings)
    for extra in ({}, {"lora_name": None, "lora_path": None, "mm_features": []}, {"lora_name": ""}):
        result = _post(client, [A], {"token_ids": tokens, "block_size": 16, **extra})
        assert result.json["server_score_list"][0]["l1_hit_ratio"] == 1.0, extra


def _item(identifier: Any = "i", offset: Any = 0, length: Any = 4, **more: Any) -> Any:
    return {"identifier": identifier, "offset": offset, "length": length, **more}


BAD = [
    ({"lora_name": 7}, "body.lora_name must be a string or null, got an integer"),
    ({"lora_path": ["x"]}, "body.lora_path must be a string or null, got a list"),
    ({"lora_path": "/p"}, "body.lora_path was given without lora_name"),
    ({"lora_name": "ad"}, "vLLM 0.34.0 hashes the LoRA adapter's path too"),
    ({"mm_features": {"a": 1}}, "body.mm_features must be a list of objects, got an object"),
    ({"mm_features": [3]}, "body.mm_features[0] must be an object, got an integer"),
    ({"mm_features": [_item(), _item(offset=2)]}, "body.mm_features[1] overlaps mm_features[0]"),
    ({"mm_features": [_item(offset=60, length=5)]}, "body.mm_features[0] covers tokens [60, 65)"),
    ({"mm_features": [_item(length=0)]}, "body.mm_features[0].length must be an integer >= 1"),
    ({"mm_features": [_item(length=-3)]}, "length must be an integer >= 1, got -3"),
    ({"mm_features": [_item(offset=-1)]}, "body.mm_features[0].offset must be an integer >= 0"),
    ({"mm_features": [_item(offset=1.0)]}, "offset must be an integer >= 0, got a number"),
    ({"mm_features": [_item(length=True)]}, "length must be an integer >= 1, got a boolean"),
    ({"mm_features": [_item(identifier="")]}, "identifier must be a non-empty string, got an"),
    ({"mm_features": [_item(identifier=5)]}, "identifier must be a non-empty string, got an"),
    ({"mm_features": [_item(modality=1)]}, "body.mm_features[0].modality must be a string"),
    ({"mm_features": [_item(uuid="u")]}, "unknown field body.mm_features[0].uuid"),
    ({"mm_features": [{"identifier": "i", "offset": 0}]}, "field body.mm_features[0].length"),
    (
        {"mm_features": [_item(offset=k, length=1) for k in range(MAX_MM_ITEMS + 1)]},
        f"body.mm_features has {MAX_MM_ITEMS + 1} items, more than the limit of {MAX_MM_ITEMS}",
    ),
    ({"lora": "ad"}, "unknown field body.lora"),
]


@pytest.mark.parametrize(("fields", "message"), BAD)
def test_bad_fields_are_one_sentence_400s(
    redis_client: redis.Redis, fields: dict[str, Any], message: str
) -> None:
    settings = ApiSettings(hash=HashSettings(vllm_version=(0, 34, 0)))
    many = len(fields.get("mm_features") or ()) > MAX_MM_ITEMS
    tokens = list(range(MAX_MM_ITEMS + 64 if many else 64))  # the items fit: the count fails
    body = {"token_ids": tokens, "block_size": 16, **fields}
    result = _post(_client(Store(redis_client), settings), [A], body)
    assert result.status_code == 400, result.text
    doc = result.json
    assert doc["status"] == 400 and doc["server_score_list"] == []
    assert message in doc["message"] and "\n" not in doc["message"], doc["message"]


@pytest.mark.parametrize(
    ("release", "status"), [("0.10.2", 400), ("0.11.0", 400), ("0.11.1", 200), ("0.18.0", 200)]
)
def test_lora_before_0111_is_refused_naming_the_release(
    redis_client: redis.Redis, release: str, status: int
) -> None:
    settings = ApiSettings(hash=HashSettings.from_strings("sha256_cbor", "0", release))
    body = {"token_ids": list(range(32)), "block_size": 16, "lora_name": "ad"}
    result = _post(_client(Store(redis_client), settings), [A], body)
    assert result.status_code == status, result.text
    if status == 400:
        assert result.json["message"].startswith(f"vLLM {release} keys LoRA blocks by the ")
