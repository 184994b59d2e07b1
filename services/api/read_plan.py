"""Which set members the hit-rate read asks Redis about, round by round, and when it may stop.

An answer depends on one candidate tier's membership flags at the chain indices its rule may
read (the *probes*: every block for a single-group instance,
:func:`common.hit_rule.probe_indices` per group for a hybrid). Reading them all costs Redis
candidates × tiers × prompt blocks look-ups, although most candidates hold nothing or a
short prefix. Instead each group's flags are kept twice: ``lo`` with every unread probe
taken as absent and ``hi`` with every unread probe taken as present. The rule is monotone in
the flags (holding more never shortens a hit: it is the longest length every class
accepts), so ``solve(lo) <= true answer <= solve(hi)``; when the two agree the answer is
proven and nothing more is read.

- **Round 1** reads, per group, the first :data:`FIRST` probes and samples at positions
  ``FIRST·GROWTH^k − 1`` and the last (a group of at most :data:`WHOLE` probes is read
  whole). A candidate that misses in the first chunk (most of them) is settled here; a
  sampled miss bounds a longer hit from above.
- **Round 2** reads, for the unsettled, every probe below the bound that ``solve(hi)``
  gives (``limit``: a hit of length L depends only on flags below L). After it ``lo`` and
  ``hi`` agree (everything ``hi``'s answer depends on is known), so a question costs two
  round trips at most; a later round, which reads whatever is left, is only a safety net.

Redis work per candidate tier: ``FIRST`` + log(blocks) look-ups, plus about ``GROWTH`` ×
its hit when it holds more than the first chunk (a hole in the middle of a longer prefix
makes that the blocks up to the first sampled miss: never more than a full read).
A single-group tier keeps its flags as two numbers (:class:`PrefixRead`), a hybrid's as
byte arrays run through :func:`common.hit_rule.hit_tokens` (:class:`TierRead`). Reads go
through :class:`common.store_reads.Reads` (members encoded once per request and index set, shared
by every candidate that reads the same indices of the same chain; commands of at most
:data:`MAX_MEMBERS` members).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Hashable, Sequence
from functools import lru_cache
from typing import Any

from common.store_reads import Reads

FIRST = 8
"""Probes per group and tier that round 1 reads from the start."""
WHOLE = 64
"""A group with at most this many probes is read whole in round 1 (one round trip)."""
GROWTH = 1.5
"""Ratio between round 1's sampled positions beyond the first chunk."""
MAX_MEMBERS = 4096
"""Members per SMISMEMBER at most: a longer read is split, so no one command holds Redis
(single-threaded) for more than about a millisecond whatever the prompt's length."""

Solve = Callable[[list[bytearray]], int]
"""Per-group flags (one byte per chain index) → the answer (blocks or tokens)."""
Limit = Callable[[int], int]
"""An answer → the chain index below which every flag it depends on lies."""


def first_round(probes: Sequence[int]) -> Sequence[int]:
    """The probes round 1 reads: all of a short group, else the first chunk and samples."""
    n = len(probes)
    if n <= WHOLE:
        return probes
    if isinstance(probes, range):
        return _first_of_range(probes.start, probes.stop, probes.step)
    return [probes[i] for i in _picks(n)]


@lru_cache(maxsize=256)
def _first_of_range(start: int, stop: int, step: int) -> tuple[int, ...]:
    probes = range(start, stop, step)
    return tuple(probes[i] for i in _picks(len(probes)))


@lru_cache(maxsize=256)
def _picks(n: int) -> tuple[int, ...]:
    """Positions round 1 reads among ``n`` probes: ``0..FIRST-1``, ``FIRST·GROWTH^k − 1``
    and ``n − 1``."""
    picks = list(range(min(FIRST, n)))
    pos = float(FIRST)
    while (pos := pos * GROWTH) < n:
        if int(pos) - 1 > picks[-1]:
            picks.append(int(pos) - 1)
    if picks[-1] != n - 1:
        picks.append(n - 1)
    return tuple(picks)


class TierRead:
    """One candidate tier: its groups' set keys, probes and known flags (``lo``/``hi``)."""

    __slots__ = ("set_keys", "probes", "lo", "hi", "read_to", "solve", "limit", "chain")

    def __init__(
        self,
        set_keys: list[str],
        probes: list[Sequence[int]],
        m: int,
        solve: Solve,
        limit: Limit,
        chain: tuple[Hashable, Sequence[bytes]],
    ) -> None:
        self.set_keys, self.probes, self.solve, self.limit = set_keys, probes, solve, limit
        self.chain = chain
        self.lo = [bytearray(m) for _ in probes]
        self.hi = [_ones(m, p) for p in probes]
        self.read_to = [0] * len(probes)  # probes before this position are all read

    def answer(self) -> int | None:
        """The proven answer, or None while ``lo`` and ``hi`` disagree."""
        low = self.solve(self.lo)
        return low if self.solve(self.hi) == low else None

    def next_reads(self, first: bool) -> list[tuple[int, Sequence[int]]]:
        """(group position, chain indices) to read in the next round."""
        out = []
        if first:
            for g, p in enumerate(self.probes):
                if len(p):
                    idx = first_round(p)
                    out.append((g, idx))
                    self.read_to[g] = len(p) if idx is p else min(FIRST, len(p))
            return out
        bound = self.limit(self.solve(self.hi))
        for g, p in enumerate(self.probes):
            stop = bisect_left(p, bound)
            if stop > self.read_to[g]:
                out.append((g, p[self.read_to[g] : stop]))
                self.read_to[g] = stop
        if not out:  # not expected (see the module docstring): read whatever is left
            for g, p in enumerate(self.probes):
                if self.read_to[g] < len(p):
                    out.append((g, p[self.read_to[g] :]))
                    self.read_to[g] = len(p)
        return out

    def learn(self, group: int, idx: Sequence[int], reply: Sequence[Any]) -> None:
        """Record an SMISMEMBER reply for ``idx`` of group ``group`` in both flag sets."""
        lo, hi = self.lo[group], self.hi[group]
        if isinstance(idx, range):
            got = bytearray(reply)  # 0/1 ints or bools: C speed
            stop = idx.start + len(idx) * idx.step
            lo[idx.start : stop : idx.step] = got
            hi[idx.start : stop : idx.step] = got
            return
        for i, f in zip(idx, reply):
            lo[i] = hi[i] = 1 if f else 0


class PrefixRead:
    """One single-group candidate tier: the longest run from block 0 (the contract's rule),
    the same plan as :class:`TierRead` with its flags kept as two numbers: ``held``, the
    blocks known present from 0, and ``miss``, the first block known absent (``n``: none
    known). ``solve(lo)`` is ``held``, ``solve(hi)`` is ``miss``; proven when they meet."""

    __slots__ = ("set_keys", "n", "held", "miss", "chain")

    def __init__(self, key: str, n: int, chain: tuple[Hashable, Sequence[bytes]]) -> None:
        self.set_keys, self.n, self.chain = (key,), n, chain
        self.held, self.miss = 0, n

    def answer(self) -> int | None:
        return self.held if self.held == self.miss else None

    def next_reads(self, first: bool) -> list[tuple[int, Sequence[int]]]:
        if first:
            return _first_reads(self.n)
        return [(0, range(self.held, self.miss))]

    def learn(self, group: int, idx: Sequence[int], reply: Sequence[Any]) -> None:
        del group
        flags = bytearray(reply)  # 0/1 ints or bools
        zero = flags.find(0)
        if zero >= 0 and idx[zero] < self.miss:
            self.miss = idx[zero]  # idx ascending: the first known miss
        if idx[0] <= self.held:  # a run read from inside the known prefix extends it
            head = len(idx) if isinstance(idx, range) else _head(idx)
            run = head if zero < 0 or zero >= head else zero
            self.held = max(self.held, idx[0] + run)

    def solve(self, flags: object) -> int:
        del flags
        return self.held


@lru_cache(maxsize=256)
def _first_reads(n: int) -> list[tuple[int, Sequence[int]]]:
    return [(0, first_round(range(n)))]  # shared: callers only iterate it


def _head(idx: Sequence[int]) -> int:
    """How many of ``idx`` are consecutive from ``idx[0]``."""
    base, count = idx[0], 0
    for count, i in enumerate(idx):  # noqa: B007 - the count is the answer
        if i != base + count:
            return count
    return len(idx)


def _ones(m: int, probes: Sequence[int]) -> bytearray:
    """``m`` bytes, 1 at every probe (unread: maybe present), 0 elsewhere."""
    if isinstance(probes, range) and probes.step == 1 and probes.start == 0:
        return bytearray(b"\x01") * len(probes) + bytearray(m - len(probes))
    out = bytearray(m)
    if isinstance(probes, range):
        stop = probes.start + len(probes) * probes.step
        out[probes.start : stop : probes.step] = b"\x01" * len(probes)
    else:
        for i in probes:
            out[i] = 1
    return out


Tier = TierRead | PrefixRead
"""One candidate tier's reads."""


class Round:
    """One pipelined round trip of reads, each with the handler its reply goes to: a
    ``(function, a, b)`` called as ``function(a, b, reply)`` (no closure per read)."""

    def __init__(self, encoded: dict[Hashable, list[bytes]] | None = None) -> None:
        self.reads = Reads()
        self.handlers: list[tuple[Callable[[Any, Any, Any], Any], Any, Any]] = []
        self._blobs: dict[tuple[Hashable, Hashable], int] = {}
        self._encoded = encoded if encoded is not None else {}
        """Per chain, its members as RESP bulk strings, as far as a range needed them:
        encoded once per request, whatever the candidates and rounds that read them."""

    def field(self, index: int, owner: object, name: str) -> None:
        """The reply of read ``index`` goes to ``owner.<name>``."""
        assert index == len(self.handlers)
        self.handlers.append((setattr, owner, name))

    def probe(self, tier: Tier, group: int, idx: Sequence[int]) -> None:
        """Queue SMISMEMBERs of ``idx`` of the tier's chain on the group's set, at most
        :data:`MAX_MEMBERS` members each (replies are delivered in order)."""
        if len(idx) <= MAX_MEMBERS:
            self._probe(tier, group, idx)
            return
        for start in range(0, len(idx), MAX_MEMBERS):
            self._probe(tier, group, idx[start : start + MAX_MEMBERS])

    def _probe(self, tier: Tier, group: int, idx: Sequence[int]) -> None:
        name, members = tier.chain
        key = (name, idx if isinstance(idx, (range, tuple)) else tuple(idx))
        blob = self._blobs.get(key)
        if blob is None:
            if isinstance(idx, range) and idx.step == 1:
                pieces = self._encoded.setdefault(name, [])
                if len(pieces) < idx.stop:
                    pieces += [
                        b"$%d\r\n%b\r\n" % (len(m), m) for m in members[len(pieces) : idx.stop]
                    ]
                data = b"".join(pieces[idx.start : idx.stop])
                blob = self.reads.members(members[idx.start : idx.stop], data)
            else:
                blob = self.reads.members([members[i] for i in idx])
            self._blobs[key] = blob
        self.reads.smismember(tier.set_keys[group], blob)
        self.handlers.append((tier.learn, group, idx))

    def deliver(self, replies: list[Any]) -> None:
        for (handler, a, b), reply in zip(self.handlers, replies, strict=True):
            handler(a, b, reply)
