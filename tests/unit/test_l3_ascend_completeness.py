"""Completeness of vllm-ascend blocks: the index's answer is the engine lookup's answer for
every golden configuration of every release (tests/data/ascend/golden_keys.json), with one
documented exception; counts are inferred or pinned per model."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from typing import Any

import pytest

from common.config import model_basename
from services.l3_poller.completeness import ModelPin, pins_by_model
from services.l3_poller.index import MasterIndex, SegmentMap
from services.l3_poller.keys_parser import AscendNamespace
from tests.conftest import DATA
from tests.keys_oracle import parse_any

GOLDEN = json.loads((DATA / "ascend" / "golden_keys.json").read_text())
NO_SEGMENTS = SegmentMap([], None)


def configs() -> Iterator[tuple[str, str, dict[str, Any]]]:
    for version, vd in GOLDEN["versions"].items():
        for name, cfg in vd["configs"].items():
            yield version, name, cfg


CONFIGS = list(configs())
IDS = [f"{v}-{n}" for v, n, _ in CONFIGS]


def complete(index: MasterIndex, keys: Iterable[str], now: float) -> set[int]:
    index.begin(NO_SEGMENTS)
    assert index.feed([k.encode() for k in keys]) == []
    index.commit(now)
    blocks = index.blocks("pool")
    assert blocks.complete >= len(blocks.pool or ())  # counted per deployment
    return set(blocks.pool or ())


def lookup_hits(cfg: dict[str, Any], present: set[str]) -> set[int]:
    """The blocks the engine's lookup reports for the keys ``present``: the golden list of
    keys it checks, all of a block's must exist (then the prefix up to the first miss)."""
    checked = set(cfg["lookup_scheduler_rank0"]["keys_checked"])
    checked |= set(cfg.get("layerwise_lookup_scheduler_side", {}).get("keys_checked", []))
    u64s = [b["u64"] for b in cfg["block_hashes"]]
    by_block = {u: {k for k in checked if parse_any(k)[1] == u} for u in u64s}  # type: ignore[index]
    hits = set()
    for u in u64s:
        if not by_block[u] <= present:
            break
        hits.add(u)
    return hits


def prefix(blocks: list[int], complete_set: set[int]) -> set[int]:
    out = set()
    for u in blocks:
        if u not in complete_set:
            break
        out.add(u)
    return out


@pytest.mark.parametrize(("version", "name", "cfg"), CONFIGS, ids=IDS)
def test_completeness_gives_the_lookups_answer(
    version: str, name: str, cfg: dict[str, Any]
) -> None:
    keys = [e["key"] for e in cfg["distinct_keys_all_ranks"]]
    u64s = [b["u64"] for b in cfg["block_hashes"]]
    n_hit = cfg["lookup_scheduler_rank0"]["hit_tokens_if_all_exist"] // cfg["connector_block_size"]
    index = MasterIndex(locate=False)
    assert complete(index, keys, now=0) == set(u64s[:n_hit]) == lookup_hits(cfg, set(keys))
    for i, missing in enumerate(keys):  # every key missing in turn (after a full poll)
        present = set(keys) - {missing}
        ours = prefix(u64s, complete(index, present, now=1 + i))
        theirs = lookup_hits(cfg, present)
        ns = parse_any(missing)[0]  # type: ignore[index]
        assert isinstance(ns, AscendNamespace)
        if version == "v0.13.0" and name == "qwen7b_tp2_pp2" and ns.head > 0 and ns.pp > 0:
            # v0.13–v0.17 check heads at pp 0 plus head 0 at each pp, not the product the
            # loader needs (fixed in v0.18.0rc1, PR #7717): stricter here, by design
            assert ours < theirs, missing
        else:
            assert ours == theirs, missing
        complete(index, keys, now=1 + i)  # back to full


def test_layerwise_needs_every_layer_of_every_head() -> None:
    cfg = GOLDEN["versions"]["main"]["configs"]["qwen0.5b_tp2_layerwise"]
    keys = [e["key"] for e in cfg["distinct_keys_all_ranks"]]
    u0, u1 = (b["u64"] for b in cfg["block_hashes"])
    index = MasterIndex(locate=False)
    assert complete(index, keys, 0) == {u0, u1}
    drop = {
        k
        for k in keys
        if "head_or_tp_rank:1@" in k
        and "layer_id:23@" in k
        and k.endswith(cfg["block_hashes"][1]["hex"])
    }
    assert len(drop) == 1
    assert complete(index, set(keys) - drop, 1) == {u0}  # block 1 lost one layer of head 1


def test_a_head_that_vanishes_whole_counts_until_forgotten_unless_pinned() -> None:
    cfg = GOLDEN["versions"]["v0.18.0"]["configs"]["qwen7b_tp2"]
    keys = [e["key"] for e in cfg["distinct_keys_all_ranks"]]
    head0 = [k for k in keys if "head_or_tp_rank:0@" in k]
    u64s = {b["u64"] for b in cfg["block_hashes"]}
    inferred = MasterIndex(locate=False, ns_memory=60)
    pinned = MasterIndex(
        locate=False, ns_memory=60, pins=pins_by_model([("Qwen/Qwen2.5-7B-Instruct", 2, 1, 0)])
    )
    for index in (inferred, pinned):
        assert complete(index, keys, 0) == u64s
        assert complete(index, head0, 30) == set()  # head 1 is remembered
    assert complete(inferred, head0, 100) == u64s  # forgotten: looks like TP1 now
    assert complete(pinned, head0, 100) == set()  # pinned: two heads, always


def test_pins_bound_what_counts() -> None:
    """A pin smaller than what is seen ignores the rest; layers and pp ranks are pinned
    separately (pp does not exist in layer-wise keys)."""
    cfg = GOLDEN["versions"]["v0.20.2rc1"]["configs"]["qwen0.5b_tp2_layerwise"]
    keys = [e["key"] for e in cfg["distinct_keys_all_ranks"]]
    u64s = {b["u64"] for b in cfg["block_hashes"]}
    few_layers = MasterIndex(locate=False, pins={"Qwen2.5-0.5B-Instruct": ModelPin(2, 7, 12)})
    upper = [k for k in keys if int(k.rsplit("@", 1)[1]) >= 12]
    assert complete(few_layers, set(keys) - {upper[0]}, 0) == u64s
    more_layers = MasterIndex(locate=False, pins={"Qwen2.5-0.5B-Instruct": ModelPin(0, 0, 28)})
    assert complete(more_layers, keys, 0) == set()


def test_deployments_are_judged_separately() -> None:
    """vLLM and vllm-ascend keys, and two layouts of one model, on one master."""
    hexes = [f"{i + 1:064x}" for i in range(3)]
    tp2_vllm = [f"M@tp_rank:{r}@pcp0@dcp0@pp_rank:0@group:0@{h}" for h in hexes for r in (0, 1)]
    tp1_a = [f"M@pcp0@dcp0@head_or_tp_rank:0@pp_rank:0@{h}" for h in hexes]
    tp2_c = [
        f"M@pcp0@dcp0@head_or_tp_rank:{r}@pp_rank:0@group:0@cache_role:kv@cache_family:default@{h}"
        for h in hexes[:2]
        for r in (0, 1)
    ]
    tp2_c.remove(tp2_c[-1])  # block 1 of the v0.20 deployment lost head 1
    index = MasterIndex(locate=False)
    got = complete(index, tp2_vllm[:-1] + tp1_a + tp2_c, 0)
    assert got == {1, 2, 3}  # vLLM: 1, 2 complete; A: all; C: block 1 only
    assert complete(MasterIndex(locate=False), tp2_c, 0) == {1}


def groups_of(index: MasterIndex, keys: Iterable[str], now: float) -> dict[int, set[int]]:
    complete(index, keys, now)
    return {g: set(b.pool or ()) for g, b in index.blocks("pool").by_group() if b.pool}


def test_groups_are_sets_and_only_pcp0_dcp0_counts() -> None:
    h = f"{7:064x}"
    base = "M@pcp{p}@dcp{d}@head_or_tp_rank:0@pp_rank:0@group:{g}@cache_role:kv@cache_family:{f}@"
    g0, g1 = base.format(p=0, d=0, g=0, f="default") + h, base.format(p=0, d=0, g=1, f="c4") + h
    shard = base.format(p=0, d=1, g=0, f="default") + h
    index = MasterIndex(locate=False)
    assert groups_of(index, [g0, g1, shard], 0) == {0: {7}, 1: {7}}
    assert groups_of(index, [g0, shard], 1) == {0: {7}}  # group 1 missing: group 0 stands
    assert groups_of(index, [g0, g1], 2) == {0: {7}, 1: {7}}  # the lookup ignores dcp1
    assert groups_of(index, [shard, g1], 3) == {1: {7}}  # dcp1 alone is no block


def test_role_and_family_are_needed_within_a_group() -> None:
    """Within one group a block needs every (cache_role, cache_family) seen: the role tells
    apart kv and state objects of the same block, and the load needs both."""
    h = f"{9:064x}"
    base = "M@pcp0@dcp0@head_or_tp_rank:{r}@pp_rank:0@group:1@cache_role:{role}@cache_family:c4@"
    kv = [base.format(r=r, role="kv") + h for r in (0, 1)]
    state = base.format(r=0, role="state") + h
    group0 = "M@pcp0@dcp0@head_or_tp_rank:0@pp_rank:0@group:0@cache_role:kv@cache_family:default@"
    others = [group0 + h]
    index = MasterIndex(locate=False)
    assert groups_of(index, [*others, *kv, state], 0) == {0: {9}, 1: {9}}
    assert groups_of(index, [*others, *kv], 1) == {0: {9}}  # the state object is missing
    assert groups_of(index, [*others, kv[0], state], 2) == {0: {9}}  # head 1's kv missing


def test_basename_of_pins() -> None:
    assert model_basename("/data/models/Qwen2.5-7B-Instruct/") == "Qwen2.5-7B-Instruct"
    assert pins_by_model([("Qwen/Qwen2.5-7B-Instruct", 2, 1, 0)]) == {
        "Qwen2.5-7B-Instruct": ModelPin(2, 1, 0)
    }
