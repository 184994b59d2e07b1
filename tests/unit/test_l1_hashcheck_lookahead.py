"""The self-check on lookahead events (vLLM >= 0.33 with EAGLE/MTP): each block re-hashed with
the instance's own L, from the tokens the event publishes after it.

Events: the ``block_stored_event`` of every case of tests/data/extra-keys/lookahead_*.json,
as vLLM's own ``BlockPool.cache_full_blocks`` emitted it (token ids from the case's prompt).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from common.blockhash import HashSettings
from common.events import BlockStored
from services.l1_ingest.hashcheck import MISMATCH, OK, UNCHECKED, HashChecker
from tests.conftest import DATA

RELEASES = ("0.33.0", "0.34.0")


def cases(release: str) -> list[dict[str, Any]]:
    doc = json.loads((DATA / "extra-keys" / f"lookahead_{release}.json").read_text())
    return [c for c in doc["cases"] if c["block_stored_event"] is not None]


def event_of(case: dict[str, Any], **changes: Any) -> BlockStored:
    ev = case["block_stored_event"]
    fields: dict[str, Any] = {
        "block_hashes": ev["block_hashes"],
        "parent_block_hash": ev["parent_block_hash"],
        "token_ids": case["token_ids"][: ev["n_token_ids"]],
        "block_size": ev["block_size"],
        "medium": "GPU",
        "lora_name": ev["lora_name"],
        "extra_keys": ev["extra_keys"],
        "lookahead_token_ids": ev["lookahead_token_ids"],
    }
    return BlockStored(**(fields | changes))


def checker(case: dict[str, Any], release: str) -> HashChecker:
    settings = HashSettings.from_strings(case["algo"], case["seed"], release)
    return HashChecker("10.0.0.1", settings, 100_000)


@pytest.mark.parametrize("release", RELEASES)
def test_every_lookahead_event_checks_ok_or_is_named_uncheckable(release: str) -> None:
    """Every block verifies with the event's own L, except LoRA blocks (>= 0.31 hashes the
    adapter's path, which events do not carry): unchecked, never a mismatch."""
    checked = 0
    for case in cases(release):
        check = checker(case, release)
        check.offer([event_of(case)])
        if case["lora"]:
            assert (check.verdict, dict(check.unchecked)) == (UNCHECKED, {"lora_path": 1})
            continue
        assert (check.verdict, check.ok, check.mismatch) == (
            OK,
            len(case["block_hashes_event_int"]),
            0,
        ), case["name"]
        checked += 1
    assert checked >= 10


@pytest.mark.parametrize("release", RELEASES)
def test_a_block_hashed_without_its_lookahead_is_a_mismatch(release: str) -> None:
    """Guards the rule: dropping the published tokens (L = 0) or keeping one too few hashes
    something else than vLLM did."""
    case = next(c for c in cases(release) if c["name"] == "la2_text_48")
    ev = case["block_stored_event"]
    for lookahead in (None, [tokens[:1] for tokens in ev["lookahead_token_ids"]]):
        check = checker(case, release)
        check.offer([event_of(case, lookahead_token_ids=lookahead)])
        assert check.verdict == MISMATCH and check.ok == 0
    misaligned = checker(case, release)
    misaligned.offer([event_of(case, lookahead_token_ids=ev["lookahead_token_ids"][:1])])
    assert dict(misaligned.unchecked) == {"lookahead_misaligned": 1}
