"""A miniature of vLLM's hybrid KV cache: several KV-cache groups sharing one block pool.

What it mimics (spec vllm-hybrid-kv.md §1-§2; vLLM's ``KVCacheCoordinator``, the
single-type managers and ``BlockPool.cache_full_blocks``):

* One pool of physical blocks and one LRU free queue for all groups; each group takes its own
  blocks from it, so an SWA block can evict an FA block. Evicting a block emits
  ``BlockRemoved`` with the *block's* ``group_idx`` and no kind (vLLM stamps kinds on stores
  only), one per copy as the dense model does.
* Look-up: at the start of a step, every request's hit is vLLM's rule
  (:func:`common.hit_rule.hit_tokens`) over the groups' residency; its blocks are what each
  manager returns: every block before the hit (full attention), the ``⌈(w−1)/B⌉`` blocks
  just before it (sliding window; earlier ones are null), the one state at it (Mamba).
* Prefill: chunks of ``prefill_chunk`` tokens (0 = the rest of the prompt at once); with a
  Mamba group the prompt is also split at its last full block, as vLLM's ``align`` mode does
  so that state gets saved. Between chunks the SWA blocks out of the window and the Mamba
  states older than the last one are freed (they keep their hash: still a hit until reused).
* Per chunk and group one ``BlockStored`` (``group_idx``, ``kv_cache_spec_kind``, the window,
  ``block_size``): ``token_ids`` for every newly full block, ``block_hashes`` only for the
  blocks the group caches, so a store may carry ``[]``; ``parent_block_hash`` is the chain
  value of the block before the span (vLLM's ``block_hashes[num_cached - 1]``, whether or not
  this group holds it), null when the span starts at token 0.
  - full attention caches every new full block;
  - sliding window caches only the blocks a later hit can use: vLLM's ``reachable_block_mask``
    at the replay boundary, the ``⌈(w−1)/B⌉`` blocks ending at ``⌊(N−1)/a⌋·a`` for a prompt
    of ``N`` tokens (a = the alignment);
  - Mamba allocates one state block per chunk (the others are null) and caches it when the
    chunk ends on a block boundary.

Not modelled: decode (requests end after their prefill), CPU offload, EAGLE, shared-prefix
junctions (vLLM's second reachable boundary), block sizes that differ between groups, the
per-chunk admission check (a request is admitted when the whole prefill fits).
Pure (no I/O).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from common import hit_rule
from common.blockhash import BlockHasher
from common.events import AllBlocksCleared, BlockRemoved, BlockStored, Event
from services.simulator.cache_model import Request
from services.simulator.shapes import GroupShape, rule_for

Table = list[int | None]  # block id per block index of one group; None = vLLM's null block


@dataclass
class _Alloc:
    request: Request
    hashes: list[int]
    hit: int = 0  # tokens
    tables: list[Table] = field(default_factory=list)
    cached_blocks: int = 0  # vLLM's num_cached_block: full blocks already offered to caching


class HybridCacheModel:
    """The KV-cache groups, blocks and free queue of one hybrid vLLM engine (one DP rank)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        hasher: BlockHasher,
        groups: Sequence[GroupShape],
        prefill_chunk: int = 0,
    ) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        if prefill_chunk < 0 or prefill_chunk % block_size:
            raise ValueError(
                f"prefill chunk {prefill_chunk} is not a multiple of the block size {block_size}"
            )
        self.num_blocks, self.block_size, self.hasher = num_blocks, block_size, hasher
        self.groups, self.prefill_chunk = tuple(groups), prefill_chunk
        self.rule = rule_for(self.groups, block_size)
        self.need = [
            -(-(g.sliding_window - 1) // block_size) if self._swa(gid) and g.sliding_window else 0
            for gid, g in enumerate(self.groups)
        ]
        self.rejected = 0
        self._clear()

    def _clear(self) -> None:
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(self.num_blocks))
        self.block_key: dict[int, tuple[int, int]] = {}  # block → (group, hash)
        self.cached: list[dict[int, list[int]]] = [{} for _ in self.groups]
        self.refs: dict[int, int] = {}

    def _swa(self, gid: int) -> bool:
        return self.groups[gid].kind in hit_rule.SLIDING_WINDOW_KINDS

    def _mamba(self, gid: int) -> bool:
        return self.groups[gid].kind == hit_rule.MAMBA_KIND

    # -- truth ---------------------------------------------------------------------------

    def hashes(self, request: Request) -> list[int]:
        return self.hasher.event_ints(list(request.token_ids), self.block_size, request.cache_salt)

    def group_counts(self) -> list[dict[int, int]]:
        """Per group: hash → physical copies currently cached."""
        return [{h: len(blocks) for h, blocks in group.items()} for group in self.cached]

    def gpu_counts(self) -> dict[int, int]:
        """Group 0's copies (the only group of a dense model; ``ci:{ip}:l1``)."""
        return self.group_counts()[0]

    def cpu_hashes(self) -> set[int]:
        return set()  # no CPU offload for hybrid shapes

    def present(self, hashes: Sequence[int]) -> list[list[int]]:
        """``present[g][i]``: group ``g`` holds block ``i`` of the chain (hit_rule's flags)."""
        return [[int(h in group) for h in hashes] for group in self.cached]

    def hit_tokens(self, request: Request) -> int:
        """vLLM's prefix-cache hit for ``request`` right now, in tokens."""
        hashes = self.hashes(request)
        return hit_rule.hit_tokens(self.rule, len(request.token_ids), self.present(hashes))

    # -- engine steps --------------------------------------------------------------------

    def reset(self) -> list[Event]:
        """``reset_prefix_cache()`` (no request is running between steps)."""
        self._clear()
        return [AllBlocksCleared()]

    def step(self, requests: Sequence[Request]) -> list[Event]:
        """Serve ``requests`` in one engine step; return that step's events in order."""
        allocs = [_Alloc(r, self.hashes(r)) for r in requests]
        for alloc in allocs:  # look-ups see the cache as of the start of the step
            n = len(alloc.request.token_ids)
            alloc.hit = hit_rule.hit_tokens(self.rule, n, self.present(alloc.hashes))
            alloc.tables = self._hit_tables(alloc)
        for alloc in allocs:
            for table in alloc.tables:
                for block in table:
                    if block is not None:
                        self._ref(block)
        events: list[Event] = []
        for alloc in allocs:
            if not self._serve(alloc, events):
                self.rejected += 1
        for alloc in allocs:  # vLLM frees manager by manager, each request's tail first
            for table in alloc.tables:
                for block in reversed(table):
                    if block is not None:
                        self._unref(block)
        return events

    def _hit_tables(self, alloc: _Alloc) -> list[Table]:
        nb = alloc.hit // self.block_size
        tables: list[Table] = []
        for gid, group in enumerate(self.cached):
            if self._mamba(gid):
                real = range(nb - 1, nb) if nb else range(0)
            elif self._swa(gid):
                real = range(max(0, nb - self.need[gid]), nb)
            else:
                real = range(nb)
            table: Table = [None] * nb
            for j in real:
                table[j] = group[alloc.hashes[j]][0]
            tables.append(table)
        return tables

    def _chunks(self, start: int, n: int) -> list[tuple[int, int]]:
        full = n - n % self.block_size
        align = any(self._mamba(g) for g in range(len(self.groups)))
        chunks = []
        while start < n:
            end = min(n, start + self.prefill_chunk) if self.prefill_chunk else n
            if align and start < full < end:
                end = full
            chunks.append((start, end))
            start = end
        return chunks

    def _serve(self, alloc: _Alloc, events: list[Event]) -> bool:
        n, size = len(alloc.request.token_ids), self.block_size
        chunks = self._chunks(alloc.hit, n)
        needed = sum(
            len(chunks) if self._mamba(g) else -(-n // size) - alloc.hit // size
            for g in range(len(self.groups))
        )
        if needed > len(self.free):
            return False
        alloc.cached_blocks = alloc.hit // size
        for start, end in chunks:
            if start > alloc.hit:
                self._free_skipped(alloc, start)
            for gid in range(len(self.groups)):
                self._allocate(alloc, gid, end, events)
            if end // size > alloc.cached_blocks:
                events.extend(
                    self._store(alloc, gid, end // size) for gid in range(len(self.groups))
                )
                alloc.cached_blocks = end // size
        return True

    def _allocate(self, alloc: _Alloc, gid: int, end: int, events: list[Event]) -> None:
        table, want = alloc.tables[gid], -(-end // self.block_size)
        if self._mamba(gid):  # one running-state block per chunk, at the chunk's last block
            table.extend([None] * (want - 1 - len(table)))
            table.append(self._take_free(events))
            return
        while len(table) < want:
            table.append(self._take_free(events))

    def _free_skipped(self, alloc: _Alloc, start: int) -> None:
        """``remove_skipped_blocks`` before a later chunk: blocks no longer attended to."""
        for gid, table in enumerate(alloc.tables):
            if self._swa(gid):
                window = self.groups[gid].sliding_window or 1
                drop = range(max(0, start - window + 1) // self.block_size - 1, -1, -1)
            elif self._mamba(gid):
                drop = range(len(table) - 2, -1, -1)  # every state but the last one
            else:
                continue
            for j in drop:
                block = table[j]
                if block is not None:
                    self._unref(block)
                    table[j] = None

    def _store(self, alloc: _Alloc, gid: int, c1: int) -> BlockStored:
        c0, table, size = alloc.cached_blocks, alloc.tables[gid], self.block_size
        kept = [j for j in range(c0, c1) if table[j] is not None and self._reachable(gid, j, alloc)]
        for j in kept:
            block, h = table[j], alloc.hashes[j]
            assert block is not None
            self.block_key[block] = (gid, h)
            self.cached[gid].setdefault(h, []).append(block)
        salt, group = alloc.request.cache_salt, self.groups[gid]
        return BlockStored(
            block_hashes=[alloc.hashes[j] for j in kept],
            parent_block_hash=alloc.hashes[c0 - 1] if c0 else None,
            token_ids=list(alloc.request.token_ids[c0 * size : c1 * size]),
            block_size=size,
            lora_id=None,
            medium="GPU",
            lora_name=None,
            extra_keys=[[salt] if j == 0 and salt else None for j in kept],
            group_idx=gid,
            kv_cache_spec_kind=group.kind,
            kv_cache_spec_sliding_window=group.sliding_window if self._swa(gid) else None,
        )

    def _reachable(self, gid: int, j: int, alloc: _Alloc) -> bool:
        """vLLM's ``reachable_block_mask``: an SWA block is cached only in the window tail
        before the replay boundary (N − 1, aligned down); every other kind caches its
        non-null blocks."""
        if not self._swa(gid):
            return True
        a = self.rule.alignment
        end = (len(alloc.request.token_ids) - 1) // a * a // self.block_size
        return end - self.need[gid] <= j < end

    # -- the pool ------------------------------------------------------------------------

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
        key = self.block_key.pop(block, None)
        if key is not None:
            gid, h = key
            copies = self.cached[gid][h]
            copies.remove(block)
            if not copies:
                del self.cached[gid][h]
            events.append(BlockRemoved(block_hashes=[h], medium="GPU", group_idx=gid))
        return block
