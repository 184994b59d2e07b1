"""The read plan's cost, read by read (services/api/read_plan.py; issue 32): the answers are
proven whatever the plan reads, so a plan that reads too much stays correct and only a count
sees it. These pin what each round reads — found open by mutation testing (issue 33); each
test names the wrong versions it kills, applied by hand and seen to fail."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from common import hit_rule
from common.store_reads import encode_members
from services.api import read_plan
from services.api.read_plan import FIRST, PrefixRead, Round, TierRead


def _rounds(
    tier: read_plan.Tier, flags: Sequence[Sequence[int]]
) -> list[list[tuple[int, list[int]]]]:
    """Every round's reads as (group, indices), the store answering from ``flags``."""
    log, first = [], True
    while tier.answer() is None:
        reads = [(g, list(idx)) for g, idx in tier.next_reads(first)]
        first = False
        for g, idx in reads:
            tier.learn(g, idx, [flags[g][i] for i in idx])
        log.append(reads)
        assert len(log) < 5, "the plan does not converge"
    return log


def test_a_single_group_reads_the_first_chunk_once_then_only_up_to_the_first_miss() -> None:
    """2,048 blocks, 20 held: round 1 reads the picks (0..7, 11, 17, 26, …); the first
    sampled miss is 26, so round 2 reads exactly blocks 8..25 — not the first chunk again.
    Kills ``_head`` (how far the picks run on from block 0) starting at ``idx[1]``,
    comparing with ``==`` or ``base - count``."""
    m, run = 2048, 20
    log = _rounds(PrefixRead("k", m, ("c", [])), [[1] * run + [0] * (m - run)])
    picks = list(read_plan._picks(m))
    assert picks[: FIRST + 3] == [*range(FIRST), 11, 17, 26]
    assert log == [[(0, picks)], [(0, list(range(FIRST, 26)))]]


def _two_groups(short: int, m: int, limit: read_plan.Limit | None = None) -> TierRead:
    """A two-group tier: group 0 with ``short`` probes (read whole in round 1 when at most
    WHOLE), group 1 with ``m``; the answer (in chain indices) is the longest prefix both
    accept, group 0 accepting everything past its own probes once it holds them all (a
    monotone rule, as the plan needs)."""

    def solve(flags: list[bytearray]) -> int:
        p0 = hit_rule.prefix_blocks(flags[0][:short])
        return min(hit_rule.prefix_blocks(flags[1]), m if p0 == short else p0)

    return TierRead(
        ["k0", "k1"], [range(short), range(m)], m, solve, limit or (lambda a: a), ("c", [])
    )


@pytest.mark.parametrize("run", [0, 5, 30, 39, 40, 200])
def test_no_group_is_read_twice_below_its_first_chunk_and_no_command_is_empty(run: int) -> None:
    """A group read whole in round 1 is never read again, the first chunk of a longer one
    never again, and no round sends an empty SMISMEMBER (Redis refuses one). Kills round 1
    recording only the first chunk of a group it read whole, and ``stop >= read_to``."""
    m = 300
    tier = _two_groups(40, m)
    log = _rounds(tier, [[1] * 40 + [0] * (m - 40), [1] * run + [0] * (m - run)])
    assert all(idx for rnd in log for _, idx in rnd), log
    later = [(g, idx) for rnd in log[1:] for g, idx in rnd]
    assert not [g for g, _ in later if g == 0], later
    assert all(min(idx) >= FIRST for _, idx in later), later
    assert tier.answer() == min(run, m)


def test_the_safety_net_reads_whatever_is_left_once() -> None:
    """Should round 2 find nothing to read below the bound (here a ``limit`` that claims the
    answer depends on no flag), it reads every probe not read yet — of the groups not read
    whole — and proves the answer; after it nothing is left. Kills the safety net inverted
    (``if out``), run over ``None``, reading a whole group again (``<=``: an empty command),
    queueing ``None``, and leaving ``read_to`` unset."""
    m = 300
    tier = _two_groups(40, m, limit=lambda a: 0)
    flags = [[1] * m, [1] * 100 + [0] * 200]
    log = _rounds(tier, flags)
    assert len(log) == 2
    assert log[1] == [(1, list(range(FIRST, m)))]
    assert tier.answer() == 100
    assert tier.next_reads(False) == []


def test_a_round_that_proves_nothing_is_followed_by_the_rest_once() -> None:
    """A ``limit`` that claims half the bound: round 2 reads below it, proves nothing, and the
    safety net goes on from where round 2 stopped. Kills round 2 not recording how far it
    read (``read_to = None``)."""
    m = 300
    tier = _two_groups(40, m, limit=lambda a: a // 2)
    log = _rounds(tier, [[1] * m, [1] * 100 + [0] * 200])
    assert len(log) == 3 and tier.answer() == 100
    assert [i for rnd in log[1:] for _, idx in rnd for i in idx] == list(range(FIRST, m))


def test_a_long_read_is_split_into_consecutive_pieces_each_member_once() -> None:
    """Kills the split loop stepping by 1 (``range(0, len(idx))``, ``range(0, MAX_MEMBERS)``):
    overlapping pieces, each member read thousands of times."""
    m = 2 * read_plan.MAX_MEMBERS + 17
    members = [b"%d" % i for i in range(m)]
    tier = PrefixRead("k", m, ("c", members))
    rnd = Round()
    rnd.probe(tier, 0, range(m))
    pieces = [rnd.reads.blobs[cmd[2]].members for cmd in rnd.reads.cmds]
    assert [len(p) for p in pieces] == [read_plan.MAX_MEMBERS, read_plan.MAX_MEMBERS, 17]
    assert [x for p in pieces for x in p] == members


def test_candidates_reading_the_same_indices_share_one_encoding() -> None:
    """Members are encoded once per request and index set, whatever the candidates and rounds
    that read them (the module docstring): two candidates, one blob; a later round reuses the
    encoded pieces it is given. Kills the blob cache never hit (``blob = None``,
    ``get(None)``) and the per-request pieces not kept (``_encoded`` always a new dict)."""
    m = 100
    members = [b"m%d" % i for i in range(m)]
    a, b = PrefixRead("ka", m, ("c", members)), PrefixRead("kb", m, ("c", members))
    encoded: dict[object, list[bytes]] = {}
    rnd = Round(encoded)
    for tier in (a, b):
        for g, idx in tier.next_reads(True):
            rnd.probe(tier, g, idx)
    assert len(rnd.reads.cmds) == 2 and len(rnd.reads.blobs) == 1
    rnd2 = Round(encoded)
    rnd2.probe(a, 0, range(0, 10))
    assert len(encoded["c"]) >= 10
    assert rnd2.reads.blobs[0].encoded == encode_members(members[:10])


def test_ranges_of_one_chain_send_exactly_their_members_whatever_was_encoded_before() -> None:
    """The per-chain encoded pieces grow as longer ranges need them; each command still sends
    exactly its own members, in order. Kills the pieces replaced instead of extended
    (``pieces = [...]``: a later, longer range sent other members than it asked about)."""
    m = 40
    members = [b"m%d" % i for i in range(m)]
    tiers = [PrefixRead(f"k{i}", m, ("c", members)) for i in range(3)]
    rnd = Round()
    for tier, idx in zip(tiers, (range(0, 10), range(5, 20), range(3, 40)), strict=True):
        rnd.probe(tier, 0, idx)
    sent = [rnd.reads.blobs[cmd[2]] for cmd in rnd.reads.cmds]
    assert [b.members for b in sent] == [members[0:10], members[5:20], members[3:40]]
    assert [b.encoded for b in sent] == [encode_members(b.members) for b in sent]
