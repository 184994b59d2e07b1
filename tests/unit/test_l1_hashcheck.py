"""The L1 block-hash self-check against events made by vLLM itself and by the simulator's model.

vLLM data: tests/data/vllm_golden.json (0.28.0, seed "0", LoRA + salt) and
tests/data/vllm_event_vectors.json (0.28.0 KVCacheManager + ZmqEventPublisher, seed "1",
both algos; scripts/make_vllm_event_vectors.py).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from common.blockhash import BlockHasher, HashSettings
from common.events import BlockStored, Event, decode_batch
from services.l1_ingest.hashcheck import (
    MISMATCH,
    OK,
    UNCHECKED,
    HashChecker,
)
from services.l1_ingest.hashcheck_keys import TAGGED, UNTAGGED, Uncheckable, hash_side_keys
from services.l1_ingest.metrics import IngestMetrics
from services.simulator.cache_model import PrefixCacheModel, Request
from tests.conftest import DATA
from tests.metrics_oracle import value_of


def _vectors() -> dict[str, Any]:
    return dict(json.loads((DATA / "vllm_event_vectors.json").read_text()))


def _captured(algo: str) -> list[Event]:
    capture = next(c for c in _vectors()["captures"] if c["algo"] == algo)
    events: list[Event] = []
    for frame in capture["frames"]:
        events += decode_batch(bytes.fromhex(frame["payload_hex"])).events
    return events


def _golden_events() -> list[Event]:
    doc = json.loads((DATA / "vllm_golden.json").read_text())
    section = doc["versions"]["0.28.0"]["events_int_hashes"]
    events: list[Event] = []
    for step in section["steps"]:
        events += decode_batch(bytes.fromhex(step["payload_hex"])).events
    return events


def _checker(
    seed: str | None = "0",
    algo: str = "sha256_cbor",
    version: str = "0.28.0",
    rate: float = 10_000,
    **kw: Any,
) -> HashChecker:
    return HashChecker("10.0.0.1", HashSettings.from_strings(algo, seed, version), rate, **kw)


@pytest.mark.parametrize("algo", ["sha256_cbor", "sha256"])
def test_vllm_capture_with_the_engine_seed_is_ok(algo: str) -> None:
    checker = _checker(seed="1", algo=algo)
    checker.offer(_captured(algo))
    assert (checker.verdict, checker.mismatch) == (OK, 0)
    assert checker.ok >= 10  # roots, LoRA and salted blocks, and C chained from A's blocks


@pytest.mark.parametrize("algo", ["sha256_cbor", "sha256"])
def test_vllm_capture_with_the_project_default_seed_names_seed_1(algo: str) -> None:
    metrics = IngestMetrics()
    checker = _checker(seed="0", algo=algo, metrics=metrics)
    checker.offer(_captured(algo))
    assert checker.verdict == MISMATCH and checker.ok == 0
    assert checker.detail == (
        f"the engine hashes with pythonHashSeed '1' and {algo}; the config says pythonHashSeed '0'"
    )
    assert value_of(metrics.hash_check_hints, seed="1", algo=algo, extra_keys=UNTAGGED) == 1
    assert value_of(metrics.hash_checks, result=MISMATCH) == checker.mismatch


def test_vllm_capture_with_the_other_algo_names_the_algo() -> None:
    checker = _checker(seed="1", algo="sha256")
    checker.offer(_captured("sha256_cbor"))
    assert checker.verdict == MISMATCH
    assert checker.detail.endswith("the config says prefixCachingHashAlgo sha256")
    assert "pythonHashSeed '1' and sha256_cbor" in checker.detail


def test_golden_lora_and_salt_events_verify() -> None:
    checker = _checker()
    checker.offer(_golden_events())
    assert (checker.verdict, checker.mismatch, checker.ok) == (OK, 0, 9)


def _model_events(version: str, salt: str | None = "tenant-a", **kw: Any) -> list[Event]:
    hasher = BlockHasher(
        HashSettings.from_strings(kw.get("algo", "sha256_cbor"), kw.get("seed", "0"), version)
    )
    model = PrefixCacheModel(64, 16, hasher)
    tokens = tuple(range(100, 164))
    return model.step([Request(tokens, cache_salt=salt)])


def test_tagged_engine_against_an_untagged_config_names_the_rule() -> None:
    checker = _checker(version="0.28.0")
    checker.offer(_model_events("0.34.0"))
    assert checker.verdict == MISMATCH
    assert "tagged extra keys (vLLM >= 0.31)" in checker.detail
    assert checker.detail.endswith("the config says vllmVersion 0.28.0 (untagged extra keys)")
    assert checker.hint is not None and checker.hint.rule == TAGGED


def test_untagged_engine_against_a_tagged_config_names_the_rule() -> None:
    checker = _checker(version="0.34.0")
    checker.offer(_model_events("0.28.0"))
    assert checker.verdict == MISMATCH
    assert checker.hint is not None and checker.hint.rule == UNTAGGED


def test_default_seed_of_new_releases_is_named() -> None:
    checker = _checker(seed="0", version="0.34.0")
    checker.offer(_model_events("0.34.0", salt=None, seed=None))
    assert checker.verdict == MISMATCH
    assert "pythonHashSeed 'vllm-none-hash'" in checker.detail


def test_unknown_seed_says_nothing_plausible_matched() -> None:
    checker = _checker()
    checker.offer(_model_events("0.28.0", seed="not-a-seed-anyone-uses"))
    assert checker.verdict == MISMATCH and checker.hint is None
    assert checker.detail.startswith("no plausible setting reproduces")


def test_budget_bounds_the_blocks_checked() -> None:
    now = [0.0]
    checker = _checker(rate=3, clock=lambda: now[0])
    events = _model_events("0.28.0", salt=None)  # one event, 4 blocks from the root
    checker.offer(events)
    assert checker.ok == 3  # the burst is one second of budget
    checker.offer(events)
    assert checker.ok == 3  # bucket empty: nothing more
    now[0] += 1.0
    checker.offer(events)
    assert checker.ok == 6


def test_unverified_parents_are_not_checked_and_other_groups_are() -> None:
    checker = _checker()
    stored = _model_events("0.28.0", salt=None)[0]
    assert isinstance(stored, BlockStored)
    orphan = BlockStored([stored.block_hashes[1]], 12345, stored.token_ids[16:32], 16)
    checker.offer([orphan])
    assert (checker.verdict, checker.ok, checker.mismatch) == (UNCHECKED, 0, 0)
    other = BlockStored(
        stored.block_hashes[:1],
        None,
        stored.token_ids[:16],
        16,
        group_idx=3,
        kv_cache_spec_kind="full_attention",
    )
    checker.offer([other])
    assert (checker.verdict, checker.ok, checker.mismatch) == (OK, 1, 0)


def _chain(tokens: list[int], unit: int, parent: bytes | None = None) -> list[int]:
    """vLLM's event integers of ``tokens`` chained at ``unit`` (seed "0", sha256_cbor)."""
    from common.blockhash import chain_digests, to_event_int
    from services.l1_ingest.hashcheck_keys import none_hash

    root = parent or none_hash("sha256_cbor", "0")
    digests = chain_digests("sha256_cbor", root, tokens, unit, [None] * (len(tokens) // unit))
    return [to_event_int(d) for d in digests]


TOKENS = list(range(300, 300 + 8 * 16))
SWA = {"group_idx": 0, "kv_cache_spec_kind": "sliding_window", "kv_cache_spec_sliding_window": 32}


def test_sparse_sliding_window_stores_chain_from_a_parent_of_any_group() -> None:
    """vLLM's sliding-window group stores only the kept blocks of a span; the span's parent
    is a block its own group may never have stored, verified through the FA group."""
    h = _chain(TOKENS, 16)
    checker = _checker()
    checker.offer(
        [
            BlockStored(
                h[:4], None, TOKENS[:64], 16, group_idx=1, kv_cache_spec_kind="full_attention"
            )
        ]
    )
    assert checker.ok == 4
    sparse = BlockStored([h[6], h[7]], h[3], TOKENS[64:], 16, **SWA)  # type: ignore[arg-type]
    none_kept = BlockStored([], h[3], TOKENS[64:96], 16, **SWA)  # type: ignore[arg-type]
    checker.offer([none_kept, sparse])
    assert (checker.verdict, checker.ok, checker.mismatch) == (OK, 6, 0)
    bad = BlockStored([h[7], h[6]], h[3], TOKENS[64:], 16, **SWA)  # type: ignore[arg-type]
    checker.offer([bad])  # not in chain order: not a subsequence
    assert checker.verdict == MISMATCH and "KV-cache group 0" in checker.detail


def test_a_null_parent_is_the_root_only_for_full_attention() -> None:
    h = _chain(TOKENS, 16)
    checker = _checker()
    # the first kept block of a later span: vLLM sends no parent (it is not in the group)
    checker.offer([BlockStored([h[5]], None, TOKENS[64:96], 16, **SWA)])  # type: ignore[arg-type]
    assert (checker.verdict, checker.ok, checker.mismatch) == (UNCHECKED, 0, 0)


def test_coarse_blocks_are_checked_at_the_hash_unit() -> None:
    """Block size 64 over a prefix-match unit of 16: the published value of a block is the
    chain's value at 16 at its end, found only when the unit is known."""
    fine = _chain(TOKENS, 16)
    coarse = [fine[3], fine[7]]
    event = BlockStored(coarse, None, TOKENS, 64, group_idx=1, kv_cache_spec_kind="full_attention")
    configured = _checker(hash_unit=16)
    configured.offer([event])
    assert (configured.verdict, configured.ok) == (OK, 2)
    derived = _checker()  # only B = 64 seen: the unit is taken to be 64, which is wrong
    derived.offer([event])
    assert derived.verdict == MISMATCH and "prefixMatchUnit" in derived.detail
    partial = BlockStored(
        [fine[0]], None, TOKENS[:16], 16, group_idx=1, kv_cache_spec_kind="full_attention"
    )
    learns = _checker()  # a partial entry (block_size = h) reveals the unit
    learns.offer([partial, event])
    assert (learns.verdict, learns.ok, learns.unit) == (OK, 3, 16)


def test_lora_on_tagged_releases_is_unchecked_with_a_reason() -> None:
    event = BlockStored(
        [1], None, list(range(16)), 16, lora_name="sql-lora", extra_keys=[["sql-lora"]]
    )
    with pytest.raises(Uncheckable):
        hash_side_keys(event, TAGGED, True)
    checker = _checker(version="0.34.0")
    checker.offer([event])
    assert checker.verdict == UNCHECKED and checker.unchecked["lora_path"] == 1
    assert "lora_path" in checker.detail


def test_hash_side_keys_rules() -> None:
    event = BlockStored([1, 2], None, list(range(32)), 16, extra_keys=[["salt"], None])
    assert hash_side_keys(event, UNTAGGED, True) == [("salt",), None]
    assert hash_side_keys(event, TAGGED, True) == [(("cache_salt", "salt"),), None]
    mm = BlockStored([1], 5, list(range(16)), 16, extra_keys=[[["img", 3]]])
    assert hash_side_keys(mm, TAGGED, False) == [(("mm", "img", 3),)]
    assert hash_side_keys(mm, UNTAGGED, False) == [(("img", 3),)]
