"""The store's KV-cache groups: one set per group and tier, descriptors learned with the
batch, resets when a descriptor changes or the old layout is found (fakeredis and real Redis,
through the shared ``any_store`` fixture)."""

from __future__ import annotations

import pytest

from common import keys
from common.store import BatchStatus, Instance, Store, TierOps

IP = "10.0.0.7"


@pytest.fixture()
def store(any_store: Store) -> Store:
    return any_store


def _register(store: Store, dp_size: int = 1) -> int:
    return store.upsert_instance(Instance(ip=IP, uid="u", dp_size=dp_size))[1]


def _gemma_batch(hashes: list[int]) -> TierOps:
    """Groups 0 and 1 sliding window (64), group 2 full attention, as vLLM numbers Gemma 3."""
    ops = TierOps()
    for g, kind, window in (
        (0, "sliding_window", 64),
        (1, "sliding_window", 64),
        (2, "full_attention", None),
    ):
        ops.describe(g, kind, 32, window)
        ops.store("l1", hashes if kind == "full_attention" else hashes[-2:], group=g)
    return ops


def test_each_group_has_its_own_set_and_descriptor(store: Store) -> None:
    gen = _register(store)
    ops = _gemma_batch([1, 2, 3, 4])
    ops.settings(0, 0, 1)
    assert store.apply_batch(IP, gen, 0, 0, ops).status is BatchStatus.APPLIED
    assert store.tier_members(IP, "l1", 2) == {1, 2, 3, 4}
    assert store.tier_members(IP, "l1", 0) == store.tier_members(IP, "l1", 1) == {3, 4}
    assert store.tier_members(IP) == {3, 4}  # group 0 is today's key
    assert store.groups(IP) == {
        "0": "sliding_window,32,64,32",
        "1": "sliding_window,32,64,32",
        "2": "full_attention,32,,32",
        "h_cfg": "0",
        "chunk": "0",
        "dp": "1",
    }
    ops = TierOps()
    ops.remove("l1", [3], group=1)
    store.apply_batch(IP, gen, 0, 1, ops)
    assert store.tier_members(IP, "l1", 1) == {4}
    assert store.tier_members(IP, "l1", 0) == {3, 4}


def test_block_sizes_widen_and_a_missing_kind_is_filled(store: Store) -> None:
    gen = _register(store)
    ops = TierOps()
    ops.describe(1, None, 64, None)  # a connector's store: no kind
    ops.describe(1, "full_attention", 128, None)
    ops.describe(1, "full_attention", 16, None)  # a partial entry: block_size = h
    ops.store("l1", [9], group=1)
    assert store.apply_batch(IP, gen, 0, 0, ops).status is BatchStatus.APPLIED
    assert store.groups(IP)["1"] == "full_attention,128,,16"
    ops = TierOps()
    ops.describe(1, None, 32, None)
    store.apply_batch(IP, gen, 0, 1, ops)
    assert store.groups(IP)["1"] == "full_attention,128,,16"


@pytest.mark.parametrize("kind, window", [("mamba", None), ("sliding_window", 128)])
def test_a_changed_descriptor_resets_the_instance(
    store: Store, kind: str, window: int | None
) -> None:
    gen = _register(store)
    store.apply_batch(IP, gen, 0, 0, _gemma_batch([1, 2, 3]))
    store.replace_l3(IP, [1], {"master": "m"}, gen=gen)
    ops = TierOps()
    ops.describe(0, kind, 32, window)
    ops.store("l1", [5], group=0)
    result = store.apply_batch(IP, gen, 0, 1, ops)
    assert result.status is BatchStatus.GROUPS_CHANGED
    new_gen = store.get_instance(IP).gen  # type: ignore[union-attr]
    assert new_gen > gen
    for g in (0, 1, 2):
        assert store.tier_members(IP, "l1", g) == set()
    assert store.groups(IP) == {}
    assert "KV-cache group 0 changed" in store.l1_state(IP)["reset_reason"]
    assert store.l3_members(IP) == {1}  # L3 is the poller's: not the ingester's to drop
    # the re-synced generation starts afresh and learns the new descriptor
    assert store.apply_batch(IP, new_gen, 0, 0, ops).status is BatchStatus.APPLIED
    assert store.groups(IP)["0"].startswith(kind)


def test_the_lookahead_is_kept_and_a_changed_one_resets_the_instance(store: Store) -> None:
    """``la`` is written with the descriptors; the same L again changes nothing; another L in
    the same generation (the engine restarted with another speculative config) resets the
    instance, saying why, and the new generation learns the new L."""
    gen = _register(store)
    ops = TierOps()
    ops.describe(0, "full_attention", 16, None)
    ops.store("l1", [1, 2])
    ops.lookahead(1)
    assert store.apply_batch(IP, gen, 0, 0, ops).status is BatchStatus.APPLIED
    assert store.groups(IP)["la"] == "1"
    again = TierOps()
    again.store("l1", [3])
    again.lookahead(1)
    assert store.apply_batch(IP, gen, 0, 1, again).status is BatchStatus.APPLIED
    assert store.tier_members(IP) == {1, 2, 3}
    other = TierOps()
    other.store("l1", [4])
    other.lookahead(2)
    assert store.apply_batch(IP, gen, 0, 2, other).status is BatchStatus.GROUPS_CHANGED
    new_gen = store.get_instance(IP).gen  # type: ignore[union-attr]
    assert new_gen > gen and store.tier_members(IP) == set() and store.groups(IP) == {}
    reason = store.l1_state(IP)["reset_reason"]
    assert "lookahead changed from 1 to 2 tokens" in reason
    assert store.apply_batch(IP, new_gen, 0, 0, other).status is BatchStatus.APPLIED
    assert store.groups(IP)["la"] == "2" and store.tier_members(IP) == {4}


def test_an_index_in_the_layout_without_groups_is_resynced(store: Store) -> None:
    gen = _register(store)
    store.r.sadd(keys.tier_set(IP, "l1"), 7)  # written by the previous release
    store.r.hset(keys.l1_state(IP), "seq:0", 40)
    result = store.apply_batch(IP, gen, 0, 41, _gemma_batch([1]))
    assert result.status is BatchStatus.STALE_GEN
    assert store.tier_members(IP) == set()
    assert store.get_instance(IP).gen > gen  # type: ignore[union-attr]
    assert "older layout" in store.l1_state(IP)["reset_reason"]


def test_a_store_without_descriptor_is_not_mistaken_for_the_old_layout(store: Store) -> None:
    gen = _register(store)
    ops = TierOps()
    ops.store("l1", [1, 2])
    store.apply_batch(IP, gen, 0, 0, ops)
    assert store.groups(IP) == {"0": "-,0,,0"}
    ops = TierOps()
    ops.store("l1", [3])
    assert store.apply_batch(IP, gen, 0, 1, ops).status is BatchStatus.APPLIED
    assert store.tier_members(IP) == {1, 2, 3}
    restarted = type(store)(store.r)  # an ingester restarted: its Store checks the layout
    ops = TierOps()
    ops.store("l1", [4])
    assert restarted.apply_batch(IP, gen, 0, 2, ops).status is BatchStatus.APPLIED
    assert store.tier_members(IP) == {1, 2, 3, 4}


class _Counted:
    """A registered script that counts its calls."""

    def __init__(self, script: object) -> None:
        self.script, self.calls = script, 0

    def __call__(self, **kw: object) -> object:
        self.calls += 1
        return self.script(**kw)  # type: ignore[operator]


def test_the_layout_is_checked_once_per_instance_and_after_a_refusal(store: Store) -> None:
    """The old-layout check is not on the hot path: one script per instance and Store, run
    again only after a refused write (whoever wrote meanwhile may have left an old layout)."""
    gen = _register(store)
    other = "10.0.0.8"
    other_gen = store.upsert_instance(Instance(ip=other, uid="v"))[1]
    upgrade = _Counted(store._upgrade)
    store._upgrade = upgrade  # type: ignore[method-assign]
    for seq in range(3):
        assert store.apply_batch(IP, gen, 0, seq, _gemma_batch([seq])).status is BatchStatus.APPLIED
    assert upgrade.calls == 1
    store.apply_batch(other, other_gen, 0, 0, _gemma_batch([1]))
    assert upgrade.calls == 2
    assert store.apply_batch(IP, gen, 0, 1, _gemma_batch([9])).status is BatchStatus.DUPLICATE
    assert upgrade.calls == 2
    assert store.apply_batch(IP, gen - 1, 0, 5, TierOps()).status is BatchStatus.STALE_GEN
    store.r.hset(keys.tier_counts(IP), "1", 1)  # an older release wrote meanwhile
    result = store.apply_batch(IP, gen, 0, 5, _gemma_batch([5]))
    assert upgrade.calls == 3
    assert result.status is BatchStatus.STALE_GEN
    assert "older layout" in store.l1_state(IP)["reset_reason"]
    assert store.tier_members(IP, "l1", 2) == set()
    assert store.tier_members(other, "l1", 2) == {1}, "the other instance is untouched"


def test_the_layout_check_leaves_an_unregistered_instance_to_the_fence(store: Store) -> None:
    store.r.sadd(keys.tier_set(IP, "l1"), 7)  # leftovers, no instance hash
    assert store.apply_batch(IP, 1, 0, 0, TierOps()).status is BatchStatus.STALE_GEN
    assert not store.r.exists(keys.instance_meta(IP)), "no instance hash is made up"
    assert store.r.smembers(keys.tier_set(IP, "l1")) == {b"7"}


def test_all_blocks_cleared_and_restarts_clear_every_group(store: Store) -> None:
    gen = _register(store, dp_size=2)
    store.apply_batch(IP, gen, 0, 0, _gemma_batch([1, 2, 3]))
    store.apply_batch(IP, gen, 1, 0, _gemma_batch([1, 2]))  # rank 1 holds copies too
    ops = TierOps()
    ops.clear("l1")
    assert store.apply_batch(IP, gen, 0, 1, ops).status is BatchStatus.APPLIED
    for g in (0, 1, 2):  # rank 0's copies are gone, rank 1's stay
        assert store.tier_rank_copies(IP, "l1", g) == {1: [0, 1], 2: [0, 1]}
    store.apply_batch(IP, gen, 1, 5, TierOps(), reset=True)
    for g in (0, 1, 2):
        assert store.tier_members(IP, "l1", g) == set()
    assert set(store.groups(IP)) == {"0", "1", "2"}  # descriptors of the generation stay


def test_dropping_an_instance_drops_every_group_of_every_tier(store: Store) -> None:
    gen = _register(store)
    ops = _gemma_batch([1, 2])
    ops.describe(1, "sliding_window", 32, 64)
    ops.store("l2", [8], group=1)
    store.apply_batch(IP, gen, 0, 0, ops)
    store.replace_l3(IP, {0: [1], 2: [1, 2]}, {"master": "m"}, gen=gen)
    store.remove_instance(IP)
    assert [
        k for k in store.r.keys("*") if b"{" + IP.encode() + b"}" in k and not k.endswith(b":gen")
    ] == []


def test_replace_l3_writes_and_deletes_group_sets(store: Store) -> None:
    gen = _register(store)
    assert store.replace_l3(IP, {0: [1, 2], 1: [2], 3: [1]}, {"master": "m"}, gen=gen)
    assert (store.l3_members(IP), store.l3_members(IP, 1), store.l3_members(IP, 3)) == (
        {1, 2},
        {2},
        {1},
    )
    assert store.l3_state(IP)["groups"] == "0,1,3"
    assert store.replace_l3(IP, {0: [1], 1: []}, {"master": "m"}, gen=gen)
    assert (store.l3_members(IP), store.l3_members(IP, 1), store.l3_members(IP, 3)) == (
        {1},
        set(),
        set(),
    )
    assert store.l3_state(IP)["groups"] == "0,1"
    assert store.replace_l3(IP, [4])  # a plain iterable is group 0 alone
    assert store.l3_state(IP)["groups"] == "0"
    assert store.l3_members(IP) == {4} and store.l3_members(IP, 1) == set()
    assert not store.replace_l3(IP, {0: [5], 2: [5]}, gen=gen + 1)  # stale: nothing written
    assert store.l3_members(IP) == {4}
    assert not store.r.exists(keys.l3_group_staging(IP, 2), keys.l3_group_staging(IP, 0))
