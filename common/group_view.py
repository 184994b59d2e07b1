"""An instance's KV-cache groups as the store holds them (``ci:{ip}:l1:groups``), parsed once
for the API's hit rule and the operator's status view.

The L1 ingester writes one field per group, ``<g>`` → ``kind,B,w,bmin`` (kind ``-`` when the
engine sends none, window empty when it has none, ``B`` the largest and ``bmin`` the smallest
block size seen: partial entries carry ``h``), and its settings ``h_cfg``, ``chunk`` and
``dp`` (:mod:`common.store_lua`, ``APPLY_BATCH``), and ``la``: the engine's
speculative-decoding lookahead L as its GPU ``BlockStored`` events show it
(:func:`lookahead`). :func:`parse_groups` turns that into a :class:`Groups`: **single** (no
group, or one full-attention-family group 0: the contract's longest-prefix rule, exactly as
before groups existed) or **hybrid** (vLLM's rule, :mod:`common.hit_rule`, with the reasons
it can only be a lower bound).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from common import hit_rule
from common.event_types import MAX_LOOKAHEAD
from common.hit_rule import GroupSpec, Rule

SINGLE_KINDS = frozenset({"-", *hit_rule.FULL_ATTENTION_KINDS})
"""Kinds of a lone group 0 that the longest-prefix rule answers exactly (``-``: the engine
sends no kind, vLLM < 0.22, a dense model)."""

UNCONFIRMED_UNIT = "unconfirmed_hash_unit"
"""A hybrid's hash unit derived from the block sizes, not yet confirmed by the self-check."""
DP_UNION = "dp_union"
"""DP ranks are indexed as one union: the groups' blocks may sit on different ranks."""
GROUPS_UNUSABLE = "groups_unusable"
"""The descriptors admit no hit rule (a block size that is not a multiple of the unit)."""


@dataclass(frozen=True)
class Group:
    gid: int
    kind: str
    block_size: int
    window: int | None
    smallest: int


@dataclass(frozen=True)
class Groups:
    """The parsed descriptors; ``rule`` is None for a single-group instance."""

    groups: tuple[Group, ...] = ()
    hash_unit: int = 0
    unit_from_config: bool = False
    rule: Rule | None = None
    reasons: tuple[str, ...] = ()
    usable: bool = True

    @property
    def hybrid(self) -> bool:
        return self.rule is not None or not self.usable

    @property
    def ids(self) -> tuple[int, ...]:
        return tuple(g.gid for g in self.groups)


def parse_groups(fields: dict[str, str], vllm_version: tuple[int, ...]) -> Groups:
    """The :class:`Groups` of one descriptor hash (see the module docstring).

    The hash unit (the rule, stated here only): ``h_cfg`` (``ingest.l1.prefixMatchUnit``)
    when set, else the GCD of the groups' block sizes, the smallest seen included (a partial
    entry's ``block_size`` is the unit). The self-check (``services/l1_ingest/hashcheck.py``)
    derives it the same way from the events it samples."""
    found = _groups(fields)
    if not found or (len(found) == 1 and found[0].gid == 0 and found[0].kind in SINGLE_KINDS):
        return Groups(tuple(found), found[0].block_size if found else 0)
    h_cfg, chunk = _int(fields.get("h_cfg")), _int(fields.get("chunk"))
    unit = h_cfg or math.gcd(*(g.block_size for g in found), *(g.smallest for g in found))
    specs = [
        GroupSpec(None if g.kind == "-" else g.kind, g.block_size, g.window, chunk or None)
        for g in found
    ]
    try:
        rule = hit_rule.build_rule(specs, unit, vllm_version=vllm_version)
    except ValueError:
        return Groups(tuple(found), unit, bool(h_cfg), None, (GROUPS_UNUSABLE,), usable=False)
    reasons = [str(r) for r in rule.inexact]
    if _int(fields.get("dp")) > 1:
        reasons.append(DP_UNION)
    return Groups(tuple(found), unit, bool(h_cfg), rule, tuple(reasons))


def _groups(fields: dict[str, str]) -> list[Group]:
    out = []
    for name, value in fields.items():
        if not name.isdigit():
            continue
        kind, size, window, smallest = (value.split(",") + ["", "", "", ""])[:4]
        out.append(
            Group(
                int(name),
                kind or "-",
                _int(size),
                _int(window) or None,
                _int(smallest) or _int(size),
            )
        )
    return sorted((g for g in out if g.block_size > 0), key=lambda g: g.gid)


def _int(value: str | None) -> int:
    try:
        return int(value or 0)
    except ValueError:
        return 0


LOOKAHEAD_FIELD = "la"
"""The descriptor field holding the lookahead L learned from the events."""


def lookahead(fields: dict[str, str], default: int) -> tuple[int, bool]:
    """(L, learned): the lookahead the instance's hashes cover (spec vllm-extra-keys.md §5),
    as its events showed it, else ``default`` (``blockKey.hashLookaheadTokens``). The decoder
    admits at most :data:`MAX_LOOKAHEAD` tokens; any other stored value is not one it wrote."""
    value = fields.get(LOOKAHEAD_FIELD)
    if value is not None and value.isdigit() and int(value) <= MAX_LOOKAHEAD:
        return int(value), True
    return default, False


def describe_lookahead(fields: dict[str, str], default: int) -> dict[str, object]:
    """The lookahead part of an instance's status: L and where it comes from."""
    tokens, learned = lookahead(fields, default)
    return {"lookahead_tokens": tokens, "lookahead_source": "events" if learned else "config"}


def checks_unit(groups: Groups) -> bool:
    """A hybrid whose hash unit is derived from the block sizes (not configured): its answers
    are exact only once the self-check verified that unit (:func:`unit_reasons`)."""
    return groups.rule is not None and not groups.unit_from_config


def unit_reasons(check_unit: bool, hash_check: str | None) -> tuple[str, ...]:
    """Why an answer is a lower bound because of its hash unit, for the API and the status
    view alike: an unconfirmed derived unit (``hash_check`` is the self-check's verdict)."""
    return (UNCONFIRMED_UNIT,) if check_unit and hash_check != "ok" else ()


def describe(groups: Groups, hash_check: str | None) -> dict[str, object]:
    """The ``groups`` part of an instance's status: descriptors, hash unit, exactness."""
    reasons = [*groups.reasons, *unit_reasons(checks_unit(groups), hash_check)]
    return {
        "hybrid": groups.hybrid,
        "kv_cache_groups": [
            {
                "group": g.gid,
                "kind": None if g.kind == "-" else g.kind,
                "block_size": g.block_size,
                "sliding_window": g.window,
            }
            for g in groups.groups
        ],
        "hash_unit": groups.hash_unit or None,
        "hash_unit_source": ("config" if groups.unit_from_config else "events")
        if groups.hash_unit
        else None,
        "exact": not reasons,
        "inexact_reasons": reasons,
    }
