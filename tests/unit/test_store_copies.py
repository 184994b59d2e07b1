"""The compact L1 layout: a bare set for the common case, a sparse copies hash otherwise.

Runs against fakeredis (with lupa) and a real redis-server, like tests/unit/test_store.py.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest

from common import keys
from common.store import Instance, Store, TierOps

IP = "10.0.0.7"


@pytest.fixture()
def store(any_store: Store) -> Store:
    return any_store


def _register(store: Store, dp_size: int = 1) -> int:
    _, gen = store.upsert_instance(Instance(ip=IP, uid="u", dp_size=dp_size))
    return gen


def test_single_copies_on_rank_0_are_only_set_members(store: Store) -> None:
    gen = _register(store)
    ops = TierOps()
    ops.store("l1", range(1, 1001))
    ops.remove("l1", [5])
    store.apply_batch(IP, gen, 0, 0, ops)
    assert store.r.scard(keys.tier_set(IP)) == 999
    assert not store.r.exists(keys.tier_copies(IP)), "no copies hash in the common case"
    assert store.r.sismember(keys.tier_set(IP), "7")


def test_copies_hash_holds_only_the_exceptions(store: Store) -> None:
    gen = _register(store, dp_size=3)
    ops = TierOps()
    ops.store("l1", [1, 2, 2, 3])
    store.apply_batch(IP, gen, 0, 0, ops)
    ops = TierOps()
    ops.store("l1", [3, 4])
    store.apply_batch(IP, gen, 2, 0, ops)
    raw = {k.decode(): v.decode() for k, v in store.r.hgetall(keys.tier_copies(IP)).items()}
    assert raw == {"2": "2", "3": "1,0,1", "4": "0,0,1"}
    assert store.tier_rank_copies(IP) == {1: [1], 2: [2], 3: [1, 0, 1], 4: [0, 0, 1]}
    ops = TierOps()
    ops.remove("l1", [2, 3])
    store.apply_batch(IP, gen, 0, 1, ops)
    raw = {k.decode(): v.decode() for k, v in store.r.hgetall(keys.tier_copies(IP)).items()}
    assert raw == {"3": "0,0,1", "4": "0,0,1"}, "back to one copy on rank 0: field dropped"
    assert store.tier_counts(IP) == {1: 1, 2: 1, 3: 1, 4: 1}


def test_a_removal_on_the_wrong_rank_is_unknown(store: Store) -> None:
    gen = _register(store, dp_size=2)
    ops = TierOps()
    ops.store("l1", [1])
    store.apply_batch(IP, gen, 0, 0, ops)
    ops = TierOps()
    ops.remove("l1", [1])
    res = store.apply_batch(IP, gen, 1, 0, ops)
    assert res.unknown_removes == 1
    assert store.tier_counts(IP) == {1: 1}


@pytest.mark.parametrize("cleared_rank", [0, 1])
def test_clearing_one_rank_keeps_the_others_copies(store: Store, cleared_rank: int) -> None:
    gen = _register(store, dp_size=2)
    for rank, hashes in ((0, [1, 2, 2, 3]), (1, [3, 4, 4, 5])):
        ops = TierOps()
        ops.store("l1", hashes)
        store.apply_batch(IP, gen, rank, 0, ops)
    ops = TierOps()
    ops.clear("l1")
    res = store.apply_batch(IP, gen, cleared_rank, 1, ops)
    assert res.status == "applied"
    want = {3: [0, 1], 4: [0, 2], 5: [0, 1]} if cleared_rank == 0 else {1: [1], 2: [2], 3: [1]}
    assert store.tier_rank_copies(IP) == want
    assert store.tier_members(IP) == set(want)


def _model_ops(rng: random.Random, truth: list[Counter[int]], rank: int) -> TierOps:
    ops = TierOps()
    for _ in range(rng.randint(1, 4)):
        kind = rng.random()
        if kind < 0.05:
            ops.clear("l1")
            truth[rank].clear()
        elif kind < 0.6:
            hashes = [rng.randint(1, 40) for _ in range(rng.randint(1, 6))]
            ops.store("l1", hashes)
            truth[rank].update(hashes)
        else:
            hashes = [rng.randint(1, 40) for _ in range(rng.randint(1, 6))]
            ops.remove("l1", hashes)
            for h in hashes:
                if truth[rank][h] > 0:
                    truth[rank][h] -= 1
    return ops


def test_random_batches_match_a_per_rank_model(store: Store) -> None:
    """Exact per-rank copies after random stores / removes / clears on three ranks."""
    gen = _register(store, dp_size=3)
    rng = random.Random(7)
    truth: list[Counter[int]] = [Counter(), Counter(), Counter()]
    seqs = [0, 0, 0]
    for _ in range(300):
        rank = rng.choice([0, 0, 1, 2])
        ops = _model_ops(rng, truth, rank)
        assert store.apply_batch(IP, gen, rank, seqs[rank], ops).status == "applied"
        seqs[rank] += 1
    want: dict[int, list[int]] = {}
    for h in range(1, 41):
        per_rank = [truth[r][h] for r in range(3)]
        while per_rank and per_rank[-1] == 0:
            per_rank.pop()
        if per_rank:
            want[h] = per_rank
    assert store.tier_rank_copies(IP) == want
    fields = {int(k) for k in store.r.hkeys(keys.tier_copies(IP))}
    assert fields == {h for h, c in want.items() if c != [1]}, "sparse: exceptions only"


def test_legacy_layout_is_dropped_and_the_generation_moves_on(store: Store) -> None:
    """An index written before the copies hash is re-synced, never trusted, never unfenced."""
    gen = _register(store)
    store.r.sadd(keys.tier_set(IP), "1", "2")
    store.r.hset(keys.tier_counts(IP), mapping={"1": 2, "2": 1})
    store.r.hset(keys.tier_rank_counts(IP, 0), mapping={"1": 2, "2": 1})
    store.r.hset(keys.l1_state(IP), "seq:0", 10)
    ops = TierOps()
    ops.store("l1", [3])
    assert store.apply_batch(IP, gen, 0, 11, ops).status == "stale_gen"
    inst = store.get_instance(IP)
    assert inst is not None and inst.gen > gen
    assert not store.r.exists(keys.tier_set(IP), keys.tier_counts(IP), keys.tier_rank_counts(IP, 0))
    assert list(store.l1_state(IP)) == ["reset_reason"], "the cursor is gone, the reason kept"
    assert store.apply_batch(IP, gen, 0, 0, ops).status == "stale_gen", "old gen stays fenced"
    assert store.apply_batch(IP, inst.gen, 0, 0, ops).status == "applied"
    assert store.tier_counts(IP) == {3: 1}
