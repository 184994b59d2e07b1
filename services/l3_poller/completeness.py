"""Which object namespaces a block needs before an engine can load it from Mooncake, and
which KV-cache groups' hashes are not vLLM block hashes at all.

A *deployment* is what one engine's keys share: ``("vllm", head)`` for vLLM's in-tree
connector, ``("vllm-ascend", form, model)`` for vllm-ascend (see
:mod:`~services.l3_poller.keys_parser`). A *unit* is one KV-cache group of a deployment:
groups are separate sets, not a completeness dimension (a hybrid model's sliding-window or
Mamba group stores only the blocks a hit can use — tails, checkpoints — so requiring its key
at every block would make the model's L3 empty; vLLM's and vllm-ascend's coordinators judge
each group by its own rule). Given the namespaces of a master seen recently,
:func:`requirements` says, per unit, how many namespaces a block needs and which of the seen
ones count toward that number:

* ``vllm``: every namespace of the group seen (tp × pcp × dcp × pp as observed).
* ``vllm-ascend``, like the engine's own lookup (``lookup_scheduler`` / v0.23+ scheduler
  side): within the group, per (``cache_role``, ``cache_family``) the head namespaces
  ``0..H-1`` × pp ranks ``0..P-1`` (normal keys) or × layers ``0..L-1`` (layer-wise keys),
  at ``pcp0``/``dcp0`` only. Role and family stay completeness dimensions: they are per
  group in every release (``infer_group_cache_families``; the role is always ``kv``), and
  the role exists to tell apart kv and state objects of the *same* block, which a load needs
  both of. ``H``/``P``/``L`` are one more than the largest value seen for that unit, role and
  family, unless pinned for the model (``ingest.l3.models``). Keys of other pcp/dcp shards
  (and heads, pp ranks or layers beyond a pin) do not count toward completeness but still
  place a complete block on a segment.

:func:`unmappable_units` finds the groups whose hashes cannot be vLLM's (vllm-ascend
v0.21–v0.24's grouped sha256 rehash, docs/l3-poller.md "KV-cache groups").
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from common.config import model_basename
from services.l3_poller.keys_parser import U64_MASK, AnyNamespace, AscendNamespace


@dataclass(frozen=True)
class ModelPin:
    """Counts given in config for one model; 0 = inferred from the keys seen."""

    heads: int = 0
    pp_ranks: int = 0
    layers: int = 0


@dataclass
class Requirements:
    required: dict[int, int]
    """Namespace id → its unit id, for the namespaces that count toward completeness."""
    need: dict[int, int]
    """Unit id → how many required namespaces a block must have keys in (every unit seen)."""
    extra: set[int]
    """Units with seen namespaces that do not count (other shards, beyond a pin)."""


def requirements(
    ns_ids: Iterable[int],
    info: Sequence[AnyNamespace],
    unit_of: Sequence[int],
    pins: Mapping[str, ModelPin],
) -> Requirements:
    """Requirements from the namespaces ``ns_ids`` (those seen within the memory window);
    ``unit_of`` maps a namespace id to its unit (deployment and KV-cache group)."""
    out = Requirements({}, {}, set())
    classes: dict[tuple[int, str, str], list[int]] = {}
    ascend: list[int] = []
    model_of: dict[int, str] = {}
    for ns in ns_ids:
        parsed, unit = info[ns], unit_of[ns]
        if not isinstance(parsed, AscendNamespace):
            out.required[ns] = unit
            out.need[unit] = out.need.get(unit, 0) + 1
            continue
        ascend.append(ns)
        model_of[unit] = parsed.model
        top = classes.setdefault((unit, parsed.role, parsed.family), [-1, -1, -1])
        top[0], top[1], top[2] = (
            max(top[0], parsed.head),
            max(top[1], parsed.pp),
            max(top[2], parsed.layer),
        )
    bounds: dict[tuple[int, str, str], tuple[int, int, int]] = {}
    for cls, (head, pp, layer) in classes.items():
        pin = pins.get(model_of[cls[0]], ModelPin())
        h = pin.heads or head + 1
        p = (pin.pp_ranks or pp + 1) if pp >= 0 else 1
        ly = (pin.layers or layer + 1) if layer >= 0 else 1
        bounds[cls] = (h, p, ly)
        out.need[cls[0]] = out.need.get(cls[0], 0) + h * p * ly
    for ns in ascend:
        parsed, unit = info[ns], unit_of[ns]
        assert isinstance(parsed, AscendNamespace)
        h, p, ly = bounds[(unit, parsed.role, parsed.family)]
        if (
            parsed.pcp == 0
            and parsed.dcp == 0
            and parsed.head < h
            and parsed.pp < p
            and parsed.layer < ly
        ):
            out.required[ns] = unit
        else:
            out.extra.add(unit)
    return out


REHASH_FORMS = frozenset({"C", "E-LW"})
"""vllm-ascend key layouts that releases v0.21–v0.24 write (shared with v0.20.2rc1 normal
keys and v0.25.1rc1+): the only ones whose coarse groups may hold a grouped sha256 rehash
(``_rehash_block_hash_group``) instead of a vLLM block hash. vLLM's in-tree connector
(0.22–0.23 concatenation, later the boundary hash), v0.13–v0.19 (one group) and v0.20.2rc1
layer-wise keys (``C-LW``, concatenation) always carry a block hash."""


def may_rehash(ns: AnyNamespace) -> bool:
    """True for namespaces of a layout whose group hashes :func:`unmappable_units` checks."""
    return isinstance(ns, AscendNamespace) and ns.form in REHASH_FORMS


def unmappable_units(
    keys: Iterable[int], unit_of: Sequence[int], candidates: Mapping[int, int]
) -> dict[int, int]:
    """The units (KV-cache groups) of ``candidates`` (unit → deployment: groups of deployments
    of a :data:`REHASH_FORMS` layout that have keys in at least two groups) none of whose
    block hashes is also a block hash of another group of the same deployment → how many of
    ``keys`` (``namespace << 64 | u64``) they hold.

    Every group publishes hashes of one chain: in a mappable release a group's key at a
    position carries the chain hash there, the very value any other group stored at that
    position carries too, and a hit needs every group's block at its end (vLLM's and
    vllm-ascend's coordinators). A grouped rehash is a value of no chain: such a group shares
    nothing. When two groups share nothing, which of them was rehashed cannot be told from
    the keys, so both are reported; either way the hybrid's hit from them is 0."""
    owner: dict[int, int] = {}
    shared: set[int] = set()
    held: dict[int, int] = dict.fromkeys(candidates, 0)
    for ck in keys:
        unit = unit_of[ck >> 64]
        dep = candidates.get(unit)
        if dep is None:
            continue
        held[unit] += 1
        hk = dep << 64 | ck & U64_MASK
        first = owner.setdefault(hk, unit)
        if first != unit:
            shared.add(first)
            shared.add(unit)
    return {unit: n for unit, n in held.items() if unit not in shared and n}


def pins_by_model(models: Iterable[tuple[str, int, int, int]]) -> dict[str, ModelPin]:
    """``(name, heads, ppRanks, layers)`` from config → pins keyed by the key's model field."""
    return {model_basename(name): ModelPin(heads, pp, layers) for name, heads, pp, layers in models}
