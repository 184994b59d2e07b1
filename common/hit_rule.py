"""vLLM's prefix-cache hit for an instance with several KV-cache groups; pure, stdlib only.

Owns the rule of ``HybridKVCacheCoordinator.find_longest_cache_hit`` (spec
``vllm-hybrid-kv.md`` §1.2-§1.4, pseudo-code §1.7) over per-group membership flags of the
prompt's hash chain at the hash unit ``h``. Chain index ``i`` names tokens ``[0, (i+1)h)``; a
group of block size ``B = k*h`` holds its block ``j`` at index ``(j+1)k-1``. :func:`build_rule`
does everything that does not depend on the prompt (families, classes, the alignment ``a``,
the partial-hit switch), :func:`hit_tokens` runs the fixed point, :func:`probe_indices` says
which flags the answer can depend on. :class:`HitRule` is the one interface of both rules:
:class:`Rule` (hybrid) and :class:`LongestPrefix` (a single group); :func:`last_token_bound`
is the cap both apply.

Decisions (what vLLM does, or what we do where it gives no answer):

- The answer is exact or a lower bound, never above vLLM. A group whose rule we cannot know
  (kind absent, ``unknown`` or new; chunked-local without a chunk size; sliding window without
  a window) gets the full-attention rule, which needs a superset of any real rule's blocks,
  and an :class:`Inexact` reason. With partial hits on (only when the caller forces them) an
  unknown kind is checked at every hash unit: its real rule might be Mamba's exact state.
- The automatic partial-hit switch treats an unknown kind with ``B != h`` as blocking it:
  partial hits off accept a subset of what they would accept on, so either way we stay low.
- ``cross_attention``/``encoder_only_attention`` groups hold no prefix-cache blocks: skipped,
  and not in the LCM. All groups skipped: the hit is 0.
- One group left: vLLM's Unitary coordinator, never partial hits, ``a = B``.
- No vLLM release answers these, so :func:`build_rule` raises ValueError: partial hits with
  a sliding-window or chunked-local group of ``B != h`` (0.26/0.27 turn them on and the
  sliding-window finder asserts, §7.1; 0.28+ turn them off, so forcing them is a contradiction),
  and a chunked-local group with ``B != a`` (its finder asserts ``block_size == alignment``).
- Groups with equal ``(kind, B, window, chunk)`` form one class: an index counts only where
  every member holds it (vLLM's ``get_cached_block``). Full-attention classes go first; their
  hit is computed once, later passes only trim to it (it is downward-closed).
- The finders and their flag views (and how they stay fast) are in :mod:`common.hit_finders`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol

from common.hit_finders import (
    CHUNKED,
    FA,
    FINDERS,
    MAMBA,
    SKIP,
    SWA,
    Flags,
    GroupClass,
    as_bytes,
    find_fa,
)

FULL_ATTENTION_KINDS = frozenset({"full_attention", "mla_attention", "sink_full_attention"})
SLIDING_WINDOW_KINDS = frozenset({"sliding_window", "sliding_window_mla"})
MAMBA_KIND = "mamba"
CHUNKED_LOCAL_KIND = "chunked_local_attention"
NOT_CACHED_KINDS = frozenset({"cross_attention", "encoder_only_attention"})

_LOCAL_KINDS = SLIDING_WINDOW_KINDS | {CHUNKED_LOCAL_KIND}  # never fine-grained in vLLM


@dataclass(frozen=True)
class GroupSpec:
    """One KV-cache group as the events (and config) describe it."""

    kind: str | None  # kv_cache_spec_kind wire string; None = not sent (vLLM < 0.22)
    block_size: int  # B in tokens, a multiple of h
    sliding_window: int | None = None  # tokens; SWA kinds only
    chunk: int | None = None  # chunked-local chunk size, tokens (from config, not the wire)


class Inexact(StrEnum):
    """Why an answer can only be a lower bound."""

    UNKNOWN_KIND = "unknown_group_kind"
    CHUNK_SIZE_UNKNOWN = "chunk_size_unknown"
    SLIDING_WINDOW_UNKNOWN = "sliding_window_unknown"


@dataclass(frozen=True)
class Rule:
    """Everything about an instance's groups that does not depend on the prompt."""

    groups: tuple[GroupSpec, ...]
    effective: tuple[str, ...]
    hash_unit: int
    alignment: int
    partial_hits: bool
    inexact: tuple[Inexact, ...]
    _classes: tuple[GroupClass, ...] = field(default=(), repr=False)
    _group_class: tuple[int, ...] = field(default=(), repr=False)  # class index, -1 = skipped

    # The hybrid HitRule: its answer is in tokens (see HitRule).
    def probes(self, group: int, num_tokens: int) -> Sequence[int]:
        return probe_indices(self, group, num_tokens)

    def answer(self, num_tokens: int, flags: Sequence[Sequence[int]]) -> int:
        return hit_tokens(self, num_tokens, flags)

    def limit(self, answer: int) -> int:
        return answer // self.hash_unit

    def hit(self, answer: int, num_tokens: int, block_size: int) -> tuple[int, float]:
        full = num_tokens // block_size * block_size
        return answer, min(answer, full) / full


def build_rule(
    groups: Sequence[GroupSpec],
    hash_unit: int,
    *,
    partial_hits: bool | None = None,
    vllm_version: tuple[int, ...] = (0, 34),
) -> Rule:
    """The :class:`Rule` of these groups (in the caller's order) at hash unit ``hash_unit``.

    ``partial_hits`` None decides as vLLM ``vllm_version`` does (spec §1.2); True/False forces
    it (one group: always off, as Unitary). Raises ValueError for ``h <= 0``, no group, a block
    size that is not a positive multiple of ``h``, a window or chunk below 1, and the shapes no
    vLLM release can answer (module docstring). ``a = h`` with partial hits, else the LCM of
    the block sizes of the groups not skipped."""
    groups = tuple(groups)
    _validate(groups, hash_unit)
    families, reasons = zip(*(_family(g) for g in groups), strict=True)
    live = [g for g, f in zip(groups, families, strict=True) if f != SKIP]
    if len(live) < 2:
        partial = False
    elif partial_hits is None:
        partial = _auto_partial(live, hash_unit, vllm_version)
    else:
        partial = partial_hits
    if partial and any(g.kind in _LOCAL_KINDS and g.block_size != hash_unit for g in live):
        raise ValueError(
            "partial hits with a sliding-window or chunked-local group whose block "
            "size is not the hash unit: no vLLM release answers that"
        )
    alignment = hash_unit if partial or not live else math.lcm(*(g.block_size for g in live))
    if any(g.kind == CHUNKED_LOCAL_KIND and g.block_size != alignment for g in live):
        raise ValueError(
            "a chunked-local group's block size differs from the alignment "
            f"{alignment}: vLLM's chunked-local finder asserts they are equal"
        )
    classes, group_class = _classes(groups, families, hash_unit, partial)
    return Rule(
        groups,
        tuple(families),
        hash_unit,
        alignment,
        partial,
        tuple(dict.fromkeys(r for r in reasons if r is not None)),
        classes,
        group_class,
    )


def _validate(groups: tuple[GroupSpec, ...], h: int) -> None:
    if not isinstance(h, int) or h <= 0:
        raise ValueError(f"hash unit must be a positive int, got {h!r}")
    if not groups:
        raise ValueError("at least one KV-cache group is needed")
    for pos, g in enumerate(groups):
        if not isinstance(g.block_size, int) or g.block_size <= 0 or g.block_size % h:
            raise ValueError(
                f"group {pos}: block size {g.block_size!r} is not a positive "
                f"multiple of the hash unit {h}"
            )
        used = (
            g.sliding_window
            if g.kind in SLIDING_WINDOW_KINDS
            else g.chunk
            if g.kind == CHUNKED_LOCAL_KIND
            else None
        )
        if used is not None and (not isinstance(used, int) or used < 1):
            raise ValueError(f"group {pos}: window/chunk {used!r} must be an int >= 1")


def _family(g: GroupSpec) -> tuple[str, Inexact | None]:
    """The finder family applied to ``g`` and why it is not the real one (None: it is)."""
    if g.kind in FULL_ATTENTION_KINDS:
        return FA, None
    if g.kind in SLIDING_WINDOW_KINDS:
        return (SWA, None) if g.sliding_window is not None else (FA, Inexact.SLIDING_WINDOW_UNKNOWN)
    if g.kind == MAMBA_KIND:
        return MAMBA, None
    if g.kind == CHUNKED_LOCAL_KIND:
        return (CHUNKED, None) if g.chunk is not None else (FA, Inexact.CHUNK_SIZE_UNKNOWN)
    if g.kind in NOT_CACHED_KINDS:
        return SKIP, None
    return FA, Inexact.UNKNOWN_KIND


def _auto_partial(live: list[GroupSpec], h: int, version: tuple[int, ...]) -> bool:
    """vLLM's ``enable_partial_hash_hits`` (0.26+, DCP 1, every Mamba group in align mode)."""
    if tuple(version) < (0, 26) or not any(g.kind == MAMBA_KIND and g.block_size > h for g in live):
        return False
    fine = FULL_ATTENTION_KINDS | {MAMBA_KIND}  # the managers with fine-grained lookup
    if all(g.block_size == h or g.kind in fine for g in live):
        return True
    if tuple(version) < (0, 28) and any(g.kind in _LOCAL_KINDS and g.block_size != h for g in live):
        raise ValueError(
            f"vLLM {'.'.join(map(str, version))} turns partial hits on with a "
            "sliding-window or chunked-local group whose block size is not the "
            "hash unit, and then asserts on every lookup"
        )
    return False  # 0.28+ silently off; an unknown kind with B != h: off is the lower bound


def _classes(
    groups: tuple[GroupSpec, ...], families: tuple[str, ...], h: int, partial: bool
) -> tuple[tuple[GroupClass, ...], tuple[int, ...]]:
    """Merge groups of one spec into classes, full-attention ones first."""
    members: dict[tuple[str, str | None, int, int | None, int | None], list[int]] = {}
    for pos, (g, fam) in enumerate(zip(groups, families, strict=True)):
        if fam != SKIP:
            window = g.sliding_window if fam == SWA else None
            chunk = g.chunk if fam == CHUNKED else None
            members.setdefault((fam, g.kind, g.block_size, window, chunk), []).append(pos)
    built: list[GroupClass] = []
    for (fam, kind, _, window, chunk), pos_list in members.items():
        g = groups[pos_list[0]]
        # An unknown kind under partial hits may really be Mamba: demand every hash unit.
        block = h if partial and fam == FA and kind not in FULL_ATTENTION_KINDS else g.block_size
        need = 1 if window is None else max(1, -(-(window - 1) // block))
        built.append(GroupClass(fam, tuple(pos_list), block, block // h, h, need, chunk or 0))
    built.sort(key=lambda c: (c.family != FA, c.members[0]))
    group_class = [-1] * len(groups)
    for ci, c in enumerate(built):
        for pos in c.members:
            group_class[pos] = ci
    return tuple(built), tuple(group_class)


def hit_tokens(rule: Rule, num_tokens: int, present: Sequence[Sequence[int]]) -> int:
    """vLLM's prefix-cache hit, in tokens, for a prompt of ``num_tokens`` tokens.

    ``present[g][i]`` is truthy iff group ``g`` (position in ``rule.groups``) holds chain
    index ``i``, for ``i < num_tokens // rule.hash_unit``; indices past a sequence's end count
    as absent. The search stops at ``num_tokens - 1``: vLLM always recomputes the last token."""
    if len(present) != len(rule.groups):
        raise ValueError(f"{len(present)} flag sequences for {len(rule.groups)} groups")
    classes, a = rule._classes, rule.alignment
    if num_tokens <= 1 or not classes:
        return 0
    m = num_tokens // rule.hash_unit
    flags = [Flags([present[g] for g in c.members], m) for c in classes]
    bound = last_token_bound(num_tokens)
    if len(classes) == 1:
        return FINDERS[classes[0].family](classes[0], flags[0], bound, a)
    simple = len(classes) == 2 and classes[0].family == FA  # one pass reaches the fixed point
    fa_hits: dict[int, int] = {}
    while True:
        cur = bound
        for ci, c in enumerate(classes):
            if c.family == FA:
                if ci not in fa_hits:
                    fa_hits[ci] = find_fa(c, flags[ci], cur, a)
                cur = min(cur, fa_hits[ci])
            else:
                cur = FINDERS[c.family](c, flags[ci], cur, a)
        if cur >= bound or cur == 0 or simple:
            return cur
        bound = cur


def probe_indices(rule: Rule, group: int, num_tokens: int) -> range | list[int]:
    """The chain indices of group ``group`` that :func:`hit_tokens` may read (a superset of
    those that can change it); any other flag may be left 0."""
    ci = rule._group_class[group]
    if ci < 0 or num_tokens <= 1:
        return range(0)
    c, bound, a = rule._classes[ci], last_token_bound(num_tokens), rule.alignment
    if rule.partial_hits and c.family in (FA, MAMBA):
        return range(bound // rule.hash_unit)
    if c.family == MAMBA:
        step = a // c.unit
        return range(step - 1, bound // a * step, step)
    nb, r = bound // c.block, a // c.block
    if c.family != SWA or c.need >= r:
        return range(c.k - 1, nb * c.k, c.k)
    # Sparse sliding window (need < a/B): only the windows before a-aligned edges, plus the
    # leading blocks its fallback reads.
    lead = min(c.need, nb)
    blocks = list(range(lead))
    for end in range(r, nb + 1, r):
        blocks.extend(range(max(end - c.need, lead), end))
    return [(b + 1) * c.k - 1 for b in blocks]


def last_token_bound(num_tokens: int) -> int:
    """The longest hit, in tokens, vLLM can reuse of a prompt: it always recomputes the last
    token (the one cap every rule and the API apply)."""
    return num_tokens - 1


def prefix_blocks(flags: Sequence[int]) -> int:
    """How many flags from index 0 are set before the first unset (:class:`LongestPrefix`)."""
    miss = as_bytes(flags, len(flags)).find(0)
    return len(flags) if miss < 0 else miss


class HitRule(Protocol):
    """vLLM's hit for one instance, whatever its groups: which chain indices to read, and
    the answer from their flags. :class:`LongestPrefix` is the single-group rule (the
    contract's), :class:`Rule` the hybrid one (vLLM's per-group rule). An answer is in the
    rule's own unit; :meth:`hit` turns it into the tokens and ratio the API reports."""

    @property
    def hash_unit(self) -> int:
        """The tokens per chain index the rule reads (the chain the prompt is hashed at)."""
        ...

    def probes(self, group: int, num_tokens: int) -> Sequence[int]:
        """The chain indices of group ``group`` (position) the answer may depend on."""
        ...

    def answer(self, num_tokens: int, flags: Sequence[Sequence[int]]) -> int:
        """The answer from each group's flags (one per chain index; unread ones absent)."""
        ...

    def limit(self, answer: int) -> int:
        """The chain index below which every flag ``answer`` depends on lies."""
        ...

    def hit(self, answer: int, num_tokens: int, block_size: int) -> tuple[int, float]:
        """(hit tokens, hit ratio over the request's full blocks of ``block_size``)."""
        ...


@dataclass(frozen=True)
class LongestPrefix:
    """The single-group rule: the longest run of blocks held from block 0. Its answer is in
    blocks; the ratio counts every held block, the tokens stop before the last token."""

    hash_unit: int
    """The block size: the request's (a single group is hashed at its own block size)."""

    def probes(self, group: int, num_tokens: int) -> Sequence[int]:
        del group
        return range(num_tokens // self.hash_unit)

    def answer(self, num_tokens: int, flags: Sequence[Sequence[int]]) -> int:
        return prefix_blocks(flags[0][: num_tokens // self.hash_unit])

    def limit(self, answer: int) -> int:
        return answer

    def hit(self, answer: int, num_tokens: int, block_size: int) -> tuple[int, float]:
        n = num_tokens // block_size
        return min(answer, last_token_bound(num_tokens) // block_size) * block_size, answer / n
