"""A miniature of vLLM's GPU prefix cache (``BlockPool``) that emits the events vLLM would.

* A fixed number of physical blocks; a request needs ``ceil(len(tokens) / block_size)`` of
  them, and only full blocks get a hash (the project's own :class:`~common.blockhash.
  BlockHasher`, so the hashes are vLLM's).
* One :meth:`PrefixCacheModel.step` serves a batch of requests "concurrently": every request
  looks up its cached prefix against the cache as it was when the step began, then
  allocates blocks for the rest. Two requests with the same new prefix in one step therefore
  each store their own physical copy of the same hash — two ``BlockStored`` and, later, two
  ``BlockRemoved``, as vLLM does (spec §3.4).
* Free blocks sit in an LRU queue; a finished request frees its blocks tail-first, and
  reusing a free block that still holds a hash evicts it with one ``BlockRemoved`` per hash.
* Optionally a CPU offload tier: evicted GPU blocks are stored there (``medium="CPU"``) and
  evicted from it in LRU order, to exercise an indexer's medium filtering.
* :meth:`reset` is ``reset_prefix_cache()``: ``AllBlocksCleared``.

The model is pure (no I/O); :meth:`gpu_counts` and :meth:`prefix_len` give the true state.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from common.blockhash import BlockHasher
from common.events import AllBlocksCleared, BlockRemoved, BlockStored, Event, Hash


@dataclass(frozen=True)
class Request:
    token_ids: tuple[int, ...]
    cache_salt: str | None = None


@dataclass
class _Alloc:
    request: Request
    hashes: list[int]
    hits: list[int] = field(default_factory=list)  # block ids of the cached prefix
    blocks: list[int] = field(default_factory=list)  # every block id, in token order


class PrefixCacheModel:
    """GPU blocks, their hashes and the free LRU queue of one vLLM engine (one DP rank)."""

    def __init__(
        self, num_blocks: int, block_size: int, hasher: BlockHasher, cpu_blocks: int = 0
    ) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks, self.block_size, self.hasher = num_blocks, block_size, hasher
        self.cpu_blocks = cpu_blocks
        self.rejected = 0
        self._clear()

    def _clear(self) -> None:
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(self.num_blocks))
        self.block_hash: dict[int, int] = {}
        self.block_tokens: dict[int, tuple[int, ...]] = {}
        self.cached: dict[int, list[int]] = {}
        self.refs: dict[int, int] = {}
        self.cpu: OrderedDict[int, None] = OrderedDict()

    # -- truth ---------------------------------------------------------------------------

    def hashes(self, request: Request) -> list[int]:
        return self.hasher.event_ints(list(request.token_ids), self.block_size, request.cache_salt)

    def gpu_counts(self) -> dict[int, int]:
        """hash → physical GPU copies currently cached."""
        return {h: len(blocks) for h, blocks in self.cached.items()}

    def cpu_hashes(self) -> set[int]:
        return set(self.cpu)

    def prefix_len(self, hashes: Sequence[int]) -> int:
        """How many leading ``hashes`` are cached on GPU right now."""
        for i, h in enumerate(hashes):
            if h not in self.cached:
                return i
        return len(hashes)

    # -- engine steps --------------------------------------------------------------------

    def reset(self) -> list[Event]:
        """``reset_prefix_cache()`` (no request is running between steps): forget every hash."""
        cpu = self.cpu
        self._clear()
        self.cpu = cpu
        return [AllBlocksCleared()]

    def step(self, requests: Sequence[Request]) -> list[Event]:
        """Serve ``requests`` in one engine step; return that step's events in order."""
        allocs = [_Alloc(r, self.hashes(r)) for r in requests]
        for alloc in allocs:  # look-ups see the cache as of the start of the step
            # vLLM always recomputes the last token, so a prompt that is a whole number of
            # blocks reuses at most n - 1 of them and stores a second copy of the last one.
            cap = max(0, (len(alloc.request.token_ids) - 1) // self.block_size)
            n = min(self.prefix_len(alloc.hashes), cap)
            alloc.hits = [self.cached[h][0] for h in alloc.hashes[:n]]
        events: list[Event] = []
        for alloc in allocs:
            for block in alloc.hits:
                self._ref(block)
            alloc.blocks = list(alloc.hits)
        for alloc in allocs:
            if not self._allocate(alloc, events):
                self.rejected += 1
        for alloc in allocs:
            for block in reversed(alloc.blocks):
                self._unref(block)
        return events

    def _allocate(self, alloc: _Alloc, events: list[Event]) -> bool:
        tokens, size = alloc.request.token_ids, self.block_size
        needed = -(-len(tokens) // size) - len(alloc.hits)
        if needed > len(self.free):
            return False
        first_new = len(alloc.hits)
        new_hashes: list[Hash] = []
        for i in range(first_new, first_new + needed):
            block = self._take_free(events)
            alloc.blocks.append(block)
            if i < len(alloc.hashes):
                h = alloc.hashes[i]
                self.block_hash[block] = h
                self.block_tokens[block] = tokens[i * size : (i + 1) * size]
                self.cached.setdefault(h, []).append(block)
                new_hashes.append(h)
        if new_hashes:
            salt = alloc.request.cache_salt
            events.append(
                BlockStored(
                    block_hashes=new_hashes,
                    parent_block_hash=alloc.hashes[first_new - 1] if first_new else None,
                    token_ids=list(tokens[first_new * size : (first_new + len(new_hashes)) * size]),
                    block_size=size,
                    lora_id=None,
                    medium="GPU",
                    lora_name=None,
                    # vLLM >= 0.17 publishes each block's extra keys; the salt (bare string in
                    # every release's event form) is on the block at token 0 only
                    extra_keys=[
                        [salt] if i == 0 and salt else None
                        for i in range(first_new, first_new + len(new_hashes))
                    ],
                    group_idx=0,
                    kv_cache_spec_kind="full_attention",
                )
            )
        return True

    def _ref(self, block: int) -> None:
        self.refs[block] = self.refs.get(block, 0) + 1
        self.free.pop(block, None)

    def _unref(self, block: int) -> None:
        left = self.refs.get(block, 1) - 1
        if left > 0:
            self.refs[block] = left
            return
        self.refs.pop(block, None)
        self.free[block] = None

    def _take_free(self, events: list[Event]) -> int:
        block, _ = self.free.popitem(last=False)
        self._ref(block)
        h = self.block_hash.pop(block, None)
        if h is not None:
            copies = self.cached[h]
            copies.remove(block)
            if not copies:
                del self.cached[h]
            events.append(BlockRemoved(block_hashes=[h], medium="GPU", group_idx=0))
            self._offload(h, self.block_tokens.pop(block), events)
        return block

    def _offload(self, h: int, tokens: tuple[int, ...], events: list[Event]) -> None:
        if self.cpu_blocks <= 0:
            return
        if h in self.cpu:
            self.cpu.move_to_end(h)
            return
        self.cpu[h] = None
        events.append(
            BlockStored(
                block_hashes=[h],
                parent_block_hash=None,
                token_ids=list(tokens),
                block_size=self.block_size,
                medium="CPU",
                group_idx=0,
            )
        )
        if len(self.cpu) > self.cpu_blocks:
            old, _ = self.cpu.popitem(last=False)
            events.append(BlockRemoved(block_hashes=[old], medium="CPU", group_idx=0))
