"""Which object namespaces a block needs before an engine can load it from Mooncake.

A *deployment* is what one engine's keys share: ``("vllm", head)`` for vLLM's in-tree
connector, ``("vllm-ascend", form, model)`` for vllm-ascend (see
:mod:`~services.l3_poller.keys_parser`). Given the namespaces of a master seen recently,
:func:`requirements` says, per deployment, how many namespaces a block needs and which of
the seen ones count toward that number:

* ``vllm``: every namespace seen (tp × pcp × dcp × pp × group as observed).
* ``vllm-ascend``, like the engine's own lookup (``lookup_scheduler`` / v0.23+ scheduler
  side): per KV-cache group (``group``, ``cache_role``, ``cache_family``) the head
  namespaces ``0..H-1`` × pp ranks ``0..P-1`` (normal keys) or × layers ``0..L-1``
  (layer-wise keys), at ``pcp0``/``dcp0`` only. ``H``/``P``/``L`` are one more than the
  largest value seen for that deployment and group, unless pinned for the model
  (``ingest.l3.models``). Keys of other pcp/dcp shards (and heads, pp ranks or layers beyond
  a pin) do not count toward completeness but still place a complete block on a segment.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from common.config import model_basename
from services.l3_poller.keys_parser import AnyNamespace, AscendNamespace


@dataclass(frozen=True)
class ModelPin:
    """Counts given in config for one model; 0 = inferred from the keys seen."""

    heads: int = 0
    pp_ranks: int = 0
    layers: int = 0


@dataclass
class Requirements:
    required: dict[int, int]
    """Namespace id → its deployment id, for the namespaces that count toward completeness."""
    need: dict[int, int]
    """Deployment id → how many required namespaces a block must have keys in."""
    extra: set[int]
    """Deployments with seen namespaces that do not count (other shards, beyond a pin)."""


def requirements(ns_ids: Iterable[int], info: Sequence[AnyNamespace], dep_of: Sequence[int],
                 pins: Mapping[str, ModelPin]) -> Requirements:
    """Requirements from the namespaces ``ns_ids`` (those seen within the memory window)."""
    out = Requirements({}, {}, set())
    groups: dict[tuple[int, tuple[int, str, str]], list[int]] = {}
    ascend: list[int] = []
    model_of: dict[int, str] = {}
    for ns in ns_ids:
        parsed = info[ns]
        if not isinstance(parsed, AscendNamespace):
            out.required[ns] = dep_of[ns]
            out.need[dep_of[ns]] = out.need.get(dep_of[ns], 0) + 1
            continue
        ascend.append(ns)
        model_of[dep_of[ns]] = parsed.model
        key = (dep_of[ns], (parsed.group, parsed.role, parsed.family))
        top = groups.setdefault(key, [-1, -1, -1])
        top[0], top[1], top[2] = (max(top[0], parsed.head), max(top[1], parsed.pp),
                                  max(top[2], parsed.layer))
    bounds: dict[tuple[int, tuple[int, str, str]], tuple[int, int, int]] = {}
    for (dep, group), (head, pp, layer) in groups.items():
        pin = pins.get(model_of[dep], ModelPin())
        h = pin.heads or head + 1
        p = (pin.pp_ranks or pp + 1) if pp >= 0 else 1
        ly = (pin.layers or layer + 1) if layer >= 0 else 1
        bounds[(dep, group)] = (h, p, ly)
        out.need[dep] = out.need.get(dep, 0) + h * p * ly
    for ns in ascend:
        parsed = info[ns]
        assert isinstance(parsed, AscendNamespace)
        dep = dep_of[ns]
        h, p, ly = bounds[(dep, (parsed.group, parsed.role, parsed.family))]
        if (parsed.pcp == 0 and parsed.dcp == 0 and parsed.head < h and parsed.pp < p
                and parsed.layer < ly):
            out.required[ns] = dep
        else:
            out.extra.add(dep)
    return out


def pins_by_model(models: Iterable[tuple[str, int, int, int]]) -> dict[str, ModelPin]:
    """``(name, heads, ppRanks, layers)`` from config → pins keyed by the key's model field."""
    return {model_basename(name): ModelPin(heads, pp, layers)
            for name, heads, pp, layers in models}
