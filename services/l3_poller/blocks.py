"""One poll's result: per KV-cache group, the complete blocks each instance holds (scope
segment) or the pool holds (scope pool), as sorted arrays the writer compares by digest.

Group 0 is the :class:`Blocks` itself (``per_ip``/``pool``), so a single-group master's
result has no group layer at all; groups ≥ 1 are in ``groups``, each a :class:`Blocks` of the
same shape. :func:`collect` builds it from the index's completeness verdict; a single-group
master takes its own branch, one loop over the complete keys, with no per-group lookups.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from services.l3_poller.keys_parser import U64_MASK


@dataclass
class Blocks:
    """Result of one poll: ``per_ip`` (scope segment) or ``pool`` (scope pool) block hashes,
    as **sorted** arrays of distinct u64 (8 bytes each: the writer keeps every master's last
    result). Sorted so that equal content has equal bytes, whatever order the master listed
    its keys in: :meth:`digest` is what the writer compares to skip unchanged sets."""

    per_ip: dict[str, array[int]]
    pool: array[int] | None
    complete: int
    """Complete blocks, counted per deployment: of every group at the top level (the
    master's ``blocks``), of its own group in an entry of ``groups``."""
    groups: dict[int, Blocks] = field(default_factory=dict)
    """KV-cache group g ≥ 1 → its blocks (``per_ip``/``pool`` above are group 0's)."""
    _digests: dict[str | None, bytes] = field(default_factory=dict, repr=False, compare=False)

    def digest(self, ip: str | None) -> bytes:
        """blake2b-128 of the sorted hashes of ``ip`` (``None`` = the pool), computed once."""
        found = self._digests.get(ip)
        if found is None:
            hashes = self.pool if ip is None else self.per_ip.get(ip)
            data = b"" if hashes is None else hashes.tobytes()
            found = self._digests[ip] = hashlib.blake2b(data, digest_size=16).digest()
        return found

    def by_group(self) -> Iterator[tuple[int, Blocks]]:
        """(group, its blocks), group 0 (this object) first."""
        yield 0, self
        yield from sorted(self.groups.items())


@dataclass(frozen=True)
class Verdict:
    """Which keys are complete blocks: a key ``ns << 64 | h`` is one when its unit
    ``unit_of[ns]`` is in ``single`` (one required namespace and nothing else: every key is
    a complete block) or ``unit << 64 | h`` is in ``complete``."""

    unit_of: Sequence[int]
    group_of: Sequence[int]
    """Unit id → its KV-cache group."""
    single: set[int]
    complete: Mapping[int, int]
    count: int
    """Complete (unit, hash) pairs."""
    multi: bool
    """Some unit seen is of a group ≥ 1."""


def collect(
    keys: Mapping[int, int], loc_ips: Sequence[tuple[str, ...]], scope: str, v: Verdict
) -> Blocks:
    """The complete blocks of ``keys`` (key → location id) per instance IP or for the pool."""
    if v.multi:
        return _per_group(keys, loc_ips, scope, v)
    unit_of, single, complete = v.unit_of, v.single, v.complete
    if scope == "pool":
        pool = {
            ck & U64_MASK
            for ck in keys
            if unit_of[ck >> 64] in single or (unit_of[ck >> 64] << 64 | ck & U64_MASK) in complete
        }
        return Blocks({}, array("Q", sorted(pool)), v.count)
    per_ip: dict[str, set[int]] = {}
    for ck, loc in keys.items():
        ips = loc_ips[loc]
        if not ips:
            continue
        unit = unit_of[ck >> 64]
        if unit not in single and (unit << 64 | ck & U64_MASK) not in complete:
            continue
        for ip in ips:
            per_ip.setdefault(ip, set()).add(ck & U64_MASK)
    return Blocks({ip: array("Q", sorted(per_ip.pop(ip))) for ip in list(per_ip)}, None, v.count)


def _per_group(
    keys: Mapping[int, int], loc_ips: Sequence[tuple[str, ...]], scope: str, v: Verdict
) -> Blocks:
    unit_of, group_of, single, complete = v.unit_of, v.group_of, v.single, v.complete
    pool = scope == "pool"
    found: dict[int, dict[str | None, set[int]]] = {}
    counts: dict[int, int] = {}
    for ck, loc in keys.items():
        unit, h = unit_of[ck >> 64], ck & U64_MASK
        if unit in single:
            counts[group_of[unit]] = counts.get(group_of[unit], 0) + 1
        elif (unit << 64 | h) not in complete:
            continue
        ips: tuple[str | None, ...] = (None,) if pool else loc_ips[loc]
        sets = found.setdefault(group_of[unit], {})
        for ip in ips:
            sets.setdefault(ip, set()).add(h)
    for hk in complete:
        group = group_of[hk >> 64]
        counts[group] = counts.get(group, 0) + 1
    out: dict[int, Blocks] = {}
    for group in {0, *found}:
        sets = found.pop(group, {})
        if pool:
            out[group] = Blocks({}, array("Q", sorted(sets.pop(None, ()))), counts.get(group, 0))
        else:
            out[group] = Blocks(
                {ip: array("Q", sorted(s)) for ip, s in sets.items() if ip is not None},
                None,
                counts.get(group, 0),
            )
    top = out.pop(0)
    top.complete, top.groups = v.count, out
    return top
