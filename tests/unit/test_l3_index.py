"""MasterIndex: completeness rule, scopes, what gets (re-)located, memory per key."""

from __future__ import annotations

import tracemalloc
from collections.abc import Mapping

from common.blockhash import BlockHasher, HashSettings
from services.l3_poller.index import Blocks, MasterIndex, SegmentMap

HASHER = BlockHasher(HashSettings())
DIGESTS = HASHER.digests(list(range(1, 1 + 16 * 6)), 16)  # 6 chained blocks
INTS = HASHER.event_ints(list(range(1, 1 + 16 * 6)), 16)
SEGS = SegmentMap(
    ["10.0.0.1:12300", "10.0.0.2:12300"],
    {"10.0.0.1:15000": "10.0.0.1:12300", "10.0.0.2:15000": "10.0.0.2:12300"},
)
A, B = "10.0.0.1:15000", "10.0.0.2:15000"


def key(block: int, tp: int = 0, group: int = 0, model: str = "Qwen") -> bytes:
    return (
        f"{model}@tp_rank:{tp}@pcp0@dcp0@pp_rank:0@group:{group}@{DIGESTS[block].hex()}"
    ).encode()


def sets(blocks: Blocks) -> dict[str, set[int]]:
    return {ip: set(hashes) for ip, hashes in blocks.per_ip.items()}


def poll(
    index: MasterIndex,
    where: Mapping[bytes, tuple[str, ...]],
    segs: SegmentMap = SEGS,
    extra: tuple[bytes, ...] = (),
    now: float = 0.0,
) -> list[bytes]:
    """One poll over ``where`` (key → endpoints) plus unparsable lines; returns keys located."""
    index.begin(segs)
    asked = []
    for line, ck in index.feed([*where, *extra]):
        asked.append(line)
        index.located(ck, where[line])
    index.commit(now)
    return asked


def test_single_rank_segment_scope_and_junk() -> None:
    index = MasterIndex()
    where = {key(0): (A,), key(1): (B,), key(2): (A, B), key(3): ()}
    asked = poll(index, where, extra=(b"other-tenant-key", b"lmcache@1@0@abc@bf16"))
    assert sorted(asked) == sorted(where)
    assert index.stats.seen == 6 and index.stats.parsed == 4
    assert index.stats.skipped["unparsed"] == 2
    blocks = index.blocks("segment")
    assert sets(blocks) == {"10.0.0.1": {INTS[0], INTS[2]}, "10.0.0.2": {INTS[1], INTS[2]}}
    assert blocks.complete == 4  # the disk-only block is complete but on no segment


def test_pool_scope_needs_no_locations() -> None:
    index = MasterIndex(locate=False)
    asked = poll(index, {key(0): (A,), key(1): (B,)})
    assert asked == []
    blocks = index.blocks("pool")
    assert blocks.per_ip == {} and blocks.complete == 2
    assert sorted(blocks.pool or ()) == sorted([INTS[0], INTS[1]])


def test_tp2_block_with_a_missing_rank_is_not_counted() -> None:
    index = MasterIndex()
    where = {key(b, tp): (A if tp == 0 else B,) for b in range(4) for tp in (0, 1)}
    del where[key(2, 1)]  # block 2 lost its rank-1 shard
    poll(index, where)
    blocks = index.blocks("segment")
    complete = {INTS[0], INTS[1], INTS[3]}
    # segment: complete AND at least one of its keys has a replica on the instance
    assert sets(blocks) == {"10.0.0.1": complete, "10.0.0.2": complete}
    assert blocks.complete == 3
    pool = MasterIndex(locate=False)
    poll(pool, where)
    assert set(pool.blocks("pool").pool or ()) == complete


def test_a_namespace_that_vanishes_whole_is_still_required_for_a_while() -> None:
    """Rank 1's pod died and took every rank-1 key: rank-0 keys alone are not loadable."""
    index = MasterIndex(ns_memory=60)
    both = {key(b, tp): (A if tp == 0 else B,) for b in range(3) for tp in (0, 1)}
    poll(index, both, now=100)
    assert index.blocks("segment").complete == 3
    rank0 = {k: v for k, v in both.items() if b"tp_rank:0" in k}
    poll(index, rank0, now=150)
    assert sets(index.blocks("segment")) == {}
    poll(index, rank0, now=161)  # forgotten after ns_memory: judged by what is left
    assert sets(index.blocks("segment")) == {"10.0.0.1": set(INTS[:3])}


def group_sets(blocks: Blocks) -> dict[int, dict[str, set[int]]]:
    return {g: sets(b) for g, b in blocks.by_group()}


def test_groups_are_separate_sets_and_models_are_judged_separately() -> None:
    """A hybrid's sliding-window group 1 stores only tails (blocks 2 and 5); full-attention
    group 0 every block. Completeness over the TP ranks is judged within each group."""
    index = MasterIndex()
    where = {key(b, tp, group=0): (A,) for b in range(6) for tp in (0, 1)}
    where |= {key(b, tp, group=1): (A,) for b in (2, 5) for tp in (0, 1)}
    del where[key(5, 1, group=1)]  # block 5 lost its rank-1 key in group 1 only
    del where[key(3, 1, group=0)]  # block 3 lost its rank-1 key in group 0 only
    where[key(4, model="Other")] = (B,)  # another model with one namespace
    poll(index, where)
    blocks = index.blocks("segment")
    g0 = {INTS[b] for b in (0, 1, 2, 4, 5)}
    assert group_sets(blocks) == {
        0: {"10.0.0.1": g0, "10.0.0.2": {INTS[4]}},
        1: {"10.0.0.1": {INTS[2]}},
    }
    assert blocks.complete == 5 + 1 + 1 and blocks.groups[1].complete == 1
    pool = MasterIndex(locate=False)
    poll(pool, where)
    result = pool.blocks("pool")
    assert set(result.pool or ()) == g0 and set(result.groups[1].pool or ()) == {INTS[2]}
    assert result.complete == 7


def test_old_rule_group_as_dimension_is_gone() -> None:
    """The rule this replaces: every group seen was needed at every block. Group 1 holding a
    single block must not empty group 0."""
    index = MasterIndex(locate=False)
    poll(index, {**{key(b): () for b in range(4)}, key(3, group=1): ()})
    result = index.blocks("pool")
    assert set(result.pool or ()) == set(INTS[:4])
    assert set(result.groups[1].pool or ()) == {INTS[3]}


def test_single_group_results_have_no_group_entries() -> None:
    """vLLM 0.21 keys (no ``@group:``) are group 0, the same namespace as ``@group:0``."""
    old = f"Qwen@tp_rank:0@pcp0@dcp0@pp_rank:0@{DIGESTS[1].hex()}".encode()
    index = MasterIndex()
    poll(index, {key(0): (A,), old: (A,), key(1, tp=1): (A,)})
    blocks = index.blocks("segment")
    assert blocks.groups == {} and sets(blocks) == {"10.0.0.1": {INTS[1]}}
    assert len(index._unit_group) == 1


def test_located_keys_are_not_queried_again_until_their_segment_goes() -> None:
    index = MasterIndex()
    where = {key(0): (A,), key(1): (B,), key(2): (B,)}
    assert len(poll(index, where)) == 3
    assert poll(index, where) == []  # steady state: nothing re-queried
    where[key(3)] = (A,)
    assert poll(index, where) == [key(3)]  # only the new key
    # segment B goes away: its keys vanish from the master too (or, if still listed,
    # are located again); A's keys are kept as they are.
    only_a = SegmentMap(["10.0.0.1:12300"], {A: "10.0.0.1:12300"})
    still = {key(0): (A,), key(1): (A,), key(3): (A,)}  # key 1 was re-replicated on A
    assert poll(index, still, only_a) == [key(1)]
    assert sets(index.blocks("segment")) == {"10.0.0.1": {INTS[0], INTS[1], INTS[3]}}


def test_vanished_keys_are_gone_after_the_next_poll() -> None:
    index = MasterIndex()
    poll(index, {key(0): (A,), key(1): (A,)})
    index.begin(SEGS)
    [(_, ck)] = index.feed([key(2)])
    index.located(ck, None)  # listed, then gone before it was located
    index.commit()
    assert sets(index.blocks("segment")) == {}
    assert index.keys == {}


def test_abort_keeps_the_previous_poll() -> None:
    index = MasterIndex()
    poll(index, {key(0): (A,)})
    index.begin(SEGS)
    index.feed([key(1)])
    index.abort()
    assert sets(index.blocks("segment")) == {"10.0.0.1": {INTS[0]}}


def test_unknown_endpoint_is_flagged_for_a_segment_refresh() -> None:
    index = MasterIndex()
    index.begin(SEGS)
    [(_, ck)] = index.feed([key(0)])
    index.located(ck, ("10.0.0.3:15000",))
    assert index.unresolved
    index.remap(SegmentMap([*SEGS.names, "10.0.0.3:12300"], None))
    index.commit()
    assert sets(index.blocks("segment")) == {"10.0.0.3": {INTS[0]}}


def test_unquotable_keys_are_counted_not_queried() -> None:
    index = MasterIndex()
    bad = b"my model@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@" + DIGESTS[0].hex().encode()
    assert poll(index, {bad: (A,)}) == []
    assert index.stats.skipped["unquotable"] == 1


def test_memory_per_key_is_small() -> None:
    n = 50_000
    lines = [
        f"M@tp_rank:{i % 2}@pcp0@dcp0@pp_rank:0@group:0@{i // 2:064x}".encode() for i in range(n)
    ]
    index = MasterIndex()
    tracemalloc.start()
    try:
        index.begin(SEGS)
        for i, (_, ck) in enumerate(index.feed(lines)):
            index.located(ck, (A,) if i % 3 else (B,))
        index.commit()
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert held / n < 150, f"{held / n:.0f} bytes per key"
    assert index.blocks("segment").complete == n // 2


def test_location_table_is_compacted_when_endpoints_churn() -> None:
    """Pods come and go with new ports: unused interned locations are dropped."""
    index = MasterIndex()
    lines = [f"M@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@{i:064x}".encode() for i in range(1100)]
    many = SegmentMap([f"10.0.1.{i % 250}:{12300 + i}" for i in range(1100)], None)
    index.begin(many)
    for i, (_, ck) in enumerate(index.feed(lines)):
        index.located(ck, (f"10.0.1.{i % 250}:{15000 + i}",))
    index.commit()
    assert len(index._locs) == 1102
    index.begin(SEGS)
    for i, (_, ck) in enumerate(index.feed(lines[:10])):
        index.located(ck, (A,) if i % 2 else (B,))
    index.commit()
    assert len(index._locs) == 4  # UNLOCATED, (), A, B
    odd, even = {i for i in range(10) if i % 2}, {i for i in range(10) if not i % 2}
    assert sets(index.blocks("segment")) == {"10.0.0.1": odd, "10.0.0.2": even}
    assert poll(index, {line: (A,) for line in lines[:10]}) == []  # ids survived compaction


def test_results_are_sorted_so_equal_content_has_equal_digests() -> None:
    """The writer skips a set whose digest did not change: listing order must not matter."""
    where = {key(b, tp): (A if b % 2 else B,) for b in range(6) for tp in (0, 1)}
    first, second = MasterIndex(), MasterIndex()
    poll(first, where)
    poll(second, dict(reversed(list(where.items()))))
    for scope in ("segment", "pool"):
        one, two = first.blocks(scope), second.blocks(scope)
        for ip in (None, "10.0.0.1", "10.0.0.2"):
            assert one.digest(ip) == two.digest(ip)
    assert list(first.blocks("pool").pool or ()) == sorted(INTS[:6])
    assert first.blocks("segment").digest("10.0.0.1") != first.blocks("segment").digest(None)
