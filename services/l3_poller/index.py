"""Compact per-master L3 state: which vLLM keys the master holds, where, and what that means
for each instance, per KV-cache group.

Per key only ``(namespace id << 64 | u64 hash) → location id`` is kept, in one dict
(≈ 80 bytes per key measured; the key strings are never kept). A namespace is what a key
says besides its hash (vLLM: model head, tp, pcp, dcp, pp, group; vllm-ascend: model,
layout, pcp, dcp, head, pp, group, layer), interned once per distinct key prefix; a
location is an interned tuple of replica endpoints. Located keys are not queried again while every
endpoint of their location still maps to a live segment, unless the poll is told to
``relocate`` (the master removed some key since the last poll, so a listed key may have been
put again elsewhere: see the poller).

Rules (see docs/l3-poller.md):

* **groups are sets**: each KV-cache group of a deployment (vLLM: model head; vllm-ascend:
  model and key layout) is judged on its own and gives its own set (a *unit*); a block of
  group 0 does not need group 1's key, or the reverse.
* **complete block**: within a unit, a hash counts only when a key exists in every
  namespace that :mod:`.completeness` requires, judged on the namespaces seen within the
  last ``ns_memory`` seconds (``ingest.l3.staleAfter``), this poll included: a block with one
  TP/PP shard or one layer missing cannot be loaded by the engine. The memory
  matters when *all* keys of one namespace vanish at once (its segments' pod died): for
  that long the deployment's blocks stay incomplete; afterwards it is judged by the
  namespaces it still has (so a redeployment with another TP size is picked up).
* **unmappable groups** (:func:`.completeness.unmappable_units`): a group of a vllm-ascend
  deployment whose hashes no other group of it shares holds no vLLM block hashes (grouped
  rehash); its keys are counted (``PollStats.unmappable_group``) and it gives no set.
* scope ``segment``: an instance holds a complete block when at least one of the block's
  keys has a replica on one of the instance's segments (host of the segment name).
* scope ``pool``: every complete block of the master counts for every instance attached
  to it (an instance is attached when it has a segment on the master).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from services.l3_poller.blocks import Blocks, Verdict, collect
from services.l3_poller.client import Replicas
from services.l3_poller.completeness import (
    ModelPin,
    Requirements,
    may_rehash,
    requirements,
    unmappable_units,
)
from services.l3_poller.keys_parser import (
    FAMILIES,
    HASH_HEX,
    U64_MASK,
    AnyNamespace,
    is_url_safe,
    parse_prefix,
    split_layer_tail,
)
from services.l3_poller.segments import SegmentMap, canonical_ip

__all__ = ["UNLOCATED", "Blocks", "MasterIndex", "PollStats", "SegmentMap", "canonical_ip"]

UNLOCATED = 0
"""Location id of a key not located yet (never valid: it is queried)."""
_PREFIX_CACHE_MAX = 65_536
"""Distinct prefixes remembered; other tenants' keys may each have their own."""


@dataclass
class PollStats:
    seen: int = 0
    parsed: int = 0
    skipped: Counter[str] = field(default_factory=Counter)
    to_locate: int = 0
    sample_unparsed: bytes = b""
    unmappable_group: int = 0
    """Keys of KV-cache groups whose hashes are not vLLM block hashes (no set is made)."""
    unmappable: list[tuple[str, int]] = field(default_factory=list)
    """(model, group) of those groups."""
    relocated: bool = False
    """Every listed key was located again (the master removed keys since the last poll)."""


class MasterIndex:
    """State of one master across polls. Poll: begin → feed* → located* → commit | abort."""

    def __init__(
        self,
        locate: bool = True,
        ns_memory: float = 60.0,
        formats: tuple[str, ...] = FAMILIES,
        pins: Mapping[str, ModelPin] | None = None,
    ) -> None:
        self.locate = locate
        self.ns_memory = ns_memory
        self.formats = tuple(formats)
        self.pins = dict(pins or {})
        self.keys: dict[int, int] = {}
        self.required_ns: set[int] = set()
        self._req = Requirements({}, {}, set())
        self._ns_seen: dict[int, float] = {}
        self._prefix_ns: dict[bytes | tuple[bytes, bytes], int] = {}
        self._ns_ids: dict[AnyNamespace, int] = {}
        self._ns_info: list[AnyNamespace] = []
        self._unit_of: list[int] = []
        """Namespace id → unit id: (deployment, KV-cache group), judged and kept apart."""
        self._unit_ids: dict[tuple[tuple[str, ...], int], int] = {}
        self._unit_group: list[int] = []
        self._unit_dep: list[int] = []
        self._dep_ids: dict[tuple[str, ...], int] = {}
        self._unmappable: set[int] = set()
        self._locs: list[Replicas] = [("?",), ()]
        self._loc_ids: dict[Replicas, int] = {(): 1}
        self._loc_ips: list[tuple[str, ...]] = [(), ()]
        self._loc_ok: list[bool] = [False, True]
        self._cur: dict[int, int] = {}
        self._cur_ns: set[int] = set()
        self.unresolved = False
        self._relocate = False
        self.stats = PollStats()

    # -- one poll ------------------------------------------------------------------

    def begin(self, segmap: SegmentMap, relocate: bool = False) -> None:
        """Start a poll; ``relocate`` queries every listed key again, not only new ones."""
        self.remap(segmap)
        self._relocate = relocate
        self._cur, self._cur_ns, self.stats = {}, set(), PollStats(relocated=relocate)

    def remap(self, segmap: SegmentMap) -> None:
        """Resolve every known location against a (new) segment listing."""
        self._segmap = segmap
        self.unresolved = False
        resolved = [self._resolve(loc) for loc in self._locs]
        self._loc_ips = [ips for ips, _ in resolved]
        self._loc_ok = [ok for _, ok in resolved]
        self._loc_ok[UNLOCATED] = False

    def feed(self, lines: Iterable[bytes]) -> list[tuple[bytes, int]]:
        """Account ``/get_all_keys`` lines; returns (key, id) of the keys that must be
        located (pass the id to :meth:`located`). The per-line work is inlined: it runs
        once per key per poll."""
        stats, cur, known, loc_ok = self.stats, self._cur, self.keys, self._loc_ok
        prefixes, hex_match, add_ns = self._prefix_ns, HASH_HEX.fullmatch, self._cur_ns.add
        relocate = self._relocate
        out: list[tuple[bytes, int]] = []
        n = bad = 0
        for line in lines:
            n += 1
            prefix, _, tail = line.rpartition(b"@")
            if hex_match(tail):
                ns = prefixes.get(prefix)
                if ns is None:
                    ns = self._intern_prefix(prefix, b"")
            else:  # vllm-ascend layer-wise before v0.21: …@{hex}@{layer}
                ns, tail = self._layer_key(prefix, tail)
            if ns < 0:
                bad += 1
                self._skip(line, ns)
                continue
            ck = (ns << 64) | int(tail[-16:], 16)
            add_ns(ns)
            loc = cur[ck] = known.get(ck, UNLOCATED)
            if (relocate or not loc_ok[loc]) and self.locate:
                out.append((line, ck))
        stats.seen += n
        stats.parsed += n - bad
        unsafe = [item for item in out if not is_url_safe(item[0])]
        if unsafe:
            stats.skipped["unquotable"] += len(unsafe)
            out = [item for item in out if is_url_safe(item[0])]
        stats.to_locate += len(out)
        return out

    def _layer_key(self, prefix: bytes, layer: bytes) -> tuple[int, bytes]:
        """(namespace id or -1, hash hex) of a key whose tail is not a hash."""
        layered = split_layer_tail(prefix, layer)
        if layered is None:
            return -1, b""
        head, hexpart = layered
        ns = self._prefix_ns.get((head, layer))
        return (self._intern_prefix(head, layer) if ns is None else ns), hexpart

    def _skip(self, line: bytes, ns: int) -> None:
        """Count a key no enabled family parses (``format_disabled``: one that
        ``ingest.l3.keyFormats`` leaves out; ``unparsed``: in no family at all)."""
        if ns == -2:
            self.stats.skipped["format_disabled"] += 1
            return
        self.stats.skipped["unparsed"] += 1
        if not self.stats.sample_unparsed:
            self.stats.sample_unparsed = line

    def located(self, ck: int, replicas: Replicas | None) -> None:
        """Record a key's replicas; ``None`` = the key vanished since it was listed."""
        if replicas is None:
            self._cur.pop(ck, None)
            return
        loc = self._loc_ids.get(replicas)
        if loc is None:
            loc = self._loc_ids[replicas] = len(self._locs)
            self._locs.append(replicas)
            ips, ok = self._resolve(replicas)
            self._loc_ips.append(ips)
            self._loc_ok.append(ok)
        self.unresolved |= not self._loc_ok[loc]
        self._cur[ck] = loc

    def commit(self, now: float | None = None) -> PollStats:
        now = time.monotonic() if now is None else now
        self._ns_seen.update(dict.fromkeys(self._cur_ns, now))
        for ns in [ns for ns, seen in self._ns_seen.items() if now - seen > self.ns_memory]:
            del self._ns_seen[ns]
        self.required_ns = set(self._ns_seen)
        self._req = requirements(self.required_ns, self._ns_info, self._unit_of, self.pins)
        self.keys = self._cur
        self._judge_groups()
        self._cur, self._cur_ns = {}, set()
        if len(self._locs) > 1024:
            self._compact()
        return self.stats

    def gone(self) -> int:
        """Keys of the last committed poll that this poll's listing (so far) does not hold."""
        cur = self._cur
        return sum(1 for ck in self.keys if ck not in cur)

    def abort(self) -> None:
        self._cur, self._cur_ns = {}, set()

    # -- results -------------------------------------------------------------------

    def blocks(self, scope: str) -> Blocks:
        """Complete blocks of the last committed poll, per instance IP or for the pool, per
        KV-cache group."""
        return collect(self.keys, self._loc_ips, scope, self._completeness())

    def _completeness(self) -> Verdict:
        """Units whose every key is a complete block (one required namespace and nothing
        else), the complete ``unit << 64 | hash`` ids of the others, how many complete
        blocks; unmappable units have none."""
        need, required, skip = self._req.need, self._req.required, self._unmappable
        single = {
            unit
            for unit, n in need.items()
            if n == 1 and unit not in self._req.extra and unit not in skip
        }
        counts: dict[int, int] = {}
        n_single = 0
        for ck in self.keys:
            unit = required.get(ck >> 64, -1)
            if unit < 0:
                continue
            if unit in single:
                n_single += 1
                continue
            hk = unit << 64 | ck & U64_MASK
            counts[hk] = counts.get(hk, 0) + 1
        for hk in [hk for hk, n in counts.items() if n != need[hk >> 64] or hk >> 64 in skip]:
            del counts[hk]
        multi = any(self._unit_group[unit] for unit in need)
        return Verdict(
            self._unit_of, self._unit_group, single, counts, n_single + len(counts), multi
        )

    def _judge_groups(self) -> None:
        """Find the groups of this poll whose hashes are not block hashes (see
        :func:`.completeness.unmappable_units`); count their keys in the poll's stats."""
        by_dep: dict[int, set[int]] = {}
        for ns in self._cur_ns:
            if may_rehash(self._ns_info[ns]):
                unit = self._unit_of[ns]
                by_dep.setdefault(self._unit_dep[unit], set()).add(unit)
        candidates = {
            unit: dep for dep, units in by_dep.items() if len(units) > 1 for unit in units
        }
        found = unmappable_units(self.keys, self._unit_of, candidates) if candidates else {}
        self._unmappable = set(found)
        self.stats.unmappable_group = sum(found.values())
        model = {
            self._unit_of[ns]: getattr(self._ns_info[ns], "model", "")
            for ns in self._cur_ns
            if self._unit_of[ns] in found
        }
        self.stats.unmappable = sorted((model[u], self._unit_group[u]) for u in found)

    # -- interning -----------------------------------------------------------------

    def _intern_prefix(self, prefix: bytes, layer: bytes) -> int:
        """Namespace id of a new prefix (and layer tail); -1 = no family, -2 = a family
        that ``formats`` leaves out."""
        text, lay = prefix.decode("utf-8", "replace"), layer.decode()
        parsed = parse_prefix(text, lay, self.formats)
        ns = -1
        if parsed is not None:
            ns = self._ns_ids.get(parsed, -1)
            if ns < 0:
                ns = self._ns_ids[parsed] = len(self._unit_of)
                self._ns_info.append(parsed)
                self._unit_of.append(self._intern_unit(parsed))
        elif self.formats != FAMILIES and parse_prefix(text, lay) is not None:
            ns = -2
        if len(self._prefix_ns) < _PREFIX_CACHE_MAX:
            self._prefix_ns[(prefix, layer) if layer else prefix] = ns
        return ns

    def _intern_unit(self, parsed: AnyNamespace) -> int:
        dep = self._dep_ids.setdefault(parsed.deployment, len(self._dep_ids))
        unit = self._unit_ids.get((parsed.deployment, parsed.group))
        if unit is None:
            unit = self._unit_ids[(parsed.deployment, parsed.group)] = len(self._unit_group)
            self._unit_group.append(parsed.group)
            self._unit_dep.append(dep)
        return unit

    def _resolve(self, replicas: Replicas) -> tuple[tuple[str, ...], bool]:
        ips = [self._segmap.ip_of(ep) for ep in replicas]
        found = tuple(dict.fromkeys(ip for ip in ips if ip is not None))
        return found, None not in ips

    def _compact(self) -> None:
        used = sorted(set(self.keys.values()) | {UNLOCATED, 1})
        if len(used) * 2 > len(self._locs):
            return
        new_id = {old: new for new, old in enumerate(used)}
        self._locs = [self._locs[i] for i in used]
        self._loc_ips = [self._loc_ips[i] for i in used]
        self._loc_ok = [self._loc_ok[i] for i in used]
        self._loc_ids = {loc: i for i, loc in enumerate(self._locs) if i != UNLOCATED}
        for ck, loc in self.keys.items():
            self.keys[ck] = new_id[loc]
