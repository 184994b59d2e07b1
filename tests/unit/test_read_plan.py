"""The hit-rate read plan (services/api/read_plan.py) without Redis: which probes each round
reads, that every answer it proves equals the full read's (single group and hybrids, holes,
chunk edges), in at most two rounds, and the monotonicity of the rule it rests on."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import pytest

from common import hit_rule
from common.hit_rule import GroupSpec, Rule
from services.api import read_plan
from services.api.read_plan import FIRST, GROWTH, WHOLE, PrefixRead, Tier, TierRead, first_round

SHAPES: dict[str, tuple[list[GroupSpec], int]] = {
    "swa+fa": ([GroupSpec("sliding_window", 16, 48), GroupSpec("full_attention", 16)], 16),
    "swa+fa+mamba": (
        [
            GroupSpec("sliding_window", 16, 48),
            GroupSpec("full_attention", 16),
            GroupSpec("mamba", 16),
        ],
        16,
    ),
    "mamba+fa, partial hits": ([GroupSpec("mamba", 64), GroupSpec("full_attention", 64)], 16),
    "sparse swa (need < a/B)": (
        [GroupSpec("sliding_window", 16, 17), GroupSpec("full_attention", 64)],
        16,
    ),
    "chunked+fa": (
        [GroupSpec("chunked_local_attention", 32, None, 256), GroupSpec("full_attention", 32)],
        32,
    ),
    "unknown kind": ([GroupSpec(None, 16), GroupSpec("mamba", 16)], 16),
}


def _single(m: int, generic: bool = False) -> Tier:
    """The single-group plan (:class:`PrefixRead`), or the generic one with its rule."""
    if not generic:
        return PrefixRead("k", m, ("c", []))

    def run(flags: list[bytearray]) -> int:
        miss = flags[0].find(0)
        return m if miss < 0 else miss

    return TierRead(["k"], [range(m)], m, run, lambda b: b, ("c", []))


def _hybrid(rule: Rule, num_tokens: int) -> TierRead:
    probes = [hit_rule.probe_indices(rule, g, num_tokens) for g in range(len(rule.groups))]
    return TierRead(
        ["k"] * len(probes),
        probes,
        num_tokens // rule.hash_unit,
        lambda flags: hit_rule.hit_tokens(rule, num_tokens, flags),
        lambda tokens: tokens // rule.hash_unit,
        ("c", []),
    )


def _run_plan(tier: Tier, flags: Sequence[Sequence[int]]) -> tuple[int, int, int]:
    """(answer, round trips, flags read), the store answering from ``flags``."""
    rounds, read, answer = 0, 0, None
    first = True
    while answer is None:
        reads = tier.next_reads(first)
        first = False
        rounds += 1
        for g, idx in reads:
            tier.learn(g, idx, [flags[g][i] for i in idx])
            read += len(idx)
        answer = tier.answer()
        assert rounds < 10, "the plan does not converge"
    return answer, rounds, read


def _prefix_with_holes(rng: random.Random, m: int) -> list[int]:
    run = min(m, rng.choice([0, 1, FIRST - 1, FIRST, FIRST + 1, rng.randrange(m + 1), m]))
    flags = [1] * run + [0] * (m - run)
    if rng.random() < 0.5:  # evictions: holes anywhere, blocks after the first miss held
        for _ in range(rng.randrange(1, 6)):
            flags[rng.randrange(m)] = 0
        for i in range(run, m):
            flags[i] = flags[i] or int(rng.random() < 0.5)
    return flags


def test_round_one_reads_the_first_chunk_geometric_samples_and_the_last() -> None:
    n = 2048
    picked = list(first_round(range(n)))
    assert picked[:FIRST] == list(range(FIRST))
    assert picked[-1] == n - 1
    assert picked == sorted(set(picked))
    gaps = [(b + 1) / (a + 1) for a, b in zip(picked[FIRST - 1 :], picked[FIRST:-1])]
    assert all(g <= GROWTH + 0.05 for g in gaps), gaps  # the bound of a hit's overshoot
    assert len(picked) <= FIRST + math.ceil(math.log(n / FIRST, GROWTH)) + 1  # log(blocks)
    short = range(WHOLE)
    assert first_round(short) is short  # a short group: everything, one round trip


@pytest.mark.parametrize("generic", [False, True])
@pytest.mark.parametrize("m", [1, 7, WHOLE, WHOLE + 1, 300, 2048])
def test_single_group_answers_equal_the_full_read_in_two_rounds(m: int, generic: bool) -> None:
    rng = random.Random(m)
    for trial in range(300):
        flags = _prefix_with_holes(rng, m)
        answer, rounds, _ = _run_plan(_single(m, generic), [flags])
        assert answer == hit_rule.prefix_blocks(flags), (trial, flags)
        assert rounds <= (1 if m <= WHOLE else 2)


@pytest.mark.parametrize("generic", [False, True])
@pytest.mark.parametrize("m", [WHOLE + 1, 300, 2048])
def test_every_edge_of_round_one(m: int, generic: bool) -> None:
    """A miss exactly at each position round 1 reads, one before and one after it, and a
    run that ends exactly at the end of the prompt; with and without blocks held after it."""
    picks = read_plan._picks(m)
    for edge in sorted({p + d for p in picks for d in (-1, 0, 1) if 0 <= p + d <= m} | {m}):
        for tail in (0, 1):
            flags = [1] * edge + [tail] * (m - edge)
            if edge < m:
                flags[edge] = 0
            answer, rounds, _ = _run_plan(_single(m, generic), [flags])
            assert answer == edge and rounds <= 2, (edge, tail)


def test_work_grows_with_the_hit_not_the_prompt() -> None:
    m = 2048
    _, rounds, read = _run_plan(_single(m), [[0] * m])
    assert rounds == 1 and read == len(read_plan._picks(m)) < 30
    for run in (100, 700, 1500):
        flags = [1] * run + [0] * (m - run)
        _, rounds, read = _run_plan(_single(m), [flags])
        assert rounds == 2 and read <= GROWTH * (run + 1) + len(read_plan._picks(m)), run


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_hybrid_answers_equal_the_full_read(shape: str) -> None:
    specs, unit = SHAPES[shape]
    rule = hit_rule.build_rule(specs, unit)
    rng = random.Random(shape)
    for trial in range(150):
        num_tokens = rng.choice([unit * 200 + 5, unit * 300, unit * 20 + 1, 64 * 80])
        m = num_tokens // unit
        flags = [_prefix_with_holes(rng, m) for _ in specs]
        for g, spec in enumerate(specs):  # sparse kinds hold scattered blocks
            if spec.kind in ("mamba", "sliding_window") and rng.random() < 0.5:
                flags[g] = [int(rng.random() < 0.3) for _ in range(m)]
        full = hit_rule.hit_tokens(rule, num_tokens, flags)
        answer, rounds, _ = _run_plan(_hybrid(rule, num_tokens), flags)
        assert answer == full, (shape, trial)
        assert rounds <= 2, (shape, trial)


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_the_rule_is_monotone_in_the_flags(shape: str) -> None:
    """What the plan's proof rests on: holding more never shortens the hit."""
    specs, unit = SHAPES[shape]
    rule = hit_rule.build_rule(specs, unit)
    rng = random.Random(shape + "mono")
    num_tokens = unit * 90 + 3
    m = num_tokens // unit
    for _ in range(300):
        flags = [[int(rng.random() < 0.6) for _ in range(m)] for _ in specs]
        before = hit_rule.hit_tokens(rule, num_tokens, flags)
        g, i = rng.randrange(len(specs)), rng.randrange(m)
        flags[g][i] = 1
        assert hit_rule.hit_tokens(rule, num_tokens, flags) >= before


def test_no_command_reads_more_than_max_members() -> None:
    """A long hit is read in pieces of at most MAX_MEMBERS members (no command holds Redis
    long), and the pieces' replies, delivered in order, still prove the exact answer."""
    m = 3 * read_plan.MAX_MEMBERS + 17
    members = [b"%d" % i for i in range(m)]
    for run in (m, m - 5, read_plan.MAX_MEMBERS + 3):
        held = set(members[:run])
        tier = PrefixRead("k", m, ("c", members))
        first = True
        while tier.answer() is None:
            rnd = read_plan.Round()
            for g, idx in tier.next_reads(first):
                rnd.probe(tier, g, idx)
            first = False
            sizes = [len(b.members) for b in rnd.reads.blobs]
            assert max(sizes) <= read_plan.MAX_MEMBERS
            replies = [
                [int(x in held) for x in rnd.reads.blobs[cmd[2]].members] for cmd in rnd.reads.cmds
            ]
            rnd.deliver(replies)
        assert tier.answer() == run
