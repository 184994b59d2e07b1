"""common.hit_rule against a brute-force oracle of vLLM's rule, over every flag pattern of
small shapes (issue 33): window, chunk and block edges, chunked-local attention when the
search bound is a multiple of the chunk, alignment edges, the partial tail.

The oracle shares nothing with the module but the wire kinds. Each finder is "the largest
length ``L <= bound``, a multiple of the alignment, that the class accepts", found by trying
every ``L`` from ``bound`` down; acceptance is the per-kind condition of the spec
(``vllm-hybrid-kv.md`` §1.4, §1.7's declarative form), index by index:

- full attention: every block before ``L`` held and, if ``L`` ends inside a block (partial
  hits), the hash unit ending at ``L`` held;
- sliding window: the ``ceil((w-1)/B)`` blocks before ``L`` held (fewer when ``L`` is short:
  all of them);
- Mamba: the state at exactly ``L`` held (``L = 0`` always);
- chunked local: the blocks from the bound's chunk start (rounded down to a block) up to
  ``L`` held; ``L`` no shorter than that start (the blocks before it count as computed).

Around the finders, vLLM's coordinator loop (spec §1.3: full-attention classes first and
computed once, the simple-hybrid exit), the alignment and the partial-hit switch (§1.2).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import pytest

from common.hit_rule import GroupSpec, build_rule, hit_tokens

FA_KINDS = {"full_attention", "mla_attention", "sink_full_attention"}
SWA_KINDS = {"sliding_window", "sliding_window_mla"}
SKIPPED = {"cross_attention", "encoder_only_attention"}


class Oracle:
    def __init__(self, specs: Sequence[GroupSpec], h: int, version: tuple[int, int]) -> None:
        self.specs, self.h = list(specs), h
        live = [i for i, g in enumerate(specs) if g.kind not in SKIPPED]
        classes: dict[tuple[object, ...], list[int]] = {}
        for i in live:
            g = specs[i]
            classes.setdefault((g.kind, g.block_size, g.sliding_window, g.chunk), []).append(i)
        fa_first = sorted(classes.values(), key=lambda c: specs[c[0]].kind not in FA_KINDS)
        self.classes = fa_first
        sizes = [specs[i].block_size for i in live]
        partial = (
            len(live) > 1
            and version >= (0, 26)
            and any(specs[i].kind == "mamba" and specs[i].block_size > h for i in live)
            and all(specs[i].block_size == h or specs[i].kind in FA_KINDS | {"mamba"} for i in live)
        )
        self.partial = partial
        self.a = h if partial else math.lcm(*sizes) if sizes else h

    def held(self, flags: list[list[int]], c: list[int], i: int, m: int) -> bool:
        return 0 <= i < m and all(flags[g][i] for g in c)

    def block_held(self, flags: list[list[int]], c: list[int], j: int, m: int) -> bool:
        b = self.specs[c[0]].block_size
        return self.held(flags, c, (j + 1) * b // self.h - 1, m)

    def accepts(self, c: list[int], L: int, bound: int, flags: list[list[int]], m: int) -> bool:
        g, h = self.specs[c[0]], self.h
        b = g.block_size
        if g.kind in FA_KINDS:
            if not all(self.block_held(flags, c, j, m) for j in range(L // b)):
                return False
            return L % b == 0 or (L % h == 0 and self.held(flags, c, L // h - 1, m))
        if L % b:
            return g.kind == "mamba" and L % h == 0 and self.held(flags, c, L // h - 1, m)
        if g.kind in SWA_KINDS:
            assert g.sliding_window is not None
            need = math.ceil((g.sliding_window - 1) / b)
            return all(
                self.block_held(flags, c, j, m) for j in range(max(0, L // b - need), L // b)
            )
        if g.kind == "mamba":
            return L == 0 or self.held(flags, c, L // h - 1, m)
        assert g.kind == "chunked_local_attention" and g.chunk is not None
        start = bound // g.chunk * g.chunk // b
        return L // b >= start and all(
            self.block_held(flags, c, j, m) for j in range(start, L // b)
        )

    def finder(self, c: list[int], bound: int, a: int, flags: list[list[int]], m: int) -> int:
        for L in range(bound, -1, -1):
            if L % a == 0 and self.accepts(c, L, bound, flags, m):
                return L
        return 0

    def hit(self, num_tokens: int, flags: list[list[int]]) -> int:
        m, bound = num_tokens // self.h, max(num_tokens - 1, 0)
        if not self.classes:
            return 0
        if len(self.classes) == 1:  # Unitary: the group's own block size is the alignment
            c = self.classes[0]
            return self.finder(c, bound, self.specs[c[0]].block_size, flags, m)
        is_fa = [self.specs[c[0]].kind in FA_KINDS for c in self.classes]
        fa_hit: dict[int, int] = {}
        L = bound
        while True:
            cur = L
            for n, c in enumerate(self.classes):
                if is_fa[n]:
                    if n not in fa_hit:
                        fa_hit[n] = self.finder(c, cur, self.a, flags, m)
                    cur = min(cur, fa_hit[n])
                else:
                    cur = self.finder(c, cur, self.a, flags, m)
            if cur >= L:
                return L
            L = cur
            if len(self.classes) == 2 and is_fa[0]:
                return L


def _g(kind: str, b: int, w: int | None = None, c: int | None = None) -> GroupSpec:
    return GroupSpec(kind, b, w, c)


# (specs, h, version, longest prompt): every flag of every group, every prompt length up to
# the longest, is tried; about 30,000 cases in all, so the file runs in seconds.
SHAPES: dict[str, tuple[list[GroupSpec], int, tuple[int, int], int]] = {
    # chunked local: bound = N-1 a multiple of the chunk (N = 5, 9) and one block either side
    "fa_chunk4": ([_g("full_attention", 2), _g("chunked_local_attention", 2, c=4)], 2, (0, 34), 11),
    "chunk4_alone": ([_g("chunked_local_attention", 2, c=4)], 2, (0, 34), 17),
    "chunk3_unaligned": (
        [_g("full_attention", 2), _g("chunked_local_attention", 2, c=3)],
        2,
        (0, 34),
        11,
    ),
    "chunk_swa_fa": (
        [
            _g("sliding_window", 2, 5),
            _g("chunked_local_attention", 2, c=4),
            _g("full_attention", 2),
        ],
        2,
        (0, 34),
        7,
    ),
    # sliding window: need 1, 2, 3 blocks; windows ending on alignment edges only (B < a)
    "fa_swa_need2": ([_g("sliding_window", 2, 5), _g("full_attention", 2)], 2, (0, 34), 11),
    "swa_need1_alone": ([_g("sliding_window", 2, 3)], 2, (0, 34), 17),
    "swa_under_lcm": ([_g("full_attention", 4), _g("sliding_window", 2, 3)], 2, (0, 34), 13),
    "swa_need3_lcm6": ([_g("sliding_window", 2, 6), _g("full_attention", 3)], 1, (0, 34), 13),
    "two_swa_classes": (
        [_g("sliding_window", 2, 3), _g("full_attention", 2), _g("sliding_window", 2, 5)],
        2,
        (0, 34),
        7,
    ),
    "swa_pair_one_class": (
        [_g("sliding_window", 2, 5), _g("sliding_window", 2, 5), _g("full_attention", 2)],
        2,
        (0, 34),
        7,
    ),
    # no full-attention class: the window finder sees bounds off the alignment (a = 4)
    "swa_mamba_lcm": ([_g("sliding_window", 2, 3), _g("mamba", 4)], 2, (0, 25), 13),
    "two_swa_lcm": ([_g("sliding_window", 2, 5), _g("sliding_window", 4, 5)], 2, (0, 34), 13),
    "two_swa_off_edges": ([_g("sliding_window", 2, 3), _g("sliding_window", 3, 4)], 1, (0, 34), 13),
    # Mamba: the state at L, with and without partial hits (0.26+), FA partial tails
    "mamba_fa_partial": ([_g("mamba", 4), _g("full_attention", 4)], 2, (0, 34), 11),
    "mamba_fa_no_partial": ([_g("mamba", 4), _g("full_attention", 4)], 2, (0, 25), 13),
    "mamba_fine_fa": ([_g("mamba", 4), _g("full_attention", 2)], 2, (0, 34), 9),
    "mamba_swa_fa": (
        [_g("mamba", 4), _g("sliding_window", 2, 3), _g("full_attention", 2)],
        2,
        (0, 34),
        7,
    ),
    # two full-attention classes (their LCM), and a skipped cross-attention group
    "two_fa": ([_g("mla_attention", 4), _g("full_attention", 2)], 2, (0, 34), 13),
    "fa_cross": ([_g("full_attention", 2), _g("cross_attention", 2)], 2, (0, 34), 9),
}


def _patterns(oracle: Oracle, m: int) -> list[list[list[int]]]:
    """Every combination of the flags the rule may read (each group's block ends; every hash
    unit of a full-attention or Mamba group under partial hits); the others get a fixed
    pattern of 0s and 1s, which a correct rule ignores."""
    h, rows, free = oracle.h, [], []
    for g, spec in enumerate(oracle.specs):
        k = spec.block_size // h
        fine = oracle.partial and (spec.kind in FA_KINDS or spec.kind == "mamba")
        row = [(i * 7 + g * 3) % 5 // 3 for i in range(m)]  # 0,0,0,1,1,...: noise
        for i in range(m):
            if fine or (i + 1) % k == 0:
                free.append((g, i))
        rows.append(row)
    out = []
    for bits in itertools.product((0, 1), repeat=len(free)):
        flags = [list(r) for r in rows]
        for (g, i), bit in zip(free, bits, strict=True):
            flags[g][i] = bit
        out.append(flags)
    return out


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_every_flag_pattern_matches_the_oracle(shape: str) -> None:
    specs, h, version, longest = SHAPES[shape]
    rule = build_rule(specs, h, vllm_version=version)
    oracle = Oracle(specs, h, version)
    assert (rule.partial_hits, rule.alignment) == (oracle.partial, oracle.a)
    checked = 0
    for n in range(longest + 1):
        for flags in _patterns(oracle, n // h):
            want = oracle.hit(n, flags)
            got = hit_tokens(rule, n, flags)
            assert got == want, f"{shape}: N={n} flags={flags}: {got} != oracle {want}"
            checked += 1
    assert checked > 150


def test_the_oracle_is_not_trivial() -> None:
    """The oracle answers differ across patterns where the rules differ (so the comparison
    means something): chunked local ignores blocks before the bound's chunk, and a bound on a
    chunk edge needs no block at all; a window needs only its tail; Mamba only its state."""
    fa_chunk = Oracle(SHAPES["fa_chunk4"][0], 2, (0, 34))
    # N = 9: bound 8 is a chunk edge, so chunked needs nothing; FA holds all 4 blocks
    assert fa_chunk.hit(9, [[1, 1, 1, 1], [0, 0, 0, 0]]) == 8
    # N = 8: bound 7, chunk from token 4: blocks 2 (tokens 4-5) needed, block 3 would end at 8
    assert fa_chunk.hit(8, [[1, 1, 1, 1], [0, 0, 1, 0]]) == 6
    assert fa_chunk.hit(8, [[1, 1, 1, 1], [1, 1, 0, 1]]) == 4
    swa = Oracle(SHAPES["fa_swa_need2"][0], 2, (0, 34))
    assert swa.hit(13, [[0, 0, 0, 1, 1, 0], [1] * 6]) == 10
    assert swa.hit(13, [[1, 0, 0, 0, 1, 0], [1] * 6]) == 2
    mamba = Oracle(SHAPES["mamba_fa_partial"][0], 2, (0, 34))
    assert mamba.partial and mamba.a == 2
    assert mamba.hit(13, [[0, 0, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0]]) == 6
