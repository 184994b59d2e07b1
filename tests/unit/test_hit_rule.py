"""common.hit_rule against vLLM's own answers (tests/data/hybrid/) and a plain transcription.

Every case of every release file is replayed, with and without probe_indices masking, and the
automatic partial-hit decision is checked against the coordinator's. ``_reference_hit`` is the
pseudo-code of spec §1.7 written out index by index (its own test: it matches every golden
case); Hypothesis compares the module with it on random presence over the golden shapes and
a few small ones, and checks the conservative cases (unknown kind, chunk or window) stay at or
below the exact answer.

Mutants tried by hand on common/hit_rule.py (a copy of the tree, this module's tests only);
every one was killed (at least one test failed), except the one marked equivalent:

- search bound ``num_tokens`` instead of ``num_tokens - 1`` (the N-1 cap);
- class intersection dropped (only a class's first group read);
- sliding-window need ``(w-1)//B`` (floor) instead of the ceiling;
- the a-alignment of a sliding-window run dropped (``r = 1``); the quick window check one
  block off; the search resuming one block too far left after a miss;
- the sliding-window fallback "run from block 0" returning 0;
- FA: no rounding down to ``a``; the partial tail ignoring the block's first hash unit;
  (equivalent: the tail reaching the block's own boundary index, which is always missing
  or past the bound); later passes not trimming to the cached FA hit;
- the simple-hybrid one-pass exit applied to every shape;
- Mamba: a state accepted past the bound; alignment ignored (step 1); a skipped index
  between the right-to-left segments;
- chunked-local scanning from block 0 instead of the bound's chunk, or stopping a block early;
- partial hits from 0.24 (not 0.26); kept on with a coarse SWA group on 0.28+; off instead of
  refused for the 0.26/0.27 excluded shape; on for a single group;
- skipped (cross-attention) groups counted in the LCM;
- an unknown kind under forced partial hits keeping its block size instead of ``h``; an
  unknown kind without its Inexact reason;
- truthy flags other than 1 not normalised;
- probe_indices leaving out the sparse sliding window's leading blocks, or the fine indices
  of a full-attention group under partial hits.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.hit_rule import (
    CHUNKED_LOCAL_KIND,
    FULL_ATTENTION_KINDS,
    MAMBA_KIND,
    NOT_CACHED_KINDS,
    SLIDING_WINDOW_KINDS,
    GroupSpec,
    HitRule,
    Inexact,
    LongestPrefix,
    build_rule,
    hit_tokens,
    prefix_blocks,
    probe_indices,
)

DATA = Path(__file__).resolve().parent.parent / "data" / "hybrid"
RELEASES = (
    "0.22.0",
    "0.23.0",
    "0.24.0",
    "0.25.0",
    "0.26.0",
    "0.27.0",
    "0.28.0",
    "0.30.0",
    "0.32.0",
    "0.34.0",
)
FILES = {rel: json.loads((DATA / f"vectors_{rel}.json").read_text()) for rel in RELEASES}
CASES = [(rel, case) for rel, data in FILES.items() for case in data["cases"]]
PROPERTY = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _version(release: str) -> tuple[int, ...]:
    return tuple(int(p) for p in release.split("."))


def _specs(case: dict[str, Any]) -> list[GroupSpec]:
    return [
        GroupSpec(g["kind"], g["block_size"], g["sliding_window"], g["chunk"])
        for g in sorted(case["groups"], key=lambda g: g["group_idx"])
    ]


def _flags(case: dict[str, Any]) -> list[list[int]]:
    m = case["num_tokens"] // case["hash_block_size"]
    out = [[0] * m for _ in case["groups"]]
    for gid, idx in case["present"].items():
        for i in idx:
            out[int(gid)][i] = 1
    return out


def _masked(rule: Any, num_tokens: int, flags: list[list[int]]) -> list[list[int]]:
    """The flags a caller that probes only probe_indices would pass."""
    out = []
    for g, row in enumerate(flags):
        keep = set(probe_indices(rule, g, num_tokens))
        out.append([f if i in keep else 0 for i, f in enumerate(row)])
    return out


# --- the reference: spec §1.7 transcribed index by index ------------------------------------


class _Reference:
    """Spec §1.7 for groups whose kinds are all known, one index at a time."""

    def __init__(
        self, specs: list[GroupSpec], h: int, partial: bool, num_tokens: int, flags: list[list[int]]
    ) -> None:
        self.specs, self.h, self.flags, self.n = specs, h, flags, num_tokens
        self.m = num_tokens // h
        live = [i for i, g in enumerate(specs) if g.kind not in NOT_CACHED_KINDS]
        self.classes: dict[tuple[Any, ...], list[int]] = {}
        for i in live:
            g = specs[i]
            self.classes.setdefault((g.kind, g.block_size, g.sliding_window, g.chunk), []).append(i)
        sizes = [specs[i].block_size for i in live]
        self.a = h if partial else math.lcm(*sizes) if sizes else h

    def present(self, c: list[int], i: int) -> bool:
        return 0 <= i < self.m and all(i < len(self.flags[g]) and self.flags[g][i] for g in c)

    def fa(self, c: list[int], bound: int, b: int, k: int) -> int:
        j, a = 0, self.a
        while j < bound // b and self.present(c, (j + 1) * k - 1):
            j += 1
        out = j * b
        if a < b:
            for f in range(min(j * k + k - 1, bound // a, self.m) - 1, j * k - 1, -1):
                if self.present(c, f):
                    out = (f + 1) * a
                    break
        return out - out % a

    def swa(self, c: list[int], bound: int, b: int, k: int) -> int:
        w, a = self.specs[c[0]].sliding_window, self.a
        assert w is not None
        need, run = -(-(w - 1) // b), 0
        for i in range(bound // b - 1, -1, -1):
            if self.present(c, (i + 1) * k - 1):
                if run == 0 and b != a and ((i + 1) * b) % a != 0:
                    continue
                run += 1
                if run >= need:
                    return (i + run) * b
            else:
                run = 0
        while b != a and (run * b) % a != 0:
            run -= 1
        return run * b

    def mamba(self, c: list[int], bound: int, b: int, k: int) -> int:
        a = self.a
        if a < b:
            return max(
                [(f + 1) * a for f in range(min(bound // a, self.m)) if self.present(c, f)],
                default=0,
            )
        return max(
            [
                (i + 1) * b
                for i in range(bound // b)
                if self.present(c, (i + 1) * k - 1) and ((i + 1) * b) % a == 0
            ],
            default=0,
        )

    def chunked(self, c: list[int], bound: int, b: int, k: int) -> int:
        chunk = self.specs[c[0]].chunk
        assert chunk is not None
        j = bound // chunk * chunk // b
        while j < bound // b and self.present(c, (j + 1) * k - 1):
            j += 1
        return j * b

    def finder(self, c: list[int], bound: int) -> int:
        g = self.specs[c[0]]
        kind = g.kind or ""
        family = (
            "fa"
            if kind in FULL_ATTENTION_KINDS
            else "swa"
            if kind in SLIDING_WINDOW_KINDS
            else kind
        )
        run = {
            "fa": self.fa,
            "swa": self.swa,
            MAMBA_KIND: self.mamba,
            CHUNKED_LOCAL_KIND: self.chunked,
        }[family]
        return run(c, bound, g.block_size, g.block_size // self.h)

    def hit(self) -> int:
        order = sorted(
            self.classes.values(), key=lambda c: self.specs[c[0]].kind not in FULL_ATTENTION_KINDS
        )
        if self.n <= 1 or not order:
            return 0
        if len(order) == 1:
            self.a = self.specs[order[0][0]].block_size  # Unitary
            return self.finder(order[0], self.n - 1)
        is_fa = [self.specs[c[0]].kind in FULL_ATTENTION_KINDS for c in order]
        hit, fa = self.n - 1, {}
        while True:
            cur = hit
            for n, c in enumerate(order):
                cur = (
                    min(cur, fa.setdefault(n, self.finder(c, cur)))
                    if is_fa[n]
                    else self.finder(c, cur)
                )
            if cur >= hit:
                return hit
            hit = cur
            if len(order) == 2 and is_fa[0]:
                return hit


def _reference_hit(
    specs: list[GroupSpec], h: int, partial: bool, num_tokens: int, flags: list[list[int]]
) -> int:
    return _Reference(specs, h, partial, num_tokens, flags).hit()


# --- golden vectors -----------------------------------------------------------------------


@pytest.mark.parametrize(("release", "case"), CASES, ids=[f"{rel}:{c['name']}" for rel, c in CASES])
def test_golden_case(release: str, case: dict[str, Any]) -> None:
    specs, h, n = _specs(case), case["hash_block_size"], case["num_tokens"]
    rule = build_rule(specs, h, vllm_version=_version(release))
    assert rule.partial_hits == case["partial_hits"]
    live = [s.block_size for s in specs]
    assert rule.alignment == (h if case["partial_hits"] else math.lcm(*live))
    assert rule.inexact == ()
    flags = _flags(case)
    assert hit_tokens(rule, n, flags) == case["hit_tokens"]
    assert hit_tokens(rule, n, _masked(rule, n, flags)) == case["hit_tokens"]
    assert _reference_hit(specs, h, case["partial_hits"], n, flags) == case["hit_tokens"]


def test_golden_files_are_all_there() -> None:
    counts = {rel: len(data["cases"]) for rel, data in FILES.items()}
    assert counts == {
        "0.22.0": 36,
        "0.23.0": 36,
        "0.24.0": 36,
        "0.25.0": 36,
        "0.26.0": 40,
        "0.27.0": 40,
        "0.28.0": 41,
        "0.30.0": 41,
        "0.32.0": 41,
        "0.34.0": 41,
    }
    assert len(CASES) == 388
    answers: dict[str, int] = {}
    for _, case in CASES:  # the README's claim: one name, one answer, in every release
        assert answers.setdefault(case["name"], case["hit_tokens"]) == case["hit_tokens"]
    assert {FILES[r]["vllm"] for r in RELEASES} == set(RELEASES)


MAMBA_SWA_FA = [
    GroupSpec("mamba", 64),
    GroupSpec("sliding_window", 32, 96),
    GroupSpec("full_attention", 16),
]


@pytest.mark.parametrize("release", ["0.26.0", "0.27.0"])
def test_excluded_mamba_swa_shape_raises_where_vllm_asserts(release: str) -> None:
    """0.26/0.27 turn partial hits on for Mamba64+SWA32+FA16 at h=16 and their SWA finder
    asserts on every lookup: no answer exists, so build_rule refuses (ValueError) instead of
    guessing; the caller treats the instance as unusable for the rule (hit 0)."""
    excluded = FILES[release]["excluded_cases"]
    assert [e["name"] for e in excluded] == ["visible-040 mamba64_swa32_fa16 mamba_sparse N=2039"]
    assert "AssertionError" in excluded[0]["why"]
    assert not [c for c in FILES[release]["cases"] if "mamba64_swa32_fa16" in c["name"]]
    later = next(c for c in FILES["0.28.0"]["cases"] if c["name"] == excluded[0]["name"])
    assert _specs(later) == MAMBA_SWA_FA and later["hash_block_size"] == 16
    with pytest.raises(ValueError, match="asserts"):
        build_rule(MAMBA_SWA_FA, 16, vllm_version=_version(release))
    assert not build_rule(MAMBA_SWA_FA, 16, vllm_version=(0, 25)).partial_hits
    rule = build_rule(MAMBA_SWA_FA, 16, vllm_version=(0, 28))
    assert (rule.partial_hits, rule.alignment) == (False, 64)
    forced = build_rule(MAMBA_SWA_FA, 16, partial_hits=False, vllm_version=_version(release))
    assert hit_tokens(forced, later["num_tokens"], _flags(later)) == later["hit_tokens"]
    with pytest.raises(ValueError, match="no vLLM release"):
        build_rule(MAMBA_SWA_FA, 16, partial_hits=True)


# --- shapes for the properties: (specs, h) ------------------------------------------------


def _g(kind: str | None, b: int, w: int | None = None, c: int | None = None) -> GroupSpec:
    return GroupSpec(kind, b, w, c)


SHAPES: dict[str, tuple[list[GroupSpec], int]] = {
    "gptoss": ([_g("sliding_window", 16, 128), _g("full_attention", 16)], 16),
    "gemma3": ([_g("sliding_window", 16, 1024)] * 6 + [_g("full_attention", 16)], 16),
    "gemma4": ([_g("sliding_window", 32, 512), _g("full_attention", 16)], 16),
    "qwen35": ([_g("mamba", 528)] * 3 + [_g("full_attention", 528)], 528),
    "qwen35_pmu16": ([_g("mamba", 528)] * 3 + [_g("full_attention", 528)], 16),
    "kimi_pmu128": ([_g("mamba", 768)] * 3 + [_g("mla_attention", 768)], 128),
    "dsv4": (
        [
            _g("mla_attention", 256),
            _g("sliding_window_mla", 64, 128),
            _g("sliding_window_mla", 64, 128),
            _g("sliding_window_mla", 4, 8),
            _g("sliding_window_mla", 8, 256),
        ],
        4,
    ),
    "fa_2swa": (
        [_g("full_attention", 16), _g("sliding_window", 16, 64), _g("sliding_window", 16, 256)],
        16,
    ),
    "llama4": ([_g(CHUNKED_LOCAL_KIND, 16, c=256)] * 3 + [_g("full_attention", 16)], 16),
    "mamba_swa_fa": (MAMBA_SWA_FA, 16),
    "swa_only": ([_g("sliding_window", 16, 64)], 16),
    # small blocks, so short prompts cross many blocks and every branch is reached
    "mini_partial": ([_g("mamba", 8), _g("full_attention", 8), _g("sliding_window", 2, 5)], 2),
    "mini_two_fa": (
        [
            _g("full_attention", 4),
            _g("mla_attention", 8),
            _g("sliding_window", 4, 7),
            _g("mamba", 8),
        ],
        4,
    ),
    "mini_sparse_swa": (
        [
            _g("full_attention", 24),
            _g("sliding_window", 2, 3),
            _g("sliding_window", 4, 13),
            _g(CHUNKED_LOCAL_KIND, 24, c=40),
        ],
        2,
    ),
    "two_fa": ([_g("mla_attention", 12), _g("full_attention", 4)], 4),
    "mini_mamba_coarse": ([_g("mamba", 6), _g("sink_full_attention", 4), _g("mamba", 6)], 2),
}


def _presence(
    rng: random.Random,
    specs: list[GroupSpec],
    h: int,
    num_tokens: int,
) -> list[list[int]]:
    """Flags as an eviction history leaves them: per spec class a cached prefix with holes,
    sparse states, all, nothing or noise, each member of the class sometimes diverging;
    fine (non-boundary) entries mixed in everywhere."""
    m = num_tokens // h
    cached = rng.randint(0, m)
    base: dict[GroupSpec, list[int]] = {}
    out = []
    for g in specs:
        if g not in base:
            base[g] = _row(rng, g.block_size // h, m, cached)
        row = list(base[g])
        if rng.random() < 0.25:  # this member lost a few more (or got a few)
            for _ in range(rng.randint(1, 3)):
                if m:
                    row[rng.randrange(m)] ^= 1
        out.append(row)
    return out


def _row(rng: random.Random, k: int, m: int, cached: int) -> list[int]:
    mode = rng.choices(["prefix", "full", "sparse", "empty", "noise"], [5, 2, 2, 1, 1])[0]
    keep = rng.choice([1.0, 0.99, 0.95, 0.8, 0.6, 0.4])
    row = [0] * m
    for i in range(m):
        boundary = (i + 1) % k == 0
        if mode == "full":
            row[i] = int(boundary)
        elif mode == "prefix":
            row[i] = int(boundary and i < cached and rng.random() < keep)
        elif mode == "sparse":
            row[i] = int(boundary and rng.random() < 0.15)
        elif mode == "noise":
            row[i] = int(rng.random() < 0.5)
        if not boundary and rng.random() < 0.08:
            row[i] = 1  # a partial tail, or an entry the rule must ignore
    return row


def _draw(seed: int, shape: str) -> tuple[list[GroupSpec], int, int, list[list[int]]]:
    rng = random.Random(seed)
    specs, h = SHAPES[shape]
    biggest = max(
        math.lcm(*(s.block_size for s in specs)), *(s.sliding_window or s.block_size for s in specs)
    )
    num_tokens = rng.choice(
        [
            rng.randint(0, h + 2),
            rng.randint(2, 12 * biggest),
            rng.randint(1, 40) * biggest,
            rng.randint(1, 40) * biggest + 1,
        ]
    )
    return specs, h, num_tokens, _presence(rng, specs, h, num_tokens)


VERSIONS = [(0, 25), (0, 28), (0, 34)]


@PROPERTY
@given(
    seed=st.integers(0, 2**32),
    shape=st.sampled_from(sorted(SHAPES)),
    version=st.sampled_from(VERSIONS),
)
def test_matches_reference_and_masking_changes_nothing(
    seed: int, shape: str, version: tuple[int, ...]
) -> None:
    specs, h, n, flags = _draw(seed, shape)
    rule = build_rule(specs, h, vllm_version=version)
    got = hit_tokens(rule, n, flags)
    assert got == _reference_hit(specs, h, rule.partial_hits, n, flags)
    assert hit_tokens(rule, n, _masked(rule, n, flags)) == got
    assert 0 <= got <= max(n - 1, 0) and got % rule.alignment == 0
    assert hit_tokens(rule, n, [[3 * f for f in row] for row in flags]) == got  # any truthy


@PROPERTY
@given(seed=st.integers(0, 2**32), shape=st.sampled_from(sorted(SHAPES)))
def test_forced_partial_hits_match_reference(seed: int, shape: str) -> None:
    specs, h, n, flags = _draw(seed, shape)
    if (
        any(
            s.kind in SLIDING_WINDOW_KINDS | {CHUNKED_LOCAL_KIND} and s.block_size != h
            for s in specs
        )
        or len(specs) < 2
    ):
        return  # forcing is refused there (see the ValueError tests)
    rule = build_rule(specs, h, partial_hits=True)
    assert rule.partial_hits and rule.alignment == h
    got = hit_tokens(rule, n, flags)
    assert got == _reference_hit(specs, h, True, n, flags)
    assert hit_tokens(rule, n, _masked(rule, n, flags)) == got


def test_full_attention_classes_alone_round_to_the_lcm() -> None:
    """MLA32 + FA16: MLA holds all, FA 3 blocks (48 tokens); the hit is 32, not 48."""
    rule = build_rule([_g("mla_attention", 32), _g("full_attention", 16)], 16)
    assert hit_tokens(rule, 200, [[1] * 12, [1, 1, 1, 0] + [1] * 8]) == 32


def test_sliding_window_run_must_end_on_an_aligned_edge() -> None:
    """SWA4(w7: 2 blocks) beside FA8, so a = 8: windows must end on even blocks. The last
    full window (blocks 5-6) ends on 7; the even edge 6 has block 4 missing; the answer is
    the window of blocks 2-3, ending on edge 4 — right where the search resumes."""
    specs = [_g("sliding_window", 4, 7), _g("full_attention", 8)]
    rule = build_rule(specs, 4)
    assert rule.alignment == 8
    flags = [[1, 1, 1, 1, 0, 1, 1, 0], [1] * 8]
    assert hit_tokens(rule, 33, flags) == 16 == _reference_hit(specs, 4, False, 33, flags)
    flags[0][4] = 1
    assert hit_tokens(rule, 33, flags) == 24 == _reference_hit(specs, 4, False, 33, flags)


@pytest.mark.parametrize(
    ("tail", "states", "hit"),
    [
        ([4], [4], 80),
        ([4, 5], [5], 96),
        ([4, 5], [4], 80),
        ([5], [4], 80),
        ([6], [3, 6], 112),
        ([], [3, 4], 64),
        ([], [4], 0),
    ],
)
def test_full_attention_partial_tail(tail: list[int], states: list[int], hit: int) -> None:
    """Mamba64+FA64 at h=16 (partial hits): FA holds block 0 (index 3) and some hash units
    of block 1 (indices 4-6, its boundary 7 is missing); Mamba has states at ``states``."""
    specs = [_g("mamba", 64), _g("full_attention", 64)]
    rule = build_rule(specs, 16)
    assert rule.partial_hits
    fa = [int(i == 3 or i in tail) for i in range(18)]
    mamba = [int(i in states) for i in range(18)]
    assert (
        hit_tokens(rule, 300, [mamba, fa])
        == hit
        == _reference_hit(specs, 16, True, 300, [mamba, fa])
    )


@pytest.mark.parametrize("state", [0, 87, 88, 89, 342, 343, 344, 598, 599])
def test_mamba_state_found_anywhere_below_the_bound(state: int) -> None:
    specs, h = SHAPES["qwen35_pmu16"]
    n = 600 * h + 1
    row = [0] * 600
    row[state] = 1
    flags = [row, row, row, [1] * 600]
    rule = build_rule(specs, h)
    assert hit_tokens(rule, n, flags) == (state + 1) * h
    assert _reference_hit(specs, h, True, n, flags) == (state + 1) * h


# --- conservative handling ----------------------------------------------------------------


def _degrade(spec: GroupSpec, how: str) -> tuple[GroupSpec, Inexact]:
    if how == "window" and spec.kind in SLIDING_WINDOW_KINDS:
        return GroupSpec(spec.kind, spec.block_size), Inexact.SLIDING_WINDOW_UNKNOWN
    if how == "chunk" and spec.kind == CHUNKED_LOCAL_KIND:
        return GroupSpec(spec.kind, spec.block_size), Inexact.CHUNK_SIZE_UNKNOWN
    kind = {"window": None, "chunk": "unknown"}.get(how, "some_future_kind")
    return GroupSpec(kind, spec.block_size, spec.sliding_window, spec.chunk), Inexact.UNKNOWN_KIND


@PROPERTY
@given(
    seed=st.integers(0, 2**32),
    shape=st.sampled_from(sorted(SHAPES)),
    how=st.sampled_from(["window", "chunk", "kind"]),
    forced=st.booleans(),
    data=st.data(),
)
def test_unknown_rule_is_a_lower_bound(
    seed: int, shape: str, how: str, forced: bool, data: st.DataObject
) -> None:
    specs, h, n, flags = _draw(seed, shape)
    pos = data.draw(st.integers(0, len(specs) - 1))
    degraded, reason = _degrade(specs[pos], how)
    worse = specs[:pos] + [degraded] + specs[pos + 1 :]
    partial: bool | None = None
    if forced:
        partial = build_rule(specs, h).partial_hits  # the truth, as a caller would know it
    exact = build_rule(specs, h, partial_hits=partial)
    rule = build_rule(worse, h, partial_hits=partial)
    assert reason in rule.inexact and rule.effective[pos] == "fa"
    truth = hit_tokens(exact, n, flags)
    assert hit_tokens(rule, n, flags) <= truth
    assert hit_tokens(rule, n, _masked(rule, n, flags)) <= truth


def test_unknown_kind_reasons_effective_and_order() -> None:
    rule = build_rule(
        [
            _g("unknown", 16),
            _g(CHUNKED_LOCAL_KIND, 16),
            _g(None, 16),
            _g("sliding_window_mla", 16),
            _g("cross_attention", 16),
            _g("sliding_window", 16, 32),
            _g("mamba", 16),
            _g("whatever", 16),
        ],
        16,
    )
    assert rule.effective == ("fa", "fa", "fa", "fa", "skip", "swa", "mamba", "fa")
    assert rule.inexact == (
        Inexact.UNKNOWN_KIND,
        Inexact.CHUNK_SIZE_UNKNOWN,
        Inexact.SLIDING_WINDOW_UNKNOWN,
    )
    assert [str(r) for r in rule.inexact] == [
        "unknown_group_kind",
        "chunk_size_unknown",
        "sliding_window_unknown",
    ]
    assert build_rule(SHAPES["llama4"][0], 16).effective == ("chunked",) * 3 + ("fa",)


def test_unknown_mamba_under_forced_partial_hits_needs_every_unit() -> None:
    """Really two Mamba32 groups (one class) and FA32, h = 16, partial hits on. Group 0 holds
    a state at 32 only, group 1 at 16 only: no common state, hit 0. Read as FA with its own
    32-token blocks, group 0 would accept every L <= 32 and the answer would be 16: above
    vLLM. Read as FA at every hash unit, it accepts nothing."""
    n, h = 100, 16
    fa = [1] * 6
    exact = build_rule(
        [_g("mamba", 32), _g("mamba", 32), _g("full_attention", 32)], h, partial_hits=True
    )
    blind = build_rule(
        [_g(None, 32), _g("mamba", 32), _g("full_attention", 32)], h, partial_hits=True
    )
    apart = [[0, 1, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0], fa]
    assert hit_tokens(exact, n, apart) == 0 == hit_tokens(blind, n, apart)
    shared = [[1, 1, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0], fa]
    assert hit_tokens(exact, n, shared) == 16 == hit_tokens(blind, n, shared)
    assert list(probe_indices(blind, 0, n)) == list(range(6))


def test_unknown_kind_with_coarse_block_turns_automatic_partial_hits_off() -> None:
    specs = [_g("mamba", 528), _g(None, 528)]
    assert build_rule(specs, 16).partial_hits is False
    assert build_rule(specs, 16).alignment == 528
    assert build_rule([_g("mamba", 528), _g(None, 16)], 16).partial_hits is True


# --- single group, skipped groups, inputs ----------------------------------------------


@PROPERTY
@given(
    block=st.sampled_from([1, 2, 16, 528]),
    flags=st.lists(st.integers(0, 1), max_size=80),
    extra=st.integers(0, 600),
    kind=st.sampled_from(sorted(FULL_ATTENTION_KINDS)),
)
def test_single_fa_group_is_prefix_blocks_capped(
    block: int, flags: list[int], extra: int, kind: str
) -> None:
    n = len(flags) * block + extra % block if block > 1 else len(flags)
    n = max(n, 0)
    rule = build_rule([GroupSpec(kind, block)], block)
    assert (rule.alignment, rule.partial_hits, rule.inexact) == (block, False, ())
    expected = min(prefix_blocks(flags), max(n - 1, 0) // block) * block
    assert hit_tokens(rule, n, [flags[: n // block]]) == expected
    assert list(probe_indices(rule, 0, n)) == list(range(max(n - 1, 0) // block))


def test_single_fa_group_examples() -> None:
    rule = build_rule([_g("full_attention", 16)], 16, partial_hits=True)
    assert not rule.partial_hits  # Unitary: no partial hits, whatever the caller says
    assert hit_tokens(rule, 640, [[1] * 40]) == 624  # N-1: the last block is recomputed
    assert hit_tokens(rule, 641, [[1] * 40]) == 640
    assert hit_tokens(rule, 641, [[1] * 10 + [0] + [1] * 29]) == 160
    assert hit_tokens(rule, 1, [[1]]) == 0 and hit_tokens(rule, 0, [[]]) == 0
    assert hit_tokens(rule, 641, [[1] * 5]) == 80  # a short row: the rest is absent
    assert hit_tokens(rule, 641, [[True] * 3 + [2] * 3 + [0]]) == 96  # any truthy int
    coarse = build_rule([_g("mla_attention", 32)], 16)  # one group, chain at half a block
    assert coarse.alignment == 32
    assert hit_tokens(coarse, 200, [[0, 1, 0, 1, 1, 0, 0, 1, 0, 1, 0, 1]]) == 64
    assert list(probe_indices(coarse, 0, 200)) == [1, 3, 5, 7, 9, 11]


@PROPERTY
@given(
    block=st.sampled_from([1, 2, 16]),
    flags=st.lists(st.integers(0, 1), min_size=1, max_size=60),
    extra=st.integers(0, 15),
)
def test_longest_prefix_is_the_single_fa_rule_behind_one_interface(
    block: int, flags: list[int], extra: int
) -> None:
    """Both rules answer through HitRule; a lone full-attention group's hybrid rule and the
    longest prefix agree on the tokens, and the ratio counts every held block (the contract)."""
    n = len(flags) * block + extra % block
    prefix: HitRule = LongestPrefix(block)
    hybrid: HitRule = build_rule([GroupSpec("full_attention", block)], block)
    blocks = prefix.answer(n, [flags])
    assert blocks == prefix_blocks(flags) and prefix.limit(blocks) == blocks
    assert list(prefix.probes(0, n)) == list(range(len(flags)))
    tokens, ratio = prefix.hit(blocks, n, block)
    assert tokens == hybrid.answer(n, [flags]) == min(blocks, (n - 1) // block) * block
    assert ratio == blocks / len(flags)
    assert hybrid.hit(tokens, n, block) == (tokens, tokens / (len(flags) * block))
    assert set(hybrid.probes(0, n)) <= set(prefix.probes(0, n))


def test_prefix_blocks() -> None:
    assert prefix_blocks([]) == 0
    assert prefix_blocks([1, 1, 0, 1]) == 2
    assert prefix_blocks([1, 1, 1]) == 3
    assert prefix_blocks([0, 1]) == 0
    assert prefix_blocks([True, 7, False]) == 2


@PROPERTY
@given(
    seed=st.integers(0, 2**32),
    shape=st.sampled_from(sorted(SHAPES)),
    kind=st.sampled_from(sorted(NOT_CACHED_KINDS)),
    where=st.integers(0, 8),
    block=st.sampled_from([1, 3, 7]),
)
def test_not_cached_groups_are_ignored(
    seed: int, shape: str, kind: str, where: int, block: int
) -> None:
    specs, h, n, flags = _draw(seed, shape)
    rule = build_rule(specs, h)
    pos = where % (len(specs) + 1)
    noise = [1 if i % 3 else 0 for i in range(n // h)]
    more = build_rule(specs[:pos] + [_g(kind, block * h)] + specs[pos:], h)
    assert more.effective[pos] == "skip" and more.inexact == rule.inexact
    assert (more.alignment, more.partial_hits) == (rule.alignment, rule.partial_hits)
    assert hit_tokens(more, n, flags[:pos] + [noise] + flags[pos:]) == hit_tokens(rule, n, flags)
    assert len(probe_indices(more, pos, n)) == 0


def test_only_not_cached_groups_hit_nothing() -> None:
    rule = build_rule([_g("cross_attention", 16), _g("encoder_only_attention", 32)], 16)
    assert rule.effective == ("skip", "skip") and not rule.partial_hits
    assert hit_tokens(rule, 1000, [[1] * 62, [1] * 62]) == 0
    assert len(probe_indices(rule, 1, 1000)) == 0
    one = build_rule([_g("cross_attention", 16), _g("mamba", 64), _g("full_attention", 64)], 16)
    assert (one.partial_hits, one.alignment) == (True, 16)  # the cross group is no obstacle


@pytest.mark.parametrize(
    ("groups", "h", "kwargs", "match"),
    [
        ([_g("full_attention", 16)], 0, {}, "hash unit"),
        ([_g("full_attention", 16)], -16, {}, "hash unit"),
        ([], 16, {}, "at least one"),
        ([_g("full_attention", 24), _g("mamba", 16)], 16, {}, "multiple"),
        ([_g("full_attention", 0)], 16, {}, "multiple"),
        ([_g("full_attention", -16)], 16, {}, "multiple"),
        ([_g("cross_attention", 8), _g("full_attention", 16)], 16, {}, "multiple"),
        ([_g("sliding_window", 16, 0), _g("full_attention", 16)], 16, {}, "window/chunk"),
        ([_g(CHUNKED_LOCAL_KIND, 16, c=0), _g("full_attention", 16)], 16, {}, "window/chunk"),
        (
            [_g("sliding_window", 32, 64), _g("mamba", 32)],
            16,
            {"partial_hits": True},
            "no vLLM release",
        ),
        (
            [_g(CHUNKED_LOCAL_KIND, 32, c=64), _g("full_attention", 16)],
            16,
            {"partial_hits": True},
            "no vLLM release",
        ),
        ([_g(CHUNKED_LOCAL_KIND, 16, c=64), _g("full_attention", 32)], 16, {}, "chunked-local"),
        ([_g(CHUNKED_LOCAL_KIND, 16), _g("full_attention", 32)], 16, {}, "chunked-local"),
        (
            [_g("mamba", 64), _g(CHUNKED_LOCAL_KIND, 32, c=64), _g("full_attention", 32)],
            16,
            {"vllm_version": (0, 27, 1)},
            "asserts",
        ),
    ],
)
def test_bad_inputs_raise(
    groups: list[GroupSpec], h: int, kwargs: dict[str, Any], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        build_rule(groups, h, **kwargs)


def test_flag_rows_must_match_the_groups() -> None:
    rule = build_rule(SHAPES["gptoss"][0], 16)
    with pytest.raises(ValueError, match="2 groups"):
        hit_tokens(rule, 100, [[1] * 6])


def test_automatic_partial_hits_follow_vllm() -> None:
    qwen = SHAPES["qwen35_pmu16"][0]
    assert not build_rule(qwen, 16, vllm_version=(0, 25, 9)).partial_hits
    assert build_rule(qwen, 16, vllm_version=(0, 26)).partial_hits
    assert not build_rule(qwen, 528, vllm_version=(0, 34)).partial_hits  # Mamba B == h
    assert not build_rule([_g("full_attention", 32), _g("mla_attention", 64)], 16).partial_hits
    # sliding window at B == h does not block them; at B != h it does (0.28+)
    assert build_rule([_g("mamba", 64), _g("sliding_window", 16, 64)], 16).partial_hits
    assert not build_rule([_g("mamba", 64), _g("sliding_window", 32, 64)], 16).partial_hits


# --- probe_indices ------------------------------------------------------------------------


def test_probe_indices_shapes() -> None:
    n = 4097
    gptoss = build_rule(SHAPES["gptoss"][0], 16)
    assert probe_indices(gptoss, 0, n) == range(0, 256) == probe_indices(gptoss, 1, n)
    qwen = build_rule(SHAPES["qwen35_pmu16"][0], 16)
    assert probe_indices(qwen, 0, n) == range(256) == probe_indices(qwen, 3, n)
    coarse = build_rule(SHAPES["qwen35"][0], 528)
    assert list(probe_indices(coarse, 0, n)) == list(range(7))
    mamba = build_rule(MAMBA_SWA_FA, 16)  # a = 64: states every 4th index, SWA every 2nd
    assert list(probe_indices(mamba, 0, 300)) == [3, 7, 11, 15]
    assert list(probe_indices(mamba, 1, 300)) == [1, 3, 5, 7, 9, 11, 13, 15, 17]
    assert list(probe_indices(mamba, 2, 300)) == list(range(18))
    assert probe_indices(gptoss, 0, 1) == range(0) and probe_indices(gptoss, 0, 16) == range(0)


def test_probe_indices_sparse_window_is_small() -> None:
    """DSV4's SWA-MLA4 (w8: 2 blocks) under a = 256: only the 2 blocks before each 256-token
    edge, plus the first 2, instead of every block."""
    rule = build_rule(SHAPES["dsv4"][0], 4)
    idx = list(probe_indices(rule, 3, 1025))  # h = 4 = B: chain index = block index
    assert idx == [0, 1, 62, 63, 126, 127, 190, 191, 254, 255]
    assert len(probe_indices(rule, 4, 1025)) == 128  # w256/B8 = 32 blocks >= a/B: all of them
