"""``GET /kv-cache/instances`` and the status gauges of ``/metrics``, on a real redis-server
(and fakeredis): the document's exact shape, one round trip, Redis failures."""

from __future__ import annotations

import json
from typing import Any

import falcon.testing
import orjson
import pytest
import redis

from common import keys
from common.blockhash import BlockHasher, HashSettings
from common.config import Redis
from common.settings import ApiSettings
from common.status_report import Limits, StatusReader, build_report
from common.store import Instance, L1Status, Store, TierOps
from services.api.api_metrics import ApiMetrics
from services.api.app import create_app, redis_client
from tests.conftest import reserve_port
from tests.store_oracle import OracleStore

PATH = "/kv-cache/instances"
URL = "http://10.0.0.90:9003"


def _client(store: Store) -> falcon.testing.TestClient:
    hasher = BlockHasher(HashSettings())
    return falcon.testing.TestClient(create_app(ApiSettings(), store, hasher, ApiMetrics()))


def _now_ms(store: Store) -> int:
    sec, usec = store.r.time()
    return int(sec) * 1000 + int(usec) // 1000


def populate(store: Store) -> None:
    """One followed, hash-checked instance with L3 data, one nobody follows, one master."""
    now = _now_ms(store)
    _, gen = store.upsert_instance(
        Instance("10.0.0.5", "uid-a", pod="vllm-a", http_endpoint="http://10.0.0.5:8000")
    )
    store.upsert_instance(Instance("10.0.0.6", "uid-b", pod="vllm-b"))
    store.heartbeat_ingester("ing-1", 60_000)
    assert store.claim_instance("10.0.0.5", "ing-1", 60_000)
    ops = TierOps()
    ops.store("l1", [11, 12, 13])
    assert store.apply_batch("10.0.0.5", gen, 0, 4, ops, owner="ing-1").status == "applied"
    status = L1Status(
        "10.0.0.5",
        gen,
        "ing-1",
        {
            "ingester": "ing-1",
            "status_ms": str(now),
            "subscribed_ms": str(now - 9000),
            "last_event_ms": str(now - 2000),
            "conn": "connected",
            "conn_detail": "tcp://x:5557",
            "replaying": "0",
            "hash_check": "mismatch",
            "hash_check_detail": "the engine hashes with pythonHashSeed '1' and sha256_cbor; "
            "the config says pythonHashSeed '0'",
        },
        {"hash_check_ok": 0, "hash_check_mismatch": 3},
    )
    assert store.write_l1_status([status]) == [True]
    assert store.replace_l3(
        "10.0.0.5",
        [11, 12],
        {"master": URL, "updated_ms": str(now - 4000), "blocks": "2", "stale": "0"},
    )
    store.set_masters({URL: json.dumps({"pod": "mooncake-master-0"})})
    store.r.hset(
        keys.master_state(URL),
        mapping={
            "keys": "10",
            "keys_unparsed": "2",
            "sample_unparsed": "weird-key",
            "keys_unmappable_group": "3",
            "blocks": "2",
            "updated_ms": str(now - 1000),
            "stale": "0",
            "error": "",
        },
    )


def test_document_shape(any_store: Store) -> None:
    populate(any_store)
    result = _client(any_store).simulate_get(PATH)
    assert result.status_code == 200
    doc = orjson.loads(result.content)
    assert set(doc) == {"instances", "masters"}
    a, b = doc["instances"]
    assert set(a) == {"server_ip", "pod", "http", "l1", "l3", "groups"}
    assert (a["http"], b["http"]) == ("http://10.0.0.5:8000", None)
    assert (a["groups"]["hybrid"], a["groups"]["exact"], a["groups"]["inexact_reasons"]) == (
        False,
        True,
        [],
    )
    assert {
        "state",
        "blocks",
        "hash_check",
        "hash_check_detail",
        "last_event_age_s",
        "gaps",
        "ingester",
    } <= set(a["l1"])
    assert set(a["l3"]) == {"blocks", "age_s", "stale", "master"}
    assert (a["server_ip"], a["pod"], a["l1"]["state"], a["l1"]["blocks"]) == (
        "10.0.0.5",
        "vllm-a",
        "synced",
        3,
    )
    assert a["l1"]["hash_check"] == "mismatch" and a["l1"]["hash_check_mismatch"] == 3
    assert "pythonHashSeed '1'" in a["l1"]["hash_check_detail"]
    assert 1.5 <= a["l1"]["last_event_age_s"] < 30 and a["l1"]["ingester"] == "ing-1"
    assert a["l1"]["gaps"] == 0
    assert a["l3"]["blocks"] == 2 and a["l3"]["master"] == URL and a["l3"]["stale"] is False
    assert 3.5 <= a["l3"]["age_s"] < 30
    assert b["l1"]["state"] == "unassigned" and b["l1"]["hash_check"] == "unchecked"
    assert b["l3"] == {"blocks": None, "age_s": None, "stale": False, "master": None}
    (m,) = doc["masters"]
    assert {
        k: m[k]
        for k in (
            "url",
            "keys",
            "keys_unparsed",
            "sample_unparsed",
            "keys_unmappable_group",
            "stale",
            "error",
        )
    } == {
        "url": URL,
        "keys": 10,
        "keys_unparsed": 2,
        "sample_unparsed": "weird-key",
        "keys_unmappable_group": 3,
        "stale": False,
        "error": None,
    }
    assert set(m) >= {"url", "keys", "keys_unparsed", "sample_unparsed", "age_s", "stale"}


@pytest.mark.parametrize(
    ("fields", "state"),
    [
        ({"conn": "unreachable"}, "unreachable"),
        ({"replaying": "1"}, "replaying"),
        ({"gap:0": "2"}, "gap"),
        ({"last_event_ms": "-60000"}, "no_events"),
        ({"status_ms": "-60000"}, "unassigned"),
    ],
)
def test_state_precedence(any_store: Store, fields: dict[str, str], state: str) -> None:
    populate(any_store)
    now = _now_ms(any_store)
    fields = {k: str(now + int(v)) if k.endswith("_ms") else v for k, v in fields.items()}
    any_store.r.hset(keys.l1_state("10.0.0.5"), mapping=fields)  # type: ignore[arg-type]
    doc = build_report(StatusReader(any_store.r).read(), Limits(no_events_after=30))
    assert doc["instances"][0]["l1"]["state"] == state


def test_owner_that_stopped_heartbeating_means_unassigned(any_store: Store) -> None:
    populate(any_store)
    any_store.leave_ingesters("ing-1")  # the lease is still there, its holder is not
    doc = build_report(StatusReader(any_store.r).read(), Limits())
    assert doc["instances"][0]["l1"]["state"] == "unassigned"
    assert "ing-1" in doc["instances"][0]["l1"]["state_detail"]


class _Counting(redis.Redis):
    """A client that counts round trips of pipelines."""

    trips = 0

    def pipeline(self, transaction: bool = True, shard_hint: Any = None) -> Any:
        pipe = super().pipeline(transaction, shard_hint)
        original = pipe.execute

        def execute(raise_on_error: bool = True) -> Any:
            _Counting.trips += 1
            return original(raise_on_error)

        pipe.execute = execute  # type: ignore[method-assign]
        return pipe


def test_one_round_trip_once_the_registry_is_known(redis_client: redis.Redis) -> None:
    populate(OracleStore(redis_client))
    counting = _Counting(connection_pool=redis_client.connection_pool)
    reader = StatusReader(counting)
    first = build_report(reader.read(), Limits())
    assert _Counting.trips == 2  # registry learnt
    _Counting.trips = 0
    again = build_report(reader.read(), Limits())
    assert [(i["server_ip"], i["l1"]["blocks"]) for i in again["instances"]] == [
        (i["server_ip"], i["l1"]["blocks"]) for i in first["instances"]
    ]
    assert again["masters"][0]["keys"] == 10
    assert _Counting.trips == 1
    OracleStore(redis_client).remove_instance("10.0.0.6")
    _Counting.trips = 0
    assert [i["server_ip"] for i in build_report(reader.read(), Limits())["instances"]] == [
        "10.0.0.5"
    ]
    assert _Counting.trips == 1


def test_redis_down_is_a_500_and_metrics_still_answer() -> None:
    client = _client(OracleStore(redis_client(Redis(url=f"redis://127.0.0.1:{reserve_port()}/0"))))
    result = client.simulate_get(PATH)
    assert result.status_code == 500
    assert orjson.loads(result.content) == {
        "message": "the state store is unreachable",
        "status": 500,
    }
    metrics = client.simulate_get("/metrics")
    assert metrics.status_code == 200
    assert 'cache_indexer_api_redis_errors_total{op="metrics"} 1' in metrics.text


def test_metrics_show_instance_states_and_master_keys(any_store: Store) -> None:
    populate(any_store)
    text = _client(any_store).simulate_get("/metrics").text
    assert 'cache_indexer_instance_l1_state{server_ip="10.0.0.5",state="synced"} 1.0' in text
    assert 'cache_indexer_instance_l1_state{server_ip="10.0.0.6",state="unassigned"} 1.0' in text
    assert (
        'cache_indexer_instance_l1_hash_check{result="mismatch",server_ip="10.0.0.5"} 1.0' in text
    )
    assert f'cache_indexer_master_keys_unparsed{{url="{URL}"}} 2.0' in text
    assert f'cache_indexer_master_keys_unmappable_group{{url="{URL}"}} 3.0' in text
    assert 'cache_indexer_instance_blocks{server_ip="10.0.0.5",tier="l3"} 2.0' in text
    assert 'cache_indexer_instance_exact{server_ip="10.0.0.5"} 1.0' in text
    used = [
        ln for ln in text.splitlines() if ln.startswith("cache_indexer_redis_used_memory_bytes ")
    ]
    if not type(any_store.r).__module__.startswith("fakeredis"):
        assert len(used) == 1 and float(used[0].split()[1]) > 0
    else:  # fakeredis has no INFO: the gauges are left out, not an error
        assert used == [] and "cache_indexer_api_redis_errors_total{" not in text


def test_hybrid_groups_are_described_with_their_exactness(any_store: Store) -> None:
    """Gemma-3-like groups [SWA, SWA, FA]: shown as learned; exact once the self-check
    confirmed the derived hash unit; a chunked-local group without a chunk size is not."""
    _, gen = any_store.upsert_instance(Instance(ip="10.0.0.9", uid="u9"))
    ops = TierOps()
    for g, kind, window in (
        (0, "sliding_window", 64),
        (1, "sliding_window", 64),
        (2, "full_attention", None),
    ):
        ops.describe(g, kind, 32, window)
    assert any_store.apply_batch("10.0.0.9", gen, 0, 0, ops).status == "applied"
    client = _client(any_store)

    def groups() -> dict[str, object]:
        doc = orjson.loads(client.simulate_get(PATH).content)
        (inst,) = [i for i in doc["instances"] if i["server_ip"] == "10.0.0.9"]
        return dict(inst["groups"])

    got = groups()
    assert got["hybrid"] is True and got["hash_unit"] == 32
    assert got["hash_unit_source"] == "events"
    assert [(g["group"], g["kind"], g["sliding_window"]) for g in got["kv_cache_groups"]] == [
        (0, "sliding_window", 64),
        (1, "sliding_window", 64),
        (2, "full_attention", None),
    ]
    assert (got["exact"], got["inexact_reasons"]) == (False, ["unconfirmed_hash_unit"])
    metrics = client.simulate_get("/metrics").text
    assert 'cache_indexer_instance_exact{server_ip="10.0.0.9"} 0.0' in metrics
    any_store.write_l1_status([L1Status("10.0.0.9", gen, "", {"hash_check": "ok"})])
    assert (groups()["exact"], groups()["inexact_reasons"]) == (True, [])
    ops = TierOps()
    ops.describe(3, "chunked_local_attention", 32, None)
    any_store.apply_batch("10.0.0.9", gen, 0, 1, ops)
    assert groups()["inexact_reasons"] == ["chunk_size_unknown"]
