"""Per candidate instance: which sets to read, and its hit by vLLM's rule (L1 and L3).

An instance's KV-cache groups are what the L1 ingester learned from its events
(``ci:{ip}:l1:groups``, :mod:`common.keys`); the L3 poller's ``groups`` field says which
group sets Mooncake holds. :func:`parse_view` turns both into a :class:`View`: a
**single-group** view (no descriptor, or one full-attention-family group 0) answers by
:class:`common.hit_rule.LongestPrefix` at the request's block size, a **hybrid** one by its
:class:`common.hit_rule.Rule`: both a :class:`common.hit_rule.HitRule`, which says which chain
indices may be read and the answer (tokens and ratio) from them. Which of those are read, round by
round, until the answer is proven: :mod:`services.api.read_plan` (:class:`Scorer` runs the
rounds). Views are cached per instance (:class:`ViewCache`); the first round trip also
re-reads the descriptors, and a candidate whose descriptors changed starts over with its
new view in the next round trip.

**Lookahead.** An instance running EAGLE/MTP speculative decoding on vLLM >= 0.33 hashes each
block with the L tokens after it (spec vllm-extra-keys.md §5): :attr:`View.lookahead` is its L
(learned from its events, else ``blockKey.hashLookaheadTokens``) and its reads, L1 and L3 alike,
use the chain for (unit, L), which has only the blocks L tokens follow; so candidates with
different L in one request each get their own chain, hashed once per distinct L.

An answer is exact or a lower bound, never above what vLLM reuses; :attr:`View.reasons`
says why one is only a lower bound (``docs/design.md``, "KV-cache groups").
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from common.group_view import checks_unit, parse_groups, unit_reasons
from common.group_view import lookahead as lookahead_of
from common.hit_rule import HitRule, LongestPrefix, Rule
from common.store_reads import Reads, group_sets, queue_descriptors, queue_hash_check
from common.tiers import Tier as TierName
from services.api.read_plan import PrefixRead, Round, Tier, TierRead

ChainKey = tuple[int, int]
"""A chain of the prompt: (hash unit, lookahead L)."""
Chain = Callable[[int, int], Sequence[bytes]]
"""(hash unit, lookahead L) → the prompt's member keys at that unit, each block hashed with
the L tokens after it (once per distinct pair and request)."""


class StoreReads(Protocol):
    """What scoring needs of :class:`common.store.Store`: one round trip of queued reads."""

    def execute(self, reads: Reads) -> list[Any]: ...


LOOKAHEAD_SINCE = (0, 33, 0)
"""The first vLLM release that hashes lookahead tokens."""
CACHE_SIZE = 65_536
"""Instances whose view an API worker keeps."""

L3_GROUPS_UNKNOWN = "l3_groups_unknown"
"""Mooncake holds groups the events never described: no rule can be run (answers 0)."""
LOOKAHEAD_BEFORE_0_33 = "lookahead_needs_vllm_0_33"
"""The events show a lookahead L > 0 but ``blockKey.vllmVersion`` is older than 0.33, the
first release that hashes one: the chain cannot be known (answers 0)."""
BLOCK_SIZE_DIFFERS = "request_block_size_differs"
"""A single-group instance whose block size is not the request's: nothing can match."""


@dataclass(frozen=True)
class View:
    """What one API worker knows of an instance's groups; ``raw`` is what it was built
    from (compared with every fresh read)."""

    raw: tuple[tuple[tuple[str, str], ...], str]
    l1_groups: tuple[int, ...] = (0,)
    l3_groups: tuple[int, ...] = (0,)
    rule: Rule | None = None
    """None: single group, the contract's longest-prefix rule."""
    block_size: int = 0
    """The single group's block size as learned (0 = not known yet)."""
    reasons: tuple[str, ...] = ()
    l3_reasons: tuple[str, ...] = ()
    check_unit: bool = False
    """A hybrid whose hash unit is derived: exact only once the self-check verified it."""
    lookahead: int = 0
    """L: the tokens after each block its hashes cover (0 = none)."""


EMPTY = View(raw=((), "0"))


def raw_of(fields: dict[str, str], l3_groups: str | None) -> tuple[Any, str]:
    """What a view is built from, comparable with :attr:`View.raw` (cheap: no parsing)."""
    return tuple(sorted(fields.items())), l3_groups or "0"


def parse_view(
    fields: dict[str, str],
    l3_groups: str | None,
    vllm_version: tuple[int, ...],
    lookahead: int = 0,
) -> View:
    """The view of an instance from its descriptor hash and its l3 ``groups`` field;
    ``lookahead`` is the L of an instance whose events have not shown one."""
    view = _parse_view(fields, l3_groups, vllm_version)
    tokens, _ = lookahead_of(fields, lookahead)
    if tokens and tuple(vllm_version) < LOOKAHEAD_SINCE:
        why = (LOOKAHEAD_BEFORE_0_33,)
        return View(view.raw, l1_groups=(), l3_groups=(), reasons=why, l3_reasons=why)
    return replace(view, lookahead=tokens) if tokens else view


def _parse_view(
    fields: dict[str, str], l3_groups: str | None, vllm_version: tuple[int, ...]
) -> View:
    raw = raw_of(fields, l3_groups)
    l3_ids = tuple(sorted({int(g) for g in raw[1].split(",") if g.isdigit()})) or (0,)
    groups = parse_groups(fields, vllm_version)
    if not groups.hybrid:
        if l3_ids == (0,):
            return View(raw, block_size=groups.hash_unit)
        return View(raw, block_size=groups.hash_unit, l3_groups=(), l3_reasons=(L3_GROUPS_UNKNOWN,))
    if groups.rule is None:
        return View(
            raw, l1_groups=(), l3_groups=(), reasons=groups.reasons, l3_reasons=groups.reasons
        )
    ids = groups.ids
    l3_read, l3_reasons = ids, groups.reasons
    if not set(l3_ids) <= set(ids):
        l3_read, l3_reasons = (), (L3_GROUPS_UNKNOWN,)
    return View(
        raw,
        l1_groups=ids,
        l3_groups=l3_read,
        rule=groups.rule,
        reasons=groups.reasons,
        l3_reasons=l3_reasons,
        check_unit=checks_unit(groups),
    )


class ViewCache:
    """Views by instance, least recently refreshed dropped first (bounded)."""

    def __init__(self, size: int = CACHE_SIZE, lookahead: int = 0) -> None:
        self.size = size
        self._views: OrderedDict[str, View] = OrderedDict()
        self.empty = replace(EMPTY, lookahead=lookahead)
        """An instance with no descriptors: the configured L (``blockKey.hashLookaheadTokens``)."""

    def get(self, ip: str) -> View:
        return self._views.get(ip, self.empty)

    def put(self, ip: str, view: View) -> None:
        self._views[ip] = view
        self._views.move_to_end(ip)
        if len(self._views) > self.size:
            self._views.popitem(last=False)


@dataclass
class Hit:
    """One tier's answer for one instance: tokens, exactness and why not."""

    tokens: int
    ratio: float
    reasons: tuple[str, ...] = ()


class Candidate:
    """One candidate of a request: its view, descriptors as read, and both tiers' reads."""

    __slots__ = ("view", "l1", "l3", "fields", "l3_field", "hash_check", "waiting", "answers")

    def __init__(self, view: View, l1: Tier | None, l3: Tier | None) -> None:
        self.view, self.l1, self.l3 = view, l1, l3
        self.fields: dict[str, str] = {}
        self.l3_field: str | None = None
        self.hash_check: str | None = None
        self.waiting = True
        """Reads queued for the next round trip (no further reads planned until they land)."""
        self.answers: list[int | None] = [None, None]

    @property
    def descriptors(self) -> tuple[dict[str, str], str | None]:
        return self.fields, self.l3_field


class Scorer:
    """The hits of every candidate of one request, read round by round as
    :mod:`services.api.read_plan` plans (see the module docstring)."""

    def __init__(
        self, num_tokens: int, block_size: int, chain: Chain, store: StoreReads | None = None
    ) -> None:
        self.num_tokens, self.block_size, self.chain = num_tokens, block_size, chain
        self.store = store
        self.n = num_tokens // block_size
        self.candidates: dict[str, Candidate] = {}
        self.round_trips = 0
        self._encoded: dict[Hashable, list[bytes]] = {}
        self._chains: dict[ChainKey, tuple[Hashable, Sequence[bytes]]] = {}
        self._round = Round(self._encoded)
        self._prefix = LongestPrefix(block_size)

    def _rule(self, view: View) -> HitRule:
        """The candidate's hit rule: its hybrid rule, else the longest prefix at the
        request's block size."""
        return view.rule if view.rule is not None else self._prefix

    def _chain(self, view: View) -> tuple[Hashable, Sequence[bytes]]:
        """The prompt's member keys as this candidate's sets hold them, with a name that is
        the same for every candidate sharing the chain (hashed once per request): the chain
        of its hash unit and lookahead L (with L > 0 only the blocks L tokens follow)."""
        unit = self._rule(view).hash_unit
        key = (unit, view.lookahead)
        found = self._chains.get(key)
        if found is None:
            found = self._chains[key] = (key, self.chain(unit, view.lookahead))
        return found

    def queue(self, ip: str, view: View, *, descriptors: bool = True) -> Candidate:
        """Queue the candidate's first reads for ``view`` (and its descriptors, to check
        it) in the next round trip; a candidate queued again starts over."""
        c = Candidate(view, self._tier(ip, view, "l1"), self._tier(ip, view, "l3"))
        r = self._round
        if descriptors:
            fields, l3_field = queue_descriptors(r.reads, ip)
            r.field(fields, c, "fields")
            r.field(l3_field, c, "l3_field")
        if view.check_unit:
            r.field(queue_hash_check(r.reads, ip), c, "hash_check")
        for tier in (c.l1, c.l3):
            if tier is not None:
                for g, idx in tier.next_reads(first=True):
                    r.probe(tier, g, idx)
        self.candidates[ip] = c
        return c

    def execute(self) -> None:
        """Send the queued reads in one pipelined round trip and record the replies."""
        rnd, self._round = self._round, Round(self._encoded)
        if rnd.handlers:
            assert self.store is not None
            rnd.deliver(self.store.execute(rnd.reads))
            self.round_trips += 1
        for c in self.candidates.values():
            c.waiting = False

    def finish(self) -> dict[str, tuple[Hit, Hit]]:
        """Round trips until every candidate's answers are proven; their (L1, L3) hits."""
        while True:
            for c in self.candidates.values():
                if not c.waiting:
                    self._plan_next(c)
            if not self._round.handlers:
                break
            self.execute()
        return {ip: self.evaluate(c) for ip, c in self.candidates.items()}

    def _plan_next(self, c: Candidate) -> None:
        for t, tier in enumerate((c.l1, c.l3)):
            if tier is None or c.answers[t] is not None:
                continue
            c.answers[t] = tier.answer()
            if c.answers[t] is None:
                for g, idx in tier.next_reads(first=False):
                    self._round.probe(tier, g, idx)
                c.waiting = True

    def _tier(self, ip: str, view: View, tier: TierName) -> Tier | None:
        readable = view.l1_groups if tier == "l1" else view.l3_groups
        if not self.n or not readable:
            return None
        chain = self._chain(view)
        hashed = len(chain[1])  # with lookahead L > 0 the last blocks have no hash
        if view.rule is None:
            if not min(self.n, hashed):
                return None
            (key,) = group_sets(ip, tier, (0,))
            return PrefixRead(key, min(self.n, hashed), chain)
        rule, num_tokens = view.rule, self.num_tokens
        set_keys = group_sets(ip, tier, view.l1_groups)
        probes: list[Sequence[int]] = [
            _below(rule.probes(pos, num_tokens), hashed) for pos in range(len(set_keys))
        ]
        return TierRead(
            set_keys,
            probes,
            num_tokens // rule.hash_unit,
            lambda flags: rule.answer(num_tokens, flags),
            rule.limit,
            chain,
        )

    def evaluate(self, c: Candidate) -> tuple[Hit, Hit]:
        """The (L1, L3) hits of one candidate from its proven answers."""
        view = c.view
        extra = unit_reasons(view.check_unit, c.hash_check)
        l1 = self._hit(view, c.l1, c.answers[0], view.reasons + extra)
        l3 = self._hit(view, c.l3, c.answers[1], view.l3_reasons + extra)
        return l1, l3

    def _hit(
        self, view: View, tier: Tier | None, answer: int | None, reasons: tuple[str, ...]
    ) -> Hit:
        if tier is None:
            return Hit(0, 0.0, reasons)
        assert answer is not None  # finish() proved every answer
        if view.rule is None and view.block_size and view.block_size != self.block_size:
            reasons += (BLOCK_SIZE_DIFFERS,)
        tokens, ratio = self._rule(view).hit(answer, self.num_tokens, self.block_size)
        return Hit(tokens, ratio, reasons)


def _below(probes: Sequence[int], hashed: int) -> Sequence[int]:
    """The probes the chain has a hash for (the others read as absent)."""
    if isinstance(probes, range):
        return range(probes.start, min(probes.stop, hashed), probes.step)
    return [i for i in probes if i < hashed]


def _set_check(c: Candidate, value: str | None) -> None:
    c.hash_check = value
