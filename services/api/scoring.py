"""Per candidate instance: which sets to read, and its hit by vLLM's rule (L1 and L3).

An instance's KV-cache groups are what the L1 ingester learned from its events
(``ci:{ip}:l1:groups``, :mod:`common.keys`); the L3 poller's ``groups`` field says which
group sets Mooncake holds. :func:`parse_view` turns both into a :class:`View`: a
**single-group** view (no descriptor, or one full-attention-family group 0) reads exactly
what the contract's rule needs — one SMISMEMBER of the request's blocks per tier — and
answers the longest run from block 0 as before; a **hybrid** view reads each group's set
at the positions :func:`common.hit_rule.probe_indices` names and answers
:func:`common.hit_rule.hit_tokens`. Views are cached per instance (:class:`ViewCache`);
every round trip also re-reads the descriptors, and a candidate whose descriptors changed
is read again with its new view in a second round trip (at most one per request).

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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from common import hit_rule, keys
from common.group_view import UNCONFIRMED_UNIT, parse_groups
from common.group_view import lookahead as lookahead_of
from common.hit_rule import Rule
from common.store import Reads

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
        check_unit=not groups.unit_from_config,
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


@dataclass
class Slots:
    """Where one candidate's replies are in the round trip."""

    groups: int
    l3_groups: int
    hash_check: int | None
    l1: list[tuple[int, Sequence[int]]] = field(default_factory=list)
    l3: list[tuple[int, Sequence[int]]] = field(default_factory=list)


class Scorer:
    """The hits of every candidate of one request (see the module docstring)."""

    def __init__(
        self, num_tokens: int, block_size: int, chain: Chain, store: StoreReads | None = None
    ) -> None:
        self.num_tokens, self.block_size, self.chain = num_tokens, block_size, chain
        self.store = store
        self.n = num_tokens // block_size
        self._blobs: dict[tuple[int, int, Any], int] = {}
        self.reads = Reads()

    def fresh(self) -> Scorer:
        """A scorer for a further round trip of the same request (same hash chains)."""
        return Scorer(self.num_tokens, self.block_size, self.chain, self.store)

    def store_execute(self) -> list[Any]:
        assert self.store is not None
        return self.store.execute(self.reads)

    def queue(self, ip: str, view: View, *, descriptors: bool = True) -> Slots:
        """Queue the candidate's reads for ``view`` (and its descriptors, to check it)."""
        r = self.reads
        slots = Slots(
            r.hgetall(keys.l1_groups(ip)) if descriptors else -1,
            r.hget(keys.l3_state(ip), "groups") if descriptors else -1,
            r.hget(keys.l1_state(ip), "hash_check") if view.check_unit else None,
        )
        if view.rule is None:
            blob, idx = self._blob(self.block_size, range(self.n), view.lookahead)
            if len(idx):
                slots.l1.append((r.smismember(keys.tier_set(ip, "l1"), blob), idx))
                if view.l3_groups:
                    slots.l3.append((r.smismember(keys.l3_set(ip), blob), idx))
            return slots
        rule, unit = view.rule, view.rule.hash_unit
        for pos, gid in enumerate(view.l1_groups):
            idx = hit_rule.probe_indices(rule, pos, self.num_tokens)
            if len(idx):
                blob, idx = self._blob(unit, idx, view.lookahead)
            if not len(idx):
                slots.l1.append((-1, idx))
                slots.l3.append((-1, idx))
                continue
            slots.l1.append((r.smismember(keys.tier_group_set(ip, "l1", gid), blob), idx))
            if view.l3_groups:
                slots.l3.append((r.smismember(keys.l3_group_set(ip, gid), blob), idx))
        return slots

    def _blob(self, unit: int, idx: Sequence[int], lookahead: int) -> tuple[int, Sequence[int]]:
        """The members at ``idx`` of the (unit, L) chain, and the indices it has: with L > 0
        the last blocks may have no hash (fewer than L tokens follow them)."""
        if not self.n:
            return -1, range(0)
        members = self.chain(unit, lookahead)
        if isinstance(idx, range):
            idx = range(idx.start, min(idx.stop, len(members)), idx.step)
        else:
            idx = [i for i in idx if i < len(members)]
        if not len(idx):
            return -1, idx
        key = (
            unit,
            lookahead,
            (idx.start, idx.stop, idx.step) if isinstance(idx, range) else tuple(idx),
        )
        found = self._blobs.get(key)
        if found is None:
            picked = (
                members[: len(idx)]
                if isinstance(idx, range) and idx.start == 0 and idx.step == 1
                else [members[i] for i in idx]
            )
            found = self._blobs[key] = self.reads.members(picked)
        return found, idx

    def evaluate(self, view: View, slots: Slots, replies: list[Any]) -> tuple[Hit, Hit]:
        """The (L1, L3) hits of one candidate from its replies."""
        extra: tuple[str, ...] = ()
        if slots.hash_check is not None and replies[slots.hash_check] != "ok":
            extra = (UNCONFIRMED_UNIT,)
        l1 = self._tier(view, slots.l1, replies, view.reasons + extra, bool(view.l1_groups))
        l3 = self._tier(view, slots.l3, replies, view.l3_reasons + extra, bool(view.l3_groups))
        return l1, l3

    def _tier(
        self,
        view: View,
        slots: list[tuple[int, Sequence[int]]],
        replies: list[Any],
        reasons: tuple[str, ...],
        readable: bool,
    ) -> Hit:
        n, size = self.n, self.block_size
        if not n or not readable or not slots:
            return Hit(0, 0.0, reasons)
        if view.rule is None:
            run = _run_length(replies[slots[0][0]])
            if view.block_size and view.block_size != size:
                reasons += (BLOCK_SIZE_DIFFERS,)
            return Hit(min(run, (self.num_tokens - 1) // size) * size, run / n, reasons)
        m = self.num_tokens // view.rule.hash_unit
        present: list[list[int]] = []
        for slot, idx in slots:
            if slot < 0:
                present.append([0] * m)
            elif isinstance(idx, range) and idx.start == 0 and idx.step == 1:
                reply = replies[slot]  # the common case: every index from 0
                present.append(reply + [0] * (m - len(reply)) if len(reply) < m else reply)
            else:
                flags = [0] * m
                for i, f in zip(idx, replies[slot]):
                    flags[i] = f
                present.append(flags)
        tokens = hit_rule.hit_tokens(view.rule, self.num_tokens, present)
        return Hit(tokens, min(tokens, n * size) / (n * size), reasons)


def _run_length(flags: list[int]) -> int:
    try:
        return flags.index(0)
    except ValueError:
        return len(flags)
