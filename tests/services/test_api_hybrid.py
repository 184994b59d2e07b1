"""Hit ratios of hybrid (multi-group) instances through the Falcon app, over fakeredis and a
real redis-server: vLLM's rule per group, the detail form, exactness, and the reads."""

from __future__ import annotations

import random
from typing import Any

import falcon.testing
import orjson
import pytest

from common import hit_rule, keys
from common.blockhash import BlockHasher
from common.settings import ApiSettings
from common.store import Instance, L1Status, Store, TierOps
from services.api.api_metrics import ApiMetrics
from services.api.app import create_app

BS = 16
PATH = "/kv-cache/hit-rate"
HYB, DENSE = "10.0.1.1", "10.0.1.2"
PROMPT = list(range(5000, 5000 + 8 * BS + 5))  # 8 full blocks and 5 tokens
GPTOSS = ((0, "sliding_window", 32), (1, "full_attention", None))  # SWA is group 0


@pytest.fixture(scope="module")
def hasher() -> BlockHasher:
    return BlockHasher(ApiSettings().hash)


@pytest.fixture()
def store(any_store: Store) -> Store:
    return any_store


def _members(hasher: BlockHasher, unit: int = BS) -> list[int]:
    return [int(m) for m in hasher.member_keys(PROMPT, unit)]


def _register(store: Store, ip: str, dp: int = 1) -> int:
    return store.upsert_instance(Instance(ip=ip, uid=f"u-{ip}", dp_size=dp))[1]


def _index(
    store: Store,
    ip: str,
    held: dict[int, list[int]],
    members: list[int],
    shape: tuple[tuple[int, str | None, int | None], ...] = GPTOSS,
    *,
    dp: int = 1,
    h_cfg: int = 0,
    block: int = BS,
) -> int:
    """Index ``held[group]`` (chain positions) as one batch with each group's descriptor."""
    gen = _register(store, ip, dp)
    ops = TierOps()
    for g, kind, window in shape:
        ops.describe(g, kind, block, window)
        ops.store("l1", [members[i] for i in held.get(g, [])], group=g)
    ops.settings(h_cfg, 0, dp)
    assert store.apply_batch(ip, gen, 0, 0, ops).status == "applied"
    return gen


def _client(
    store: Store, hasher: BlockHasher, metrics: ApiMetrics | None = None
) -> falcon.testing.TestClient:
    return falcon.testing.TestClient(
        create_app(ApiSettings(), store, hasher, metrics or ApiMetrics())
    )


def _ask(
    client: falcon.testing.TestClient,
    ips: list[str],
    tokens: list[int] = PROMPT,
    detail: bool = True,
) -> list[dict[str, Any]]:
    doc = {"server_ip": ips, "body": {"token_ids": tokens, "block_size": BS}}
    result = client.simulate_post(
        PATH, body=orjson.dumps(doc), params={"detail": "1"} if detail else None
    )
    assert result.status_code == 200, result.text
    scores: list[dict[str, Any]] = result.json["server_score_list"]
    return scores


def test_sliding_window_tail_decides_the_hit(store: Store, hasher: BlockHasher) -> None:
    """FA holds all 8 blocks; the window (need 2 blocks) is held only at blocks 4-5: vLLM
    reuses 6 blocks (96 tokens), not 8."""
    m = _members(hasher)
    gen = _index(store, HYB, {1: list(range(8)), 0: [4, 5]}, m)
    store.replace_l3(HYB, {1: m[:8], 0: m[6:8]}, gen=gen)
    store.r.hset(keys.l1_state(HYB), "hash_check", "ok")
    client = _client(store, hasher)
    (score,) = _ask(client, [HYB])
    assert (score["l1_hit_tokens"], score["l1_hit_ratio"]) == (96, 0.75)
    assert (score["l3_hit_tokens"], score["l3_hit_ratio"]) == (128, 1.0)
    assert score["l1_exact"] and score["l3_exact"] and score["l1_inexact_reason"] is None
    assert _ask(client, [HYB]) == [score], "the second request, from the cached view, agrees"


def test_single_group_answers_as_before_and_detail_is_opt_in(
    store: Store, hasher: BlockHasher
) -> None:
    m = _members(hasher)
    _index(store, DENSE, {0: list(range(8))}, m, ((0, "full_attention", None),))
    store.replace_l3(DENSE, m[:3])
    client = _client(store, hasher)
    plain = _ask(client, [DENSE, DENSE], detail=False)
    assert plain == [{"server_ip": DENSE, "l1_hit_ratio": 1.0, "l3_hit_ratio": 3 / 8}] * 2
    (score,) = _ask(client, [DENSE])
    assert (score["l1_hit_tokens"], score["l3_hit_tokens"]) == (128, 48)
    assert score["l1_exact"] and score["l3_exact"]
    aligned = PROMPT[: 8 * BS]  # block-aligned and fully held: vLLM recomputes the last block
    (score,) = _ask(client, [DENSE], aligned)
    assert (score["l1_hit_ratio"], score["l1_hit_tokens"]) == (1.0, 7 * BS)


def test_a_hybrid_is_read_twice_only_when_its_groups_change(
    store: Store, hasher: BlockHasher
) -> None:
    m = _members(hasher)
    metrics = ApiMetrics()
    client = _client(store, hasher, metrics)
    _index(store, HYB, {1: list(range(8)), 0: [6, 7]}, m)
    store.r.hset(keys.l1_state(HYB), "hash_check", "ok")

    def rereads() -> float:
        text = metrics.render().decode()
        line = next(
            x for x in text.splitlines() if x.startswith("cache_indexer_api_group_rereads_total")
        )
        return float(line.split()[-1])

    assert _ask(client, [HYB, DENSE])[0]["l1_hit_tokens"] == 128
    assert rereads() == 1  # the hybrid was new to this worker; the unknown dense one was not
    assert _ask(client, [HYB, DENSE])[0]["l1_hit_tokens"] == 128
    assert rereads() == 1
    ops = TierOps()  # a group learned later (a third group, sliding window 64, empty)
    ops.describe(2, "sliding_window", BS, 64)
    gen = store.get_instance(HYB).gen  # type: ignore[union-attr]
    store.apply_batch(HYB, gen, 0, 1, ops)
    assert _ask(client, [HYB])[0]["l1_hit_tokens"] == 0
    assert rereads() == 2


@pytest.mark.parametrize(
    ("shape", "dp", "reason"),
    [
        (((0, None, None), (1, "full_attention", None)), 1, "unknown_group_kind"),
        (((0, "unknown", None), (1, "full_attention", None)), 1, "unknown_group_kind"),
        (GPTOSS, 2, "dp_union"),
    ],
)
def test_inexact_hybrids_say_why(
    store: Store,
    hasher: BlockHasher,
    shape: tuple[tuple[int, str | None, int | None], ...],
    dp: int,
    reason: str,
) -> None:
    m = _members(hasher)
    _index(store, HYB, {0: list(range(8)), 1: list(range(8))}, m, shape, dp=dp)
    store.r.hset(keys.l1_state(HYB), "hash_check", "ok")
    metrics = ApiMetrics()
    (score,) = _ask(_client(store, hasher, metrics), [HYB])
    assert not score["l1_exact"] and reason in score["l1_inexact_reason"].split(",")
    assert score["l1_hit_tokens"] <= 128
    assert (
        f'cache_indexer_api_inexact_answers_total{{reason="{reason}",tier="l1"}} 1.0'
        in metrics.render().decode()
    )


def test_a_derived_hash_unit_is_exact_once_the_self_check_confirms_it(
    store: Store, hasher: BlockHasher
) -> None:
    m = _members(hasher)
    gen = _index(store, HYB, {0: [6, 7], 1: list(range(8))}, m)
    client = _client(store, hasher)
    (score,) = _ask(client, [HYB])
    assert score["l1_hit_tokens"] == 128
    assert score["l1_inexact_reason"] == "unconfirmed_hash_unit"
    store.write_l1_status([L1Status(HYB, gen, "", {"hash_check": "ok"})])
    assert _ask(client, [HYB])[0]["l1_exact"]


def test_a_configured_hash_unit_finer_than_the_blocks(store: Store, hasher: BlockHasher) -> None:
    """A Qwen3.5-like model: Mamba and full attention at B = 4 × 16, prefix-match unit 16.
    The chain is hashed at 16; the FA group holds coarse block ends and a partial tail, the
    Mamba group one state; vLLM's fine-grained rule gives the Mamba state's length."""
    fine = _members(hasher, 16)  # 8 units of 16
    shape = ((0, "mamba", None), (1, "full_attention", None))
    gen = _index(store, HYB, {0: [5], 1: [3, 7, 4, 5, 6]}, fine, shape, h_cfg=16, block=64)
    del gen
    (score,) = _ask(_client(store, hasher), [HYB])
    specs = [hit_rule.GroupSpec("mamba", 64), hit_rule.GroupSpec("full_attention", 64)]
    rule = hit_rule.build_rule(specs, 16)
    present = [[int(i == 5) for i in range(8)], [int(i in (3, 4, 5, 6, 7)) for i in range(8)]]
    assert score["l1_hit_tokens"] == hit_rule.hit_tokens(rule, len(PROMPT), present) == 96
    assert score["l1_exact"], score


def test_random_presence_matches_the_rule(store: Store, hasher: BlockHasher) -> None:
    """The API's reads and flags, end to end, against the pure rule on the same sets."""
    rng = random.Random(7)
    m = _members(hasher)
    shape = ((0, "sliding_window", 48), (1, "full_attention", None), (2, "mamba", None))
    specs = [
        hit_rule.GroupSpec("sliding_window", BS, 48),
        hit_rule.GroupSpec("full_attention", BS),
        hit_rule.GroupSpec("mamba", BS),
    ]
    rule = hit_rule.build_rule(specs, BS)
    client = _client(store, hasher)
    for trial in range(25):
        held = {g: [i for i in range(8) if rng.random() < 0.7] for g in range(3)}
        held[1] = list(range(rng.randint(0, 8)))
        store.remove_instance(HYB)
        _index(store, HYB, held, m, shape)
        store.r.hset(keys.l1_state(HYB), "hash_check", "ok")
        present = [[int(i in held[g]) for i in range(8)] for g in range(3)]
        (score,) = _ask(client, [HYB])
        assert score["l1_hit_tokens"] == hit_rule.hit_tokens(rule, len(PROMPT), present), trial
