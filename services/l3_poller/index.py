"""Compact per-master L3 state: which vLLM keys the master holds, where, and what that means
for each instance.

Per key only ``(namespace id << 64 | u64 hash) → location id`` is kept, in one dict
(≈ 80 bytes per key measured; the key strings are never kept). A namespace is what a key
says besides its hash (vLLM: model head, tp, pcp, dcp, pp, group; vllm-ascend: model,
layout, pcp, dcp, head, pp, group, layer), interned once per distinct key prefix; a
location is an interned tuple of replica endpoints. Located keys are not queried again while every
endpoint of their location still maps to a live segment.

Rules (see docs/l3-poller.md):

* **complete block**: for a deployment (vLLM: model head; vllm-ascend: model and key
  layout), a hash counts only when a key exists in every namespace that
  :mod:`.completeness` requires, judged on the namespaces seen within the last
  ``ns_memory`` seconds (``ingest.l3.staleAfter``), this poll included: a block with one
  TP/PP shard, one layer or one group missing cannot be loaded by the engine. The memory
  matters when *all* keys of one namespace vanish at once (its segments' pod died): for
  that long the deployment's blocks stay incomplete; afterwards it is judged by the
  namespaces it still has (so a redeployment with another TP size is picked up).
* scope ``segment``: an instance holds a complete block when at least one of the block's
  keys has a replica on one of the instance's segments (host of the segment name).
* scope ``pool``: every complete block of the master counts for every instance attached
  to it (an instance is attached when it has a segment on the master).
"""

from __future__ import annotations

import hashlib
import time
from array import array
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from services.l3_poller.client import Replicas
from services.l3_poller.completeness import ModelPin, Requirements, requirements
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


@dataclass
class Blocks:
    """Result of one poll: ``per_ip`` (scope segment) or ``pool`` (scope pool) block hashes,
    as **sorted** arrays of distinct u64 (8 bytes each: the writer keeps every master's last
    result). Sorted so that equal content has equal bytes, whatever order the master listed
    its keys in: :meth:`digest` is what the writer compares to skip unchanged sets."""

    per_ip: dict[str, array[int]]
    pool: array[int] | None
    complete: int
    _digests: dict[str | None, bytes] = field(default_factory=dict, repr=False, compare=False)

    def digest(self, ip: str | None) -> bytes:
        """blake2b-128 of the sorted hashes of ``ip`` (``None`` = the pool), computed once."""
        found = self._digests.get(ip)
        if found is None:
            hashes = self.pool if ip is None else self.per_ip.get(ip)
            data = b"" if hashes is None else hashes.tobytes()
            found = self._digests[ip] = hashlib.blake2b(data, digest_size=16).digest()
        return found


class MasterIndex:
    """State of one master across polls. Poll: begin → feed* → located* → commit | abort."""

    def __init__(self, locate: bool = True, ns_memory: float = 60.0,
                 formats: tuple[str, ...] = FAMILIES,
                 pins: Mapping[str, ModelPin] | None = None) -> None:
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
        self._head_of: list[int] = []
        self._head_ids: dict[tuple[str, ...], int] = {}
        self._locs: list[Replicas] = [("?",), ()]
        self._loc_ids: dict[Replicas, int] = {(): 1}
        self._loc_ips: list[tuple[str, ...]] = [(), ()]
        self._loc_ok: list[bool] = [False, True]
        self._cur: dict[int, int] = {}
        self._cur_ns: set[int] = set()
        self.unresolved = False
        self.stats = PollStats()

    # -- one poll ------------------------------------------------------------------

    def begin(self, segmap: SegmentMap) -> None:
        self.remap(segmap)
        self._cur, self._cur_ns, self.stats = {}, set(), PollStats()

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
            if not loc_ok[loc] and self.locate:
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
        self._req = requirements(self.required_ns, self._ns_info, self._head_of, self.pins)
        self.keys = self._cur
        self._cur, self._cur_ns = {}, set()
        if len(self._locs) > 1024:
            self._compact()
        return self.stats

    def abort(self) -> None:
        self._cur, self._cur_ns = {}, set()

    # -- results -------------------------------------------------------------------

    def blocks(self, scope: str) -> Blocks:
        """Complete blocks of the last committed poll, per instance IP or for the pool."""
        single, complete, n = self._completeness()
        head_of = self._head_of
        if scope == "pool":
            pool = {ck & U64_MASK for ck in self.keys if head_of[ck >> 64] in single
                    or (head_of[ck >> 64] << 64 | ck & U64_MASK) in complete}
            return Blocks({}, array("Q", sorted(pool)), n)
        per_ip: dict[str, set[int]] = {}
        loc_ips = self._loc_ips
        for ck, loc in self.keys.items():
            ips = loc_ips[loc]
            if not ips:
                continue
            head = head_of[ck >> 64]
            if head not in single and (head << 64 | ck & U64_MASK) not in complete:
                continue
            for ip in ips:
                per_ip.setdefault(ip, set()).add(ck & U64_MASK)
        return Blocks({ip: array("Q", sorted(per_ip.pop(ip))) for ip in list(per_ip)}, None, n)

    def _completeness(self) -> tuple[set[int], dict[int, int], int]:
        """(deployments whose every key is a complete block — one required namespace and
        nothing else, the complete ``dep << 64 | hash`` ids of the others, how many
        complete blocks)."""
        need, required = self._req.need, self._req.required
        single = {dep for dep, n in need.items() if n == 1 and dep not in self._req.extra}
        counts: dict[int, int] = {}
        n_single = 0
        for ck in self.keys:
            dep = required.get(ck >> 64, -1)
            if dep < 0:
                continue
            if dep in single:
                n_single += 1
                continue
            hk = dep << 64 | ck & U64_MASK
            counts[hk] = counts.get(hk, 0) + 1
        for hk in [hk for hk, n in counts.items() if n != need[hk >> 64]]:
            del counts[hk]
        return single, counts, n_single + len(counts)

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
                ns = self._ns_ids[parsed] = len(self._head_of)
                self._ns_info.append(parsed)
                self._head_of.append(
                    self._head_ids.setdefault(parsed.deployment, len(self._head_ids)))
        elif self.formats != FAMILIES and parse_prefix(text, lay) is not None:
            ns = -2
        if len(self._prefix_ns) < _PREFIX_CACHE_MAX:
            self._prefix_ns[(prefix, layer) if layer else prefix] = ns
        return ns

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

