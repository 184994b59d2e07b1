"""The simulator's hybrid cache model: what each KV-cache group keeps and publishes, as vLLM.

Expected residencies are written out per case from vLLM's managers (spec vllm-hybrid-kv.md
§1.4, §2.1-§2.4), not recomputed with the model's own helpers.
"""

from __future__ import annotations

from collections import Counter

import pytest

from common.blockhash import BlockHasher, HashSettings
from common.events import AllBlocksCleared, BlockRemoved, BlockStored, Event
from services.simulator.cache_model import Request
from services.simulator.hybrid_model import HybridCacheModel
from services.simulator.shapes import SHAPES, shape_groups
from services.simulator.workload import Workload

HASHER = BlockHasher(HashSettings())
B = 16


def model(shape: str, num_blocks: int = 256, chunk: int = 0) -> HybridCacheModel:
    return HybridCacheModel(num_blocks, B, HASHER, shape_groups(shape), prefill_chunk=chunk)


def prompt(n: int, start: int = 1) -> Request:
    return Request(tuple(range(start, start + n)))


def stores(events: list[Event]) -> list[BlockStored]:
    return [e for e in events if isinstance(e, BlockStored)]


def held(m: HybridCacheModel, r: Request) -> list[list[int]]:
    """Per group, the block indices of ``r`` the group holds."""
    hashes = m.hashes(r)
    return [[i for i, h in enumerate(hashes) if h in counts] for counts in m.group_counts()]


def test_shapes_number_groups_as_the_real_engine() -> None:
    kinds = {name: [(g.kind, g.sliding_window) for g in groups] for name, groups in SHAPES.items()}
    assert kinds["gemma3"] == [
        ("sliding_window", 64),
        ("sliding_window", 64),
        ("full_attention", None),
    ]
    assert kinds["qwen3next"] == [("mamba", None), ("full_attention", None)]
    assert kinds["gptoss"] == [("sliding_window", 128), ("full_attention", None)]
    assert kinds["dense"] == [("full_attention", None)]


def test_sliding_window_keeps_only_the_tail_before_the_last_token() -> None:
    """gemma3, w 64, B 16: need = ceil(63/16) = 4 blocks ending at (N-1)//16 = 6."""
    m = model("gemma3")
    r = prompt(100)  # 6 full blocks + 4 tokens
    events = m.step([r])
    assert held(m, r) == [[2, 3, 4, 5], [2, 3, 4, 5], [0, 1, 2, 3, 4, 5]]
    swa0, swa1, fa = stores(events)
    hashes = m.hashes(r)
    for store in (swa0, swa1):
        assert store.block_hashes == hashes[2:6]
        assert store.token_ids == list(r.token_ids[:96])  # every new full block's tokens
        assert store.parent_block_hash is None  # the span starts at token 0
        assert (store.kv_cache_spec_kind, store.kv_cache_spec_sliding_window) == (
            "sliding_window",
            64,
        )
    assert fa.block_hashes == hashes[:6] and fa.kv_cache_spec_sliding_window is None
    assert [s.group_idx for s in (swa0, swa1, fa)] == [0, 1, 2]
    assert {s.block_size for s in (swa0, swa1, fa)} == {B}
    assert m.hit_tokens(r) == 96


def test_a_block_aligned_repeat_stores_no_sliding_window_hash() -> None:
    """N = 64: the tail ends at (64-1)//16 = 3, so block 3 is never kept in the window
    groups; the repeat (hit 48) publishes its tokens with ``block_hashes: []``."""
    m = model("gemma3")
    r = prompt(64)
    m.step([r])
    assert held(m, r)[0] == [0, 1, 2]
    again = stores(m.step([r]))
    assert [(s.block_hashes, len(s.token_ids)) for s in again[:2]] == [([], 16), ([], 16)]
    assert again[2].block_hashes == [m.hashes(r)[3]]  # full attention: a second copy
    assert all(s.parent_block_hash == m.hashes(r)[2] for s in again)


def test_after_a_prefix_hit_the_parent_is_the_chain_value_before_the_span() -> None:
    """vLLM's ``block_hashes[num_cached - 1]``: on a window group even when it is not kept."""
    m = model("gemma3")
    first = prompt(200)  # 12 full blocks; window groups keep 8..11
    m.step([first])
    longer = prompt(260)  # hit: FA 12 blocks, window tail 8..11 present → 192 tokens
    assert m.hit_tokens(longer) == 192
    swa0, _, fa = stores(m.step([longer]))
    hashes = m.hashes(longer)
    assert swa0.parent_block_hash == fa.parent_block_hash == hashes[11]
    assert swa0.token_ids == list(longer.token_ids[192:256])
    assert swa0.block_hashes == hashes[12:16]  # (260-1)//16 = 16: blocks 12..15 kept
    assert held(m, longer)[0] == [8, 9, 10, 11, 12, 13, 14, 15]


def test_a_shared_prefix_without_its_window_tail_is_no_hit() -> None:
    """The full-attention prefix is there, but the window groups kept another prompt's
    tail: vLLM's hit is 0 although a full-attention-only index says 4 blocks."""
    m = model("gemma3")
    m.step([prompt(150)])
    other = Request(tuple(range(1, 65)) + tuple(range(5000, 5100)))  # shares 4 blocks
    assert held(m, other)[2] == [0, 1, 2, 3]
    assert m.hit_tokens(other) == 0


def test_mamba_keeps_one_state_per_prefill_chunk() -> None:
    m = model("qwen3next")
    r = prompt(100)
    mamba, fa = stores(m.step([r]))
    hashes = m.hashes(r)
    assert (mamba.group_idx, mamba.kv_cache_spec_kind) == (0, "mamba")
    assert mamba.block_hashes == [hashes[5]] and mamba.token_ids == list(r.token_ids[:96])
    assert mamba.kv_cache_spec_sliding_window is None and mamba.parent_block_hash is None
    assert (fa.group_idx, fa.block_hashes) == (1, hashes[:6])
    assert m.hit_tokens(r) == 96  # the state at 96 = (100-1)//16*16

    chunked = model("qwen3next", chunk=32)
    events = chunked.step([r])
    assert held(chunked, r) == [[1, 3, 5], [0, 1, 2, 3, 4, 5]]
    assert [(s.group_idx, len(s.block_hashes), len(s.token_ids)) for s in stores(events)] == [
        (0, 1, 32),
        (1, 2, 32),
    ] * 3  # one store per group per chunk, group order
    assert stores(events)[2].parent_block_hash == hashes[1]


def test_mamba_needs_the_state_exactly_at_the_hit() -> None:
    """A block-aligned prompt saves its state at N; a repeat can reuse at most N-1 tokens,
    which needs the state at N-16: none, so vLLM recomputes everything."""
    m = model("qwen3next")
    r = prompt(64)
    m.step([r])
    assert held(m, r) == [[3], [0, 1, 2, 3]]
    assert m.hit_tokens(r) == 0
    longer = prompt(90)  # the state at 64 serves a longer prompt
    assert m.hit_tokens(longer) == 64


def test_same_position_same_hash_in_every_group() -> None:
    m = model("gptoss")  # w 128: need 8 ≥ the prompt's blocks, so both keep everything
    r = prompt(100)
    swa, fa = stores(m.step([r]))
    assert swa.block_hashes == fa.block_hashes == m.hashes(r)
    assert swa.kv_cache_spec_sliding_window == 128


def test_eviction_removes_per_group_with_group_idx_and_class_members_differ() -> None:
    """A pool exactly one gemma3 prompt big (7 blocks × 3 groups). vLLM frees manager by
    manager, tail first, so the next allocation evicts group 0's blocks first: then group 0
    lacks block 5 that group 1 still has, and the window class needs both."""
    m = model("gemma3", num_blocks=21)
    r = prompt(100)
    m.step([r])
    assert m.hit_tokens(r) == 96
    events = m.step([prompt(20, start=9000)])  # 2 blocks per group: 6 evictions
    removes = [e for e in events if isinstance(e, BlockRemoved)]
    hashes = m.hashes(r)
    assert [(e.group_idx, e.block_hashes) for e in removes] == [
        (0, [hashes[5]]),
        (0, [hashes[4]]),
        (0, [hashes[3]]),
        (0, [hashes[2]]),
    ]
    assert all(e.medium == "GPU" for e in removes)
    assert held(m, r) == [[], [2, 3, 4, 5], [0, 1, 2, 3, 4, 5]]
    assert m.hit_tokens(r) == 0


@pytest.mark.parametrize("shape", ["gemma3", "qwen3next", "gptoss"])
@pytest.mark.parametrize("chunk", [0, 32])
def test_events_replay_to_each_groups_truth(shape: str, chunk: int) -> None:
    m = model(shape, num_blocks=60, chunk=chunk)
    workload = Workload("mixed", prompts=8, prompt_len=120, block_size=B, seed=4)
    net: list[Counter[int]] = [Counter() for _ in m.groups]
    removed = 0
    for i in range(150):
        if i == 100:
            assert m.reset() == [AllBlocksCleared()] and m.group_counts() == [{}] * len(net)
            net = [Counter() for _ in m.groups]
        for e in m.step([workload.next(), workload.next()]):
            if isinstance(e, BlockStored):
                assert e.group_idx is not None and e.kv_cache_spec_kind is not None
                net[e.group_idx].update(int(h) for h in e.block_hashes)
            elif isinstance(e, BlockRemoved):
                assert e.group_idx is not None and len(e.block_hashes) == 1
                net[e.group_idx].subtract(int(h) for h in e.block_hashes)
                removed += 1
    assert removed, "the pool must be small enough to evict"
    assert [+c for c in net] == [Counter(c) for c in m.group_counts()]
    assert sum(sum(c.values()) for c in m.group_counts()) <= 60


def test_too_large_requests_are_rejected_and_chunks_must_be_whole_blocks() -> None:
    m = model("qwen3next", num_blocks=4)
    assert m.step([prompt(100)]) == [] and m.rejected == 1
    with pytest.raises(ValueError, match="multiple of the block size"):
        model("gemma3", chunk=24)


def test_salt_extra_key_is_on_block_0_only_where_it_is_kept() -> None:
    m = model("gemma3")
    r = Request(tuple(range(1, 101)), cache_salt="tenant-a")
    swa, _, fa = stores(m.step([r]))
    assert fa.extra_keys == [["tenant-a"]] + [None] * 5
    assert swa.extra_keys == [None] * 4  # block 0 is not kept in the window group
    longer = Request(tuple(range(1, 141)), cache_salt="tenant-a")  # hit 96: from block 6
    assert [s.extra_keys for s in stores(m.step([longer]))] == [[None, None]] * 3


def test_older_mamba_states_are_freed_while_the_prefill_goes_on() -> None:
    """vLLM frees the state of two chunks ago as a chunked prefill advances, so those states
    reach the LRU queue before the request's own blocks and are evicted first. Pool: exactly
    the prompt's 4 Mamba blocks (states 1, 3, 5, the partial 6) and 7 full-attention ones."""
    m = model("qwen3next", num_blocks=11, chunk=32)
    r = prompt(100)
    m.step([r])
    assert held(m, r) == [[1, 3, 5], [0, 1, 2, 3, 4, 5]]
    events = m.step([prompt(20, start=9000)])  # 2 chunks: 2 Mamba + 2 FA blocks
    hashes = m.hashes(r)
    assert [(e.group_idx, e.block_hashes) for e in events if isinstance(e, BlockRemoved)] == [
        (0, [hashes[1]]),
        (0, [hashes[3]]),
        (0, [hashes[5]]),
    ]
