"""KV-cache groups in Mooncake keys: each group is its own set, per release of the hybrid
hash (vLLM in-tree, vllm-ascend v0.20.2rc1 concatenation, v0.21–v0.24 grouped sha256 rehash,
v0.25.1rc1+/main last sub-hash), and groups whose hashes are not block hashes are counted,
never indexed."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

import pytest

from common.blockhash import BlockHasher, HashSettings
from services.l3_poller.index import MasterIndex, SegmentMap

HASHER = BlockHasher(HashSettings())
TOKENS = list(range(1, 1 + 16 * 8))
DIGESTS = HASHER.digests(TOKENS, 16)  # hash unit 16: 8 chained blocks
INTS = HASHER.event_ints(TOKENS, 16)
K = 4  # the coarse group's block is 4 hash units (block size 64)
NO_SEGMENTS = SegmentMap([], None)


def rehash(sub: Sequence[bytes]) -> bytes:
    """vllm-ascend v0.21.0rc1–v0.24 ``_rehash_block_hash_group`` (config_data.py)."""
    h = hashlib.sha256(b"vllm-ascend-grouped-block-hash-v1\0")
    h.update(len(sub).to_bytes(4, "big"))
    for s in sub:
        h.update(len(s).to_bytes(4, "big"))
        h.update(s)
    return h.digest()


def coarse_hex(release: str, j: int) -> str:
    """The hex of coarse block ``j`` (hash units ``jK .. jK+K-1``) as ``release`` writes it."""
    sub = DIGESTS[j * K : (j + 1) * K]
    if release == "v0.20.2rc1":
        return b"".join(sub).hex()  # vLLM BlockHashListWithBlockSize: concatenation
    if release == "v0.23.0":
        return rehash(sub).hex()
    return sub[-1].hex()  # v0.25.1rc1+ and main: the last sub-block's hash


def akey(group: int, head: int, hexdigest: str, family: str = "default") -> str:
    return (
        f"M@pcp0@dcp0@head_or_tp_rank:{head}@pp_rank:0@group:{group}@cache_role:kv"
        f"@cache_family:{family}@{hexdigest}"
    )


def hybrid(release: str, swa_tail: bool = False, heads: tuple[int, ...] = (0, 1)) -> list[str]:
    """TP2: full-attention group 0 at every hash unit, a coarse (Mamba-like) group 1 at both
    of its blocks and, with ``swa_tail``, a sliding-window group 2 (fine) at units 6 and 7."""
    keys = [akey(0, r, d.hex()) for d in DIGESTS for r in heads]
    keys += [akey(1, r, coarse_hex(release, j), "c4") for j in (0, 1) for r in heads]
    if swa_tail:
        keys += [akey(2, r, DIGESTS[i].hex()) for i in (6, 7) for r in heads]
    return keys


def poll(index: MasterIndex, keys: Iterable[str]) -> dict[int, set[int]]:
    index.begin(NO_SEGMENTS)
    assert index.feed([k.encode() for k in keys]) == []
    index.commit(0)
    return {g: set(b.pool or ()) for g, b in index.blocks("pool").by_group() if b.pool}


def test_mappable_releases_give_each_group_its_blocks() -> None:
    for release in ("v0.20.2rc1", "main"):
        index = MasterIndex(locate=False)
        assert poll(index, hybrid(release)) == {0: set(INTS), 1: {INTS[3], INTS[7]}}, release
        assert index.stats.unmappable_group == 0 and index.stats.unmappable == []


def test_coarse_group_missing_one_head_is_absent_from_its_group_only() -> None:
    keys = hybrid("main")
    keys.remove(akey(1, 1, coarse_hex("main", 1), "c4"))
    assert poll(MasterIndex(locate=False), keys) == {0: set(INTS), 1: {INTS[3]}}


@pytest.mark.parametrize("heads", [(0, 1), (0,)], ids=["tp2", "tp1"])
def test_rehashed_groups_are_counted_and_never_indexed(heads: tuple[int, ...]) -> None:
    """v0.21–v0.24: group 1's hashes are a rehash. Two groups sharing nothing: which one is
    not a block hash cannot be told, so both are reported and neither is indexed."""
    index = MasterIndex(locate=False)
    keys = hybrid("v0.23.0", heads=heads)
    assert poll(index, keys) == {}
    assert index.stats.unmappable_group == len(keys) == 10 * len(heads)
    assert index.stats.unmappable == [("M", 0), ("M", 1)]
    assert index.blocks("pool").complete == 0
    assert index.blocks("segment").per_ip == {}
    assert index.stats.parsed == len(keys)  # parsed keys: not "unparsed"


def test_one_rehashed_group_among_shared_ones_is_the_only_one_reported() -> None:
    index = MasterIndex(locate=False)
    assert poll(index, hybrid("v0.23.0", swa_tail=True)) == {0: set(INTS), 2: {INTS[6], INTS[7]}}
    assert index.stats.unmappable == [("M", 1)] and index.stats.unmappable_group == 4
    # the next poll of a mappable release: nothing reported any more
    assert poll(index, hybrid("main", swa_tail=True)) == {
        0: set(INTS),
        1: {INTS[3], INTS[7]},
        2: {INTS[6], INTS[7]},
    }
    assert index.stats.unmappable_group == 0


def test_only_layouts_that_may_rehash_are_checked() -> None:
    """vLLM's in-tree connector and one-group layouts always carry block hashes: groups that
    share nothing (e.g. every full-attention key of the tail evicted) are still indexed."""
    vllm = [
        f"M@tp_rank:0@pcp0@dcp0@pp_rank:0@group:{g}@{DIGESTS[i].hex()}"
        for g, i in ((0, 0), (0, 1), (1, 5))
    ]
    index = MasterIndex(locate=False)
    assert poll(index, vllm) == {0: {INTS[0], INTS[1]}, 1: {INTS[5]}}
    assert index.stats.unmappable_group == 0
    c_lw = [
        f"M@pcp0@dcp0@head_or_tp_rank:0@group:{g}@cache_role:kv@cache_family:default"
        f"@{DIGESTS[i].hex()}@0"
        for g, i in ((0, 0), (1, 5))
    ]  # v0.20.2rc1 layer-wise
    assert poll(index, c_lw) == {0: {INTS[0]}, 1: {INTS[5]}}
    assert index.stats.unmappable_group == 0
    one_group = [akey(0, 0, rehash(DIGESTS[:K]).hex())]  # nothing to compare it with
    assert poll(index, one_group) == {0: {int(rehash(DIGESTS[:K])[-8:].hex(), 16)}}
    assert index.stats.unmappable_group == 0


def test_models_are_compared_with_their_own_groups_only() -> None:
    """Another model holding the same block hashes does not make a rehash release's groups
    share anything."""
    other = [k.replace("M@", "Other@", 1) for k in hybrid("main")]
    index = MasterIndex(locate=False)
    got = poll(index, hybrid("v0.23.0") + other)
    assert index.stats.unmappable == [("M", 0), ("M", 1)]
    assert got == {0: set(INTS), 1: {INTS[3], INTS[7]}}  # Other's only
