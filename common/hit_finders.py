"""The per-class finders of vLLM's hybrid prefix-cache hit (spec ``vllm-hybrid-kv.md`` §1.4)
and the flag views they search; pure, stdlib only. :mod:`common.hit_rule` builds the classes
(:class:`GroupClass`) and runs the fixed point over these finders.

Speed (this runs per candidate per request): a class's flags become one byte per index
(``bytearray`` of a slice, ANDed across members as big ints) searched with ``find`` and
``rfind``: C speed, no Python loop per index. FA stops at the first miss; SWA first tries the
window just before the bound; Mamba reads right to left in segments.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

FA, SWA, MAMBA, CHUNKED, SKIP = "fa", "swa", "mamba", "chunked", "skip"
"""The finder families of a class (``SKIP``: groups that hold no prefix-cache blocks)."""


@dataclass(frozen=True)
class GroupClass:
    """Groups with one spec: the finder's family, sizes in tokens and chain indices."""

    family: str
    members: tuple[int, ...]
    block: int  # B used by the finder (h for an unknown kind under partial hits)
    k: int  # chain indices per block
    unit: int  # h
    need: int = 1  # sliding window: blocks needed just before L
    chunk: int = 0  # chunked local: chunk size


# --- flag views: one byte per chain index, 1 iff every member of the class holds it --------

_ONE = bytes([0] + [1] * 255)  # translate table: any set byte -> 1


def as_bytes(flags: Sequence[int], n: int) -> bytearray:
    """``flags`` as exactly ``n`` bytes of 0/1 (missing entries are absent)."""
    try:
        raw = bytearray(flags)  # C speed for 0/1 ints and bools, the callers' lists
    except (TypeError, ValueError):
        raw = bytearray()
    if len(raw) != len(flags):  # other truthy values (or a wider numpy dtype)
        raw = bytearray(map(bool, flags))
    raw = raw.translate(_ONE)
    if len(raw) != n:
        del raw[n:]
        raw.extend(bytes(n - len(raw)))
    return raw


class Flags:
    """A class's membership for one prompt as bytes of 0/1, one byte per chain index."""

    __slots__ = ("seqs", "m", "views")

    def __init__(self, seqs: list[Sequence[int]], m: int) -> None:
        self.seqs, self.m = seqs, m
        self.views: dict[int, bytes | bytearray] = {}

    def segment(self, step: int, lo: int, hi: int) -> bytes | bytearray:
        """Byte ``t - lo`` is 1 iff every member holds chain index ``(t+1)*step - 1``, for
        ``lo <= t < hi`` (a hash counts only if every group of the class has it)."""
        n = hi - lo
        if n <= 0:
            return b""
        first, stop = (lo + 1) * step - 1, hi * step
        buf = as_bytes(self.seqs[0][first:stop:step], n)
        if len(self.seqs) == 1:
            return buf
        both = int.from_bytes(buf, "little")
        for seq in self.seqs[1:]:
            both &= int.from_bytes(as_bytes(seq[first:stop:step], n), "little")
        return both.to_bytes(n, "little")

    def view(self, step: int) -> bytes | bytearray:
        """:meth:`segment` over every index below m, built once per prompt."""
        buf = self.views.get(step)
        if buf is None:
            buf = self.views[step] = self.segment(step, 0, self.m // step)
        return buf

    def last(self, step: int, hi: int) -> int:
        """The largest ``t < hi`` of view ``step`` that is set, -1 if none. Right to left by
        segments: a saved state or cached tail is usually near the end."""
        while hi > 0:
            lo = max(0, hi - 256)
            found = self.segment(step, lo, hi).rfind(1)
            if found >= 0:
                return lo + found
            hi = lo
        return -1


# --- finders: the largest length <= bound that one class accepts (spec §1.4) ---------------


def find_fa(c: GroupClass, fl: Flags, bound: int, a: int) -> int:
    nb = bound // c.block
    miss = fl.view(c.k).find(0, 0, nb)
    j = nb if miss < 0 else miss
    out = j * c.block
    if a < c.block:  # partial hits: the last hash unit held inside the first missing block
        lo = j * c.k
        f = fl.segment(1, lo, min(lo + c.k - 1, bound // a)).rfind(1)
        if f >= 0:
            out = (lo + f + 1) * a
    return out - out % a


def find_swa(c: GroupClass, fl: Flags, bound: int, a: int) -> int:
    need, nb, r = c.need, bound // c.block, a // c.block  # windows end on a-aligned edges
    hi = nb - nb % r
    if hi >= need and fl.segment(c.k, hi - need, hi).find(0) < 0:
        return hi * c.block  # the common case: the window just before the bound is cached
    buf, window = fl.view(c.k), b"\x01" * need
    while (start := buf.rfind(window, 0, hi)) >= 0:
        end = start + need  # the last full window below hi; no aligned one ends past it
        end -= end % r
        if end < need:
            break
        miss = buf.rfind(0, end - need, end)
        if miss < 0:
            return end * c.block
        hi = miss  # every window holding this block fails: look left of it
    # No full window: the run of blocks from 0 (shorter than a window), rounded down to a.
    run = buf.find(0, 0, min(nb, need))
    run = min(nb, need) if run < 0 else run
    return (run - run % r) * c.block


def find_mamba(c: GroupClass, fl: Flags, bound: int, a: int) -> int:
    step = a // c.unit  # the state must sit exactly at an a-aligned length
    return (fl.last(step, bound // a) + 1) * a


def find_chunked(c: GroupClass, fl: Flags, bound: int, a: int) -> int:
    nb = bound // c.block
    first = bound // c.chunk * c.chunk // c.block  # blocks before L's chunk count as computed
    miss = fl.view(c.k).find(0, first, nb)
    return (nb if miss < 0 else miss) * c.block


FINDERS: dict[str, Callable[[GroupClass, Flags, int, int], int]] = {
    FA: find_fa,
    SWA: find_swa,
    MAMBA: find_mamba,
    CHUNKED: find_chunked,
}
