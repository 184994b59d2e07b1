"""The simulator's prefix-cache model: hits, LRU eviction, duplicate copies, reset."""

from __future__ import annotations

from collections import Counter

from common.blockhash import BlockHasher, HashSettings
from common.events import AllBlocksCleared, BlockRemoved, BlockStored, Event
from services.simulator.cache_model import PrefixCacheModel, Request
from services.simulator.workload import Workload

HASHER = BlockHasher(HashSettings())


def net(events: list[Event]) -> Counter[int]:
    held: Counter[int] = Counter()
    for e in events:
        if isinstance(e, AllBlocksCleared):
            held.clear()
        elif isinstance(e, BlockStored) and e.medium == "GPU":
            held.update(int(h) for h in e.block_hashes)
        elif isinstance(e, BlockRemoved) and e.medium == "GPU":
            held.subtract(int(h) for h in e.block_hashes)
    return +held


def test_prefix_hit_stores_only_new_blocks_with_parent() -> None:
    model = PrefixCacheModel(16, 4, HASHER)
    a = Request(tuple(range(10)))  # 2 full blocks + 2 tokens
    first = model.step([a])
    assert [type(e) for e in first] == [BlockStored]
    b = Request(tuple(range(14)))  # shares 2 blocks, adds 1
    second = model.step([b])
    assert len(second) == 1 and isinstance(second[0], BlockStored)
    assert second[0].parent_block_hash == model.hashes(a)[1]
    assert second[0].block_hashes == model.hashes(b)[2:]
    assert second[0].token_ids == list(range(8, 12))


def test_same_prompt_twice_in_one_step_makes_two_copies() -> None:
    model = PrefixCacheModel(16, 4, HASHER)
    r = Request(tuple(range(9)))
    events = model.step([r, r])
    assert sum(isinstance(e, BlockStored) for e in events) == 2
    assert model.gpu_counts() == {h: 2 for h in model.hashes(r)}


def test_whole_block_prompt_recomputes_its_last_block() -> None:
    model = PrefixCacheModel(16, 4, HASHER)
    r = Request(tuple(range(8)))
    model.step([r])
    again = model.step([r])  # vLLM reuses at most n - 1 blocks: a 2nd copy of the last one
    assert again[0].block_hashes == model.hashes(r)[1:]  # type: ignore[union-attr]
    assert model.gpu_counts()[model.hashes(r)[1]] == 2


def test_lru_eviction_emits_one_remove_per_hash_and_events_replay_to_the_truth() -> None:
    model = PrefixCacheModel(12, 4, HASHER, cpu_blocks=4)
    workload = Workload("mixed", prompts=6, prompt_len=24, block_size=4, seed=3)
    events: list[Event] = []
    for _ in range(60):
        events += model.step([workload.next(), workload.next()])
    removes = [e for e in events if isinstance(e, BlockRemoved) and e.medium == "GPU"]
    assert removes and all(len(e.block_hashes) == 1 for e in removes)
    assert net(events) == Counter(model.gpu_counts())
    assert model.cpu_hashes() and len(model.cpu_hashes()) <= 4
    assert sum(model.gpu_counts().values()) <= 12


def test_reset_clears_everything_and_too_large_requests_are_rejected() -> None:
    model = PrefixCacheModel(4, 4, HASHER)
    model.step([Request(tuple(range(12)))])
    assert model.reset() == [AllBlocksCleared()] and model.gpu_counts() == {}
    assert model.step([Request(tuple(range(40)))]) == [] and model.rejected == 1


def test_stores_carry_each_blocks_extra_keys_like_vllm() -> None:
    """vLLM >= 0.17 publishes one extra-keys entry per hash; the salt is on block 0 only."""
    model = PrefixCacheModel(16, 4, HASHER)
    (first,) = model.step([Request(tuple(range(12)), cache_salt="tenant-a")])
    assert isinstance(first, BlockStored) and first.extra_keys == [["tenant-a"], None, None]
    (plain,) = model.step([Request(tuple(range(100, 108)))])
    assert isinstance(plain, BlockStored) and plain.extra_keys == [None, None]
