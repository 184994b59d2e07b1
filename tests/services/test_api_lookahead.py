"""Speculative-decoding lookahead (vLLM >= 0.33, EAGLE/MTP) through the Falcon app, over
fakeredis and a real redis-server: each candidate is answered with the chain of its own L
(learned from its events, else ``blockKey.hashLookaheadTokens``), the prompt hashed once per
distinct L, L1 and L3 alike; the instances report shows each instance's L."""

from __future__ import annotations

import tempfile
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import falcon.testing
import orjson
import pytest

from common import keys
from common.blockhash import BlockHasher, HashSettings
from common.blockhash_extra import HashInputs
from common.config import Config, load_config
from common.settings import ApiSettings
from common.store import Instance, Store, TierOps
from services.api.api_metrics import ApiMetrics
from services.api.app import create_app
from services.api.scoring import LOOKAHEAD_BEFORE_0_33

BS = 16
PATH = "/kv-cache/hit-rate"
PROMPT = list(range(7000, 7000 + 8 * BS + 1))  # 8 full blocks and 1 token
V034 = HashSettings(vllm_version=(0, 34, 0))


class CountingHasher:
    """The real hasher, counting the chains asked for by (block size, lookahead)."""

    def __init__(self, settings: HashSettings) -> None:
        self.real = BlockHasher(settings)
        self.calls: Counter[tuple[int, int]] = Counter()

    def member_keys(
        self,
        token_ids: Sequence[int],
        block_size: int,
        cache_salt: str | None = None,
        *,
        inputs: HashInputs | None = None,
    ) -> list[bytes]:
        self.calls[block_size, inputs.lookahead if inputs else 0] += 1
        return self.real.member_keys(token_ids, block_size, cache_salt, inputs=inputs)


@pytest.fixture()
def store(any_store: Store) -> Store:
    return any_store


def chain(lookahead: int, settings: HashSettings = V034) -> list[int]:
    keys = BlockHasher(settings).member_keys(
        PROMPT, BS, inputs=HashInputs(lookahead=lookahead) if lookahead else None
    )
    return [int(k) for k in keys]


def index(store: Store, ip: str, hashes: list[int], lookahead: int | None) -> int:
    """One GPU batch as the ingester writes it: descriptor, hashes and (if shown) L."""
    gen = store.upsert_instance(Instance(ip=ip, uid=f"u-{ip}"))[1]
    ops = TierOps()
    ops.describe(0, "full_attention", BS, None)
    ops.store("l1", hashes)
    ops.settings(0, 0, 1)
    if lookahead is not None:
        ops.lookahead(lookahead)
    assert store.apply_batch(ip, gen, 0, 0, ops).status == "applied"
    return gen


def load_config_text(text: str) -> Config:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.yaml"
        path.write_text(text, encoding="utf-8")
        return load_config(path, env={})


def client(
    store: Store, hasher: Any, settings: ApiSettings, metrics: ApiMetrics | None = None
) -> falcon.testing.TestClient:
    return falcon.testing.TestClient(create_app(settings, store, hasher, metrics or ApiMetrics()))


def ask(c: falcon.testing.TestClient, ips: list[str]) -> list[dict[str, Any]]:
    doc = {"server_ip": ips, "body": {"token_ids": PROMPT, "block_size": BS}}
    result = c.simulate_post(PATH, body=orjson.dumps(doc), params={"detail": "1"})
    assert result.status_code == 200, result.text
    scores: list[dict[str, Any]] = result.json["server_score_list"]
    return scores


def test_each_candidate_gets_the_chain_of_its_own_lookahead(store: Store) -> None:
    """Four L values in one question, each hashed once: L=0 and L=1 chains have 8 blocks,
    L=2 only 7 (the last full block has 1 token after it). An instance holding another L's
    hashes answers 0; one with no L learned (L3 only) takes the configured default."""
    c0, c1, c2 = chain(0), chain(1), chain(2)
    assert len(c0) == len(c1) == 8 and len(c2) == 7
    assert not set(c0) & set(c1) and not set(c1) & set(c2)
    index(store, "10.0.2.1", c0[:8], 0)
    index(store, "10.0.2.2", c1[:5], 1)
    index(store, "10.0.2.3", c1[:8], 1)
    index(store, "10.0.2.4", c2[:7], 2)
    index(store, "10.0.2.5", c0[:8], 1)  # L=1 engine: another chain's hashes never match
    index(store, "10.0.2.6", c1[:8], None)  # an older ingester: no L written, default 1
    store.replace_l3("10.0.2.3", c1[:3])
    store.upsert_instance(Instance(ip="10.0.2.7", uid="u7"))
    store.replace_l3("10.0.2.7", c1[:6])  # no events at all: L3 only, the default L
    hasher = CountingHasher(V034)
    metrics = ApiMetrics()
    api = client(store, hasher, ApiSettings(hash=V034, hash_lookahead=1), metrics)
    ips = [f"10.0.2.{i}" for i in range(1, 8)]
    got = {s["server_ip"]: (s["l1_hit_ratio"], s["l3_hit_ratio"]) for s in ask(api, ips)}
    assert got == {
        "10.0.2.1": (1.0, 0.0),
        "10.0.2.2": (5 / 8, 0.0),
        "10.0.2.3": (1.0, 3 / 8),
        "10.0.2.4": (7 / 8, 0.0),
        "10.0.2.5": (0.0, 0.0),
        "10.0.2.6": (1.0, 0.0),
        "10.0.2.7": (0.0, 6 / 8),
    }
    assert hasher.calls == {(BS, 0): 1, (BS, 1): 1, (BS, 2): 1}
    text = metrics.render().decode()
    assert "cache_indexer_api_hashed_blocks_total 23" in text  # 8 + 8 + 7
    scores = {s["server_ip"]: s for s in ask(api, ips)}
    assert scores["10.0.2.4"]["l1_hit_tokens"] == 7 * BS and scores["10.0.2.4"]["l1_exact"]
    assert hasher.calls == {(BS, 0): 2, (BS, 1): 2, (BS, 2): 2}


def test_a_changed_lookahead_is_read_again_and_answered_with_the_new_chain(store: Store) -> None:
    hasher = CountingHasher(V034)
    api = client(store, hasher, ApiSettings(hash=V034))
    gen = index(store, "10.0.3.1", chain(1), 1)
    assert ask(api, ["10.0.3.1"])[0]["l1_hit_ratio"] == 1.0
    ops = TierOps()
    ops.store("l1", chain(2)[:4])
    ops.lookahead(2)  # the engine restarted with MTP k=2: the store resets the instance
    assert store.apply_batch("10.0.3.1", gen, 0, 1, ops).status == "groups_changed"
    new_gen = store.get_instance("10.0.3.1").gen  # type: ignore[union-attr]
    assert store.apply_batch("10.0.3.1", new_gen, 0, 0, ops).status == "applied"
    assert ask(api, ["10.0.3.1"])[0]["l1_hit_ratio"] == 4 / 8
    assert hasher.calls[BS, 2] == 1


def test_a_lookahead_on_a_release_before_0_33_answers_0_with_the_reason(store: Store) -> None:
    """blockKey.vllmVersion 0.28 and an instance whose events show L=1: the config is wrong;
    its candidate answers 0 with the reason, the others as usual, never a 400."""
    v028 = HashSettings()
    index(store, "10.0.4.1", chain(0, v028), 1)
    index(store, "10.0.4.2", chain(0, v028), 0)
    api = client(store, BlockHasher(v028), ApiSettings())
    late, fine = ask(api, ["10.0.4.1", "10.0.4.2"])
    assert (late["l1_hit_ratio"], late["l1_exact"]) == (0.0, False)
    assert late["l1_inexact_reason"] == LOOKAHEAD_BEFORE_0_33
    assert fine["l1_hit_ratio"] == 1.0


def test_the_instances_report_shows_each_lookahead_and_its_source(store: Store) -> None:
    index(store, "10.0.5.1", chain(2), 2)
    index(store, "10.0.5.2", chain(0), 0)
    store.upsert_instance(Instance(ip="10.0.5.3", uid="u3"))
    settings = ApiSettings.from_config(
        load_config_text("blockKey:\n  vllmVersion: 0.34.0\n  hashLookaheadTokens: 1\n")
    )
    api = client(store, BlockHasher(V034), settings)
    result = api.simulate_get("/kv-cache/instances")
    assert result.status_code == 200, result.text
    got = {
        i["server_ip"]: (i["groups"]["lookahead_tokens"], i["groups"]["lookahead_source"])
        for i in result.json["instances"]
    }
    assert got == {"10.0.5.1": (2, "events"), "10.0.5.2": (0, "events"), "10.0.5.3": (1, "config")}
    store.r.hset(keys.l1_groups("10.0.5.2"), "la", "65")  # not a value the ingester writes
    result = api.simulate_get("/kv-cache/instances")
    shown = {i["server_ip"]: i["groups"] for i in result.json["instances"]}
    assert (shown["10.0.5.2"]["lookahead_tokens"], shown["10.0.5.2"]["lookahead_source"]) == (
        1,
        "config",
    )


def test_a_hybrid_with_lookahead_reads_only_the_blocks_its_chain_has(store: Store) -> None:
    """gpt-oss-like (sliding window 32 in group 0, full attention in group 1) with L=2: the
    chain has 7 blocks of 129 tokens; both groups are read at positions < 7 only, and the
    window's last two blocks decide the hit (112 tokens), as vLLM's rule does."""
    c2 = chain(2)
    gen = store.upsert_instance(Instance(ip="10.0.6.1", uid="u6"))[1]
    ops = TierOps()
    ops.describe(0, "sliding_window", BS, 32)
    ops.store("l1", [c2[5], c2[6]], group=0)
    ops.describe(1, "full_attention", BS, None)
    ops.store("l1", c2, group=1)
    ops.settings(BS, 0, 1)
    ops.lookahead(2)
    assert store.apply_batch("10.0.6.1", gen, 0, 0, ops).status == "applied"
    index(store, "10.0.6.2", chain(0), 0)
    hasher = CountingHasher(V034)
    (hybrid, dense) = ask(client(store, hasher, ApiSettings(hash=V034)), ["10.0.6.1", "10.0.6.2"])
    assert (hybrid["l1_hit_tokens"], hybrid["l1_hit_ratio"], hybrid["l1_exact"]) == (
        112,
        7 / 8,
        True,
    )
    assert (dense["l1_hit_tokens"], dense["l1_hit_ratio"]) == (128, 1.0)
    assert hasher.calls == {(BS, 0): 1, (BS, 2): 1}


def test_a_sparse_hybrid_with_lookahead_is_not_read_past_its_chain(store: Store) -> None:
    """Sliding window (block 16, window 32) next to full attention of block 64, hash unit 16:
    the window's probes are sparse (the windows before each 64-token edge) and the last
    edge's (positions 6, 7) lies past the L=2 chain's 7 hashes, as does full attention's
    second block (position 7): both read as absent, so the hit is the first 64 tokens."""
    c2 = chain(2)
    gen = store.upsert_instance(Instance(ip="10.0.7.1", uid="u7"))[1]
    ops = TierOps()
    ops.describe(0, "sliding_window", BS, 32)
    ops.store("l1", [c2[2], c2[3], c2[5], c2[6]], group=0)
    ops.describe(1, "full_attention", 64, None)
    ops.store("l1", [c2[3]], group=1)
    ops.settings(BS, 0, 1)
    ops.lookahead(2)
    assert store.apply_batch("10.0.7.1", gen, 0, 0, ops).status == "applied"
    (score,) = ask(client(store, CountingHasher(V034), ApiSettings(hash=V034)), ["10.0.7.1"])
    assert (score["l1_hit_tokens"], score["l1_hit_ratio"], score["l1_exact"]) == (64, 0.5, True)
