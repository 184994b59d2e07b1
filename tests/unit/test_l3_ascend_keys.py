"""vllm-ascend AscendStoreConnector keys: every golden key of v0.13.0, v0.18.0, v0.20.2rc1 and
main (made by the real vllm-ascend code, tests/data/ascend/golden_keys.json) parses to the
right model, head, pp, layer, group and u64; junk and near-misses do not."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from services.l3_poller.keys_parser import (
    AscendNamespace,
    Namespace,
    parse_prefix,
)
from services.l3_poller.index import MasterIndex
from tests.conftest import DATA
from tests.keys_oracle import parse_any, split_key

GOLDEN = json.loads((DATA / "ascend" / "golden_keys.json").read_text())
HEX = "c855341b2e1b326d809910c2e0436b041b100e770eff5ac15ded46c5eacf99b4"
U64 = 6768143630869698996
FORMS = {
    "v0.13.0": ("A", "A-LW"),
    "v0.18.0": ("A", "A-LW"),
    "v0.20.2rc1": ("C", "C-LW"),
    "main": ("C", "E-LW"),
}


def configs() -> Iterator[tuple[str, str, dict[str, Any]]]:
    for version, vd in GOLDEN["versions"].items():
        for name, cfg in vd["configs"].items():
            yield version, name, cfg


@pytest.mark.parametrize(
    ("version", "name", "cfg"), list(configs()), ids=[f"{v}-{n}" for v, n, _ in configs()]
)
def test_every_golden_key_parses_to_its_fields(
    version: str, name: str, cfg: dict[str, Any]
) -> None:
    model = cfg["model"].rstrip("/").split("/")[-1]
    form = FORMS[version][1 if cfg["use_layerwise"] else 0]
    n = 0
    for rank in cfg["ranks"]:
        dcp = rank["tp_rank"] % cfg["dcp"] if cfg["dcp"] > 1 else 0
        for entry in rank["key_namespace"]:
            parsed = parse_any(entry["key"])
            assert parsed is not None, entry["key"]
            ns, u64 = parsed
            assert isinstance(ns, AscendNamespace)
            assert u64 == entry["u64"] == cfg["block_hashes"][entry["block"]]["u64"]
            assert (ns.model, ns.form, ns.head, ns.pcp, ns.dcp, ns.group, ns.role, ns.family) == (
                model,
                form,
                rank["head_or_tp_rank"],
                0,
                dcp,
                0,
                "kv",
                "default",
            )
            if cfg["use_layerwise"]:
                assert ns.pp == -1 and ns.layer == entry["layer"]
                assert 0 <= ns.layer < rank["num_layers_on_rank"]
            else:
                assert ns.pp == rank["pp_rank"] and ns.layer == -1
            n += 1
    checked = cfg["lookup_scheduler_rank0"]["keys_checked"]
    checked += cfg.get("layerwise_lookup_scheduler_side", {}).get("keys_checked", [])
    for key in checked + [e["key"] for e in cfg["distinct_keys_all_ranks"]]:
        assert parse_any(key) is not None, key
    assert n > 0


@pytest.mark.parametrize(
    ("version", "name", "cfg"), list(configs()), ids=[f"{v}-{n}" for v, n, _ in configs()]
)
def test_the_pollers_inlined_parse_agrees_on_every_golden_key(
    version: str, name: str, cfg: dict[str, Any]
) -> None:
    """MasterIndex.feed inlines split_key for speed: it must give parse_any's answer."""
    keys = {e["key"] for rank in cfg["ranks"] for e in rank["key_namespace"]}
    index = MasterIndex()
    fed = dict(index.feed(k.encode() for k in keys))
    assert set(fed) == {k.encode() for k in keys} and index.stats.parsed == len(keys)
    for key in keys:
        ns, u64 = parse_any(key)  # type: ignore[misc]
        ck = fed[key.encode()]
        assert (index._ns_info[ck >> 64], ck & ((1 << 64) - 1)) == (ns, u64), key


def test_the_spec_examples() -> None:
    cases = {
        f"Qwen2.5-1.5B-Instruct@pcp0@dcp0@head_or_tp_rank:1@pp_rank:0@{HEX}": AscendNamespace(
            "Qwen2.5-1.5B-Instruct", "A", 0, 0, 1, 0, 0, "kv", "default", -1
        ),
        f"Qwen2.5-0.5B-Instruct@pcp0@dcp0@head_or_tp_rank:1@{HEX}@1": AscendNamespace(
            "Qwen2.5-0.5B-Instruct", "A-LW", 0, 0, 1, -1, 0, "kv", "default", 1
        ),
        (
            f"Qwen2.5-1.5B-Instruct@pcp0@dcp0@head_or_tp_rank:1@pp_rank:0@group:0@cache_role:kv"
            f"@cache_family:default@{HEX}"
        ): AscendNamespace("Qwen2.5-1.5B-Instruct", "C", 0, 0, 1, 0, 0, "kv", "default", -1),
        (
            f"Qwen2.5-0.5B-Instruct@pcp0@dcp0@head_or_tp_rank:1@group:0@cache_role:kv"
            f"@cache_family:default@{HEX}@1"
        ): AscendNamespace("Qwen2.5-0.5B-Instruct", "C-LW", 0, 0, 1, -1, 0, "kv", "default", 1),
        (
            f"Qwen2.5-0.5B-Instruct@pcp0@dcp0@head_or_tp_rank:1@group:0@cache_role:kv"
            f"@cache_family:default@layer_id:1@{HEX}"
        ): AscendNamespace("Qwen2.5-0.5B-Instruct", "E-LW", 0, 0, 1, -1, 0, "kv", "default", 1),
        # DeepSeek-V4 style second group with another cache family; pcp/dcp shards
        (
            f"DeepSeek-V4@pcp1@dcp3@head_or_tp_rank:0@pp_rank:2@group:1@cache_role:kv"
            f"@cache_family:c4@{HEX}"
        ): AscendNamespace("DeepSeek-V4", "C", 1, 3, 0, 2, 1, "kv", "c4", -1),
        # a model basename with @ and dots
        f"my@model.v2@pcp0@dcp0@head_or_tp_rank:0@pp_rank:0@{HEX}": AscendNamespace(
            "my@model.v2", "A", 0, 0, 0, 0, 0, "kv", "default", -1
        ),
    }
    for key, expected in cases.items():
        assert parse_any(key) == (expected, U64), key


def test_layer_id_is_never_taken_for_the_hash() -> None:
    """Old layer-wise keys end in the layer id: the hash is the field before it."""
    prefix, layer, u64 = split_key(f"M@pcp0@dcp0@head_or_tp_rank:0@{HEX}@23".encode())  # type: ignore[misc]
    assert (prefix, layer, u64) == (b"M@pcp0@dcp0@head_or_tp_rank:0", b"23", U64)
    assert split_key(f"M@pcp0@dcp0@head_or_tp_rank:0@{HEX}@2x".encode()) is None
    assert split_key(b"M@pcp0@dcp0@head_or_tp_rank:0@abc@23") is None


def test_any_hex_length_from_16() -> None:
    """v0.20.2rc1 groups hashes by concatenation (64·k hex); the u64 is the last 16 digits."""
    long_hex = "ab" * 64 + HEX
    key = (
        f"M@pcp0@dcp0@head_or_tp_rank:0@pp_rank:0@group:1@cache_role:kv@cache_family:c4@{long_hex}"
    )
    assert parse_any(key) is not None and parse_any(key)[1] == U64  # type: ignore[index]
    assert parse_any(f"M@pcp0@dcp0@head_or_tp_rank:0@pp_rank:0@{HEX[-16:]}") is not None
    assert parse_any(f"M@pcp0@dcp0@head_or_tp_rank:0@pp_rank:0@{HEX[-15:]}") is None
    vllm = parse_any(f"M@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@{long_hex}")
    assert vllm == (Namespace("M", 0, 0, 0, 0, 0), U64)


@pytest.mark.parametrize(
    "junk",
    [
        f"M@pcp0@dcp0@head_or_tp_rank:0@{HEX}",  # no pp and no layer: no release writes that
        f"M@pcp0@dcp0@head_or_tp_rank:0@pp_rank:0@{HEX}@3",  # old layer-wise never has pp
        f"M@pcp0@dcp0@head_or_tp_rank:0@pp_rank:0@group:0@cache_role:kv@cache_family:default"
        f"@layer_id:1@{HEX}",  # new layer-wise never has pp
        f"M@pcp0@dcp0@head_or_tp_rank:0@layer_id:1@{HEX}",  # layer_id comes with a group
        f"M@pcp0@dcp0@head_or_tp_rank:0@group:0@cache_role:kv@cache_family:default@layer_id:1"
        f"@{HEX}@1",  # both layer spellings
        f"M@pcp0@dcp0@head_or_tp_rank:0@pp_rank:0@group:0@{HEX}",  # group without role/family
        f"M@pcp0@dcp0@head_or_tp_rank:x@pp_rank:0@{HEX}",
        f"@pcp0@dcp0@head_or_tp_rank:0@pp_rank:0@{HEX}",  # no model
        f"M@dcp0@pcp0@head_or_tp_rank:0@pp_rank:0@{HEX}",  # fields out of order
        f"M@pcp0@dcp0@head_or_tp_rank:0@pp_rank:0@{HEX.upper()}",
        # the legacy v0.11 store (own token hash, not a vLLM block hash): not indexable
        f"Qwen/Qwen2.5-7B-Instruct@2@0@{HEX}",
        f"Qwen/Qwen2.5-7B-Instruct@2@0@{HEX}@5",
    ],
)
def test_near_misses_are_not_keys(junk: str) -> None:
    assert parse_any(junk) is None


def test_formats_narrow_the_families() -> None:
    ascend = f"M@pcp0@dcp0@head_or_tp_rank:0@pp_rank:0@{HEX}"
    vllm = f"M@tp_rank:0@pcp0@dcp0@pp_rank:0@{HEX}"
    assert parse_any(ascend, ("vllm",)) is None and parse_any(vllm, ("vllm",)) is not None
    assert parse_any(vllm, ("vllm-ascend",)) is None
    assert parse_any(ascend, ("vllm-ascend",)) is not None
    assert parse_prefix("M@tp_rank:0@pcp0@dcp0@pp_rank:0", "3") is None  # vLLM has no layer
