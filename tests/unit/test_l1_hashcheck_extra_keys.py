"""The block-hash self-check on events with LoRA, multimodal, salt and lookahead keys.

Events are built as each release publishes them (spec vllm-extra-keys.md §4, §5) from the
golden extra-keys vectors (tests/data/extra-keys, vLLM's own hasher): 0.17-0.30 publish the
hash-side keys as they are, >= 0.31 the untagged ``event_extra_keys``, before 0.17 nothing;
the lookahead files carry the BlockStored event vLLM's own BlockPool emitted.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from common.blockhash import HashSettings
from common.events import BlockStored
from services.l1_ingest.hashcheck import MISMATCH, OK, UNCHECKED, HashChecker
from tests.conftest import DATA

FILES = sorted((DATA / "extra-keys").glob("*.json"))
DOCS = [json.loads(p.read_text(encoding="utf-8")) for p in FILES]


def _params(lookahead: bool) -> list[Any]:
    return [
        pytest.param(case, id=f"{doc['release']}-{case['name']}")
        for doc in DOCS
        for case in doc["cases"]
        if ("lookahead_tokens" in case) == lookahead and case["block_hashes_event_int"]
    ]


def _version(case: dict[str, Any]) -> tuple[int, int, int]:
    major, minor, patch = (int(p) for p in case["release"].split("."))
    return major, minor, patch


def _checker(case: dict[str, Any], release: tuple[int, int, int] | None = None) -> HashChecker:
    settings = HashSettings(case["algo"], case["seed"], release or _version(case))
    return HashChecker("10.0.0.9", settings, 1e9)


def _published(case: dict[str, Any], release: tuple[int, int, int]) -> BlockStored:
    """The case's blocks as one root BlockStored of ``release``."""
    n, size = len(case["block_hashes_event_int"]), case["block_size"]
    lora = (case["lora"] or {}).get("name")
    if release >= (0, 31, 0):
        extra = [b["event_extra_keys"] for b in case["blocks"]]
    else:
        extra = [b["extra_keys"] for b in case["blocks"]]
    return BlockStored(
        block_hashes=case["block_hashes_event_int"],
        parent_block_hash=None,
        token_ids=case["token_ids"][: n * size],
        block_size=size,
        lora_name=lora if release >= (0, 14, 0) else None,
        extra_keys=extra if release >= (0, 17, 0) and any(extra) else None,
    )


@pytest.mark.parametrize("case", _params(lookahead=False))
def test_published_extra_keys_verify_or_are_unchecked(case: dict[str, Any]) -> None:
    release = _version(case)
    if release < (0, 17, 0):
        release = (0, 17, 0)  # 0.12's hashes and keys, published as 0.17 publishes them
    checker = _checker(case, release)
    checker.offer([_published(case, release)])
    assert checker.mismatch == 0, checker.detail
    n = len(case["block_hashes_event_int"])
    if case["lora"] and release >= (0, 31, 0):  # the path is hashed, never published
        assert (checker.verdict, checker.ok, checker.unchecked["lora_path"]) == (UNCHECKED, 0, 1)
    else:
        assert (checker.verdict, checker.ok) == (OK, n)


@pytest.mark.parametrize("case", _params(lookahead=True))
def test_vllm_lookahead_events_verify(case: dict[str, Any]) -> None:
    event = case["block_stored_event"]
    stored = BlockStored(
        block_hashes=event["block_hashes"],
        parent_block_hash=event["parent_block_hash"],
        token_ids=case["token_ids"][: event["n_token_ids"]],
        block_size=event["block_size"],
        lora_name=event["lora_name"],
        extra_keys=event["extra_keys"],
        lookahead_token_ids=event["lookahead_token_ids"],
    )
    checker = _checker(case)
    checker.offer([stored])
    assert checker.mismatch == 0, checker.detail
    if case["lora"]:
        assert (checker.verdict, checker.unchecked["lora_path"]) == (UNCHECKED, 1)
    else:
        assert (checker.verdict, checker.ok) == (OK, len(event["block_hashes"]))


def _case(release: str, name: str) -> dict[str, Any]:
    doc = next(d for d in DOCS if d["release"] == release and d["cases"][0].get("blocks"))
    return next(c for c in doc["cases"] if c["name"] == name)


def test_a_wrong_seed_is_still_a_mismatch_on_keyed_blocks() -> None:
    case = _case("0.28.0", "bs16_mm_at_token0")
    checker = HashChecker("10.0.0.9", HashSettings("sha256_cbor", "1", (0, 28, 0)), 1e9)
    checker.offer([_published(case, (0, 28, 0))])
    assert checker.verdict == MISMATCH and checker.mismatch == 1
    assert "pythonHashSeed '0'" in checker.detail


def test_lookahead_tokens_are_part_of_the_check() -> None:
    """The same event without its lookahead tokens does not verify: they are hashed."""
    case = next(c.values[0] for c in _params(lookahead=True) if not c.values[0]["lora"])
    event = case["block_stored_event"]
    stored = BlockStored(
        block_hashes=event["block_hashes"],
        parent_block_hash=None,
        token_ids=case["token_ids"][: event["n_token_ids"]],
        block_size=event["block_size"],
        extra_keys=event["extra_keys"],
        lookahead_token_ids=[[t + 1 for t in tokens] for tokens in event["lookahead_token_ids"]],
    )
    checker = _checker(case)
    checker.offer([stored])
    assert checker.verdict == MISMATCH


def test_unpublished_keys_before_017_are_unchecked_once_blocks_verified() -> None:
    """0.12 publishes no extra keys: a keyed prompt mismatches what the event shows. Before
    any block verified that is a mismatch (it could be the config); after, it is counted
    unchecked, since seed and algo are proven."""
    keyed, plain = _case("0.12.0", "bs16_mm_at_token0"), _case("0.12.0", "bs16_text_lora_only")
    plain_event = _published(plain, (0, 12, 0))  # 0.12: LoRA not published either
    plain_event = BlockStored(
        block_hashes=_plain_ints(plain),
        parent_block_hash=None,
        token_ids=plain_event.token_ids,
        block_size=16,
    )
    first = _checker(keyed)
    first.offer([_published(keyed, (0, 12, 0))])
    assert first.verdict == MISMATCH
    checker = _checker(keyed)
    checker.offer([plain_event])
    assert (checker.verdict, checker.ok) == (OK, len(plain_event.block_hashes))
    checker.offer([_published(keyed, (0, 12, 0))])
    assert checker.mismatch == 0 and checker.unchecked["extra_keys_unpublished"] == 1
    assert checker.verdict == OK


def _plain_ints(case: dict[str, Any]) -> list[int]:
    from common.blockhash import BlockHasher

    settings = HashSettings(case["algo"], case["seed"], _version(case))
    return BlockHasher(settings).event_ints(case["token_ids"], case["block_size"])
