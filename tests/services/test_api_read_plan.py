"""The hit-rate read in rounds (services/api/read_plan.py) through ``score`` over fakeredis and
a real redis-server (and a real Redis Cluster: tests/integration/test_read_plan_cluster.py):
every answer equals the full read's (holes in the middle, every edge of round one, the end of
the prompt, hybrids), in at most two round trips, and the members read grow with the hits."""

from __future__ import annotations

import random
from array import array
from typing import Any

import pytest

from common import hit_rule, keys
from common.blockhash import BlockHasher
from common.settings import ApiSettings
from common.store import Instance, Store, TierOps
from common.store_reads import Reads
from services.api import read_plan
from services.api.api_metrics import ApiMetrics
from services.api.hit_rate import HitRateRequest, score
from services.api.scoring import ViewCache

BS = 16
N = 300  # full blocks: more than read_plan.WHOLE, so round one reads a chunk and samples
PROMPT = list(range(7000, 7000 + N * BS + 3))


class Counting:
    """The store as the API reads it, counting round trips and SMISMEMBER members."""

    def __init__(self, store: Store) -> None:
        self.store, self.trips, self.members = store, 0, 0

    def execute(self, reads: Reads) -> list[Any]:
        self.trips += 1
        self.members += sum(
            len(reads.blobs[c[2]].members) for c in reads.cmds if c[0] == "SMISMEMBER"
        )
        return self.store.execute(reads)


@pytest.fixture(scope="module")
def hasher() -> BlockHasher:
    return BlockHasher(ApiSettings().hash)


@pytest.fixture()
def store(any_store: Store) -> Store:
    return any_store


def _chain(hasher: BlockHasher, unit: int = BS, tokens: list[int] = PROMPT) -> list[int]:
    return [int(m) for m in hasher.member_keys(tokens, unit)]


def _ip(i: int) -> str:
    return f"10.7.{i // 256}.{i % 256}"


def _hold(store: Store, ip: str, l1: list[int], l3: list[int], filler: int = 50) -> None:
    """Register ``ip`` holding ``l1`` and ``l3`` (and some unrelated hashes)."""
    store.remove_instance(ip)
    gen = store.upsert_instance(Instance(ip=ip, uid=f"u-{ip}"))[1]
    ops = TierOps()
    ops.store("l1", l1 + [(1 << 62) + i for i in range(filler)])
    assert store.apply_batch(ip, gen, 0, 0, ops).status == "applied"
    store.replace_l3(ip, l3 + [(1 << 61) + i for i in range(filler)], gen=gen)


def _ask(
    store: Counting, hasher: BlockHasher, ips: list[str], views: ViewCache, tokens: list[int]
) -> list[dict[str, Any]]:
    request = HitRateRequest(ips, array("Q", tokens), BS, None)
    return score(request, store, hasher, ApiMetrics(), views, detail=True)


def _run(chain: list[int], held: set[int]) -> int:
    return next((i for i, h in enumerate(chain) if h not in held), len(chain))


def _check(
    store: Store,
    hasher: BlockHasher,
    held: dict[str, tuple[list[int], list[int]]],
    tokens: list[int],
) -> Counting:
    """Ask for every ip of ``held`` (views warmed first) and compare with the full read."""
    chain = _chain(hasher, BS, tokens)
    for ip, (l1, l3) in held.items():
        _hold(store, ip, l1, l3)
    views, ips = ViewCache(), list(held)
    _ask(Counting(store), hasher, ips, views, tokens)  # warm: this worker's views
    counting = Counting(store)
    answers = _ask(counting, hasher, ips, views, tokens)
    top = (len(tokens) - 1) // BS
    for doc in answers:
        l1, l3 = held[doc["server_ip"]]
        run1, run3 = _run(chain, set(l1)), _run(chain, set(l3))
        assert doc["l1_hit_tokens"] == min(run1, top) * BS, doc
        assert doc["l3_hit_tokens"] == min(run3, top) * BS, doc
        assert doc["l1_hit_ratio"] == run1 / len(chain), doc
    assert counting.trips <= 2
    return counting


def test_a_miss_at_every_edge_of_round_one(store: Store, hasher: BlockHasher) -> None:
    """Runs ending at each position round one reads (first chunk, samples, the last block),
    one before and one after; L3 also holds every block after its miss (an eviction)."""
    chain = _chain(hasher)
    edges = sorted({p + d for p in read_plan._picks(N) for d in (-1, 0, 1)} | {0, N})
    held = {}
    for i, edge in enumerate(e for e in edges if 0 <= e <= N):
        held[_ip(i)] = (chain[:edge], chain[:edge] + chain[edge + 1 :])
    _check(store, hasher, held, PROMPT)


@pytest.mark.parametrize("extra", [0, 3, BS - 1])
def test_a_run_to_the_end_of_the_prompt(store: Store, hasher: BlockHasher, extra: int) -> None:
    """The whole prompt held: ratio 1.0, and (vLLM never reuses the last token) one block
    less in tokens when the prompt ends on a block boundary."""
    tokens = PROMPT[: N * BS + extra]
    chain = _chain(hasher, BS, tokens)
    _check(store, hasher, {_ip(0): (chain, chain[:-1]), _ip(1): (chain[:-1], chain)}, tokens)


def test_holes_in_the_middle_give_the_exact_prefix(store: Store, hasher: BlockHasher) -> None:
    rng = random.Random(32)
    chain = _chain(hasher)
    held = {}
    for i in range(40):
        sets = []
        for _ in range(2):
            have = list(chain[: rng.randint(0, N)])
            for _ in range(rng.randint(1, 4)):  # evicted blocks anywhere in the prefix
                if have:
                    have.remove(rng.choice(have))
            have += [h for h in chain[len(have) :] if rng.random() < 0.4]  # held past a miss
            sets.append(have)
        held[_ip(i)] = (sets[0], sets[1])
    _check(store, hasher, held, PROMPT)


def test_members_read_grow_with_the_hits(store: Store, hasher: BlockHasher) -> None:
    """64 candidates, none holding the prompt: one round trip of the first chunk and samples;
    with 4 holders, a second round trip of about their hits (not candidates × blocks)."""
    chain, picks = _chain(hasher), len(read_plan._picks(N))
    nobody = {_ip(i): ([], []) for i in range(64)}
    counting = _check(store, hasher, nobody, PROMPT)
    assert counting.trips == 1 and counting.members == 64 * 2 * picks
    runs = [40, 120, 200, 290]
    holders = {_ip(i): (chain[:r], chain[: r // 2]) for i, r in zip(range(4), runs)}
    counting = _check(store, hasher, {**nobody, **holders}, PROMPT)
    hits = sum(r + r // 2 for r in runs)
    assert counting.trips == 2
    assert counting.members <= 64 * 2 * picks + read_plan.GROWTH * hits + 8
    assert counting.members < 64 * 2 * N / 10  # the full read's tenth


def test_a_thousand_candidates_in_two_round_trips(store: Store, hasher: BlockHasher) -> None:
    chain = _chain(hasher)
    rng = random.Random(1024)
    held = {_ip(i): ([], []) for i in range(1024)}
    for i in rng.sample(range(1024), 8):
        held[_ip(i)] = (chain[: rng.randint(0, N)], chain[: rng.randint(0, N)])
    assert _check(store, hasher, held, PROMPT).trips == 2


def test_changed_descriptors_start_over_in_the_next_round_trip(
    store: Store, hasher: BlockHasher
) -> None:
    """A worker's cached view is stale (its first request): the candidate is read again
    with its new view; the answer is exact and the re-read counted."""
    chain = _chain(hasher)
    ip = _ip(0)
    gen = store.upsert_instance(Instance(ip=ip, uid="u"))[1]
    ops = TierOps()
    ops.describe(0, "full_attention", BS, None)
    ops.store("l1", chain[:150])
    assert store.apply_batch(ip, gen, 0, 0, ops).status == "applied"
    metrics, counting = ApiMetrics(), Counting(store)
    request = HitRateRequest([ip], array("Q", PROMPT), BS, None)
    (doc,) = score(request, counting, hasher, metrics, ViewCache(), detail=True)
    assert doc["l1_hit_tokens"] == 150 * BS
    rereads = [
        x
        for x in metrics.render().decode().splitlines()
        if x.startswith("cache_indexer_api_group_rereads_total")
    ]
    assert rereads and float(rereads[0].split()[-1]) == 1
    assert counting.trips == 3  # the stale round, then the fresh view's two


GPTOSS = ((0, "sliding_window", 48), (1, "full_attention", None))
QWEN = ((0, "mamba", None), (1, "full_attention", None))


@pytest.mark.parametrize("shape,block,unit", [(GPTOSS, BS, 0), (QWEN, 64, BS)])
def test_hybrids_equal_the_full_read(
    store: Store, hasher: BlockHasher, shape: Any, block: int, unit: int
) -> None:
    """Random per-group sets (FA a prefix with holes, the others scattered) in L1 and L3
    against the rule run on every flag of the prompt (the full read)."""
    rng = random.Random(block)
    h = unit or block
    chain = _chain(hasher, h)
    m = len(chain)
    specs = [hit_rule.GroupSpec(kind, block, window) for _, kind, window in shape]
    rule = hit_rule.build_rule(specs, h)
    for trial in range(12):
        ip = _ip(trial)
        tiers = []
        for _ in range(2):
            held = {}
            for g, kind, _ in shape:
                if kind == "full_attention":
                    idx = set(range(rng.randint(0, m)))
                    idx -= {rng.randrange(m) for _ in range(rng.randint(0, 3))}
                else:
                    idx = {i for i in range(m) if rng.random() < rng.choice([0.3, 0.9])}
                held[g] = sorted(idx)
            tiers.append(held)
        gen = store.upsert_instance(Instance(ip=ip, uid=f"u-{ip}"))[1]
        ops = TierOps()
        for g, kind, window in shape:
            ops.describe(g, kind, block, window)
            ops.store("l1", [chain[i] for i in tiers[0][g]], group=g)
        ops.settings(unit, 0, 1)
        assert store.apply_batch(ip, gen, 0, 0, ops).status == "applied"
        store.replace_l3(ip, {g: [chain[i] for i in tiers[1][g]] for g, _, _ in shape}, gen=gen)
        store.r.hset(keys.l1_state(ip), "hash_check", "ok")
        views = ViewCache()
        _ask(Counting(store), hasher, [ip], views, PROMPT)
        counting = Counting(store)
        (doc,) = _ask(counting, hasher, [ip], views, PROMPT)
        for tier, held in zip(("l1", "l3"), tiers):
            present = [[int(i in set(held[g])) for i in range(m)] for g, _, _ in shape]
            assert doc[f"{tier}_hit_tokens"] == hit_rule.hit_tokens(rule, len(PROMPT), present), (
                trial,
                tier,
            )
        assert counting.trips <= 2
