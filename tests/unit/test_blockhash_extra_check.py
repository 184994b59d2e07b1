"""``blockhash_extra.check`` (what the API's request parsing and the ``hash`` command ask
before hashing) refuses exactly what ``plan`` refuses, with its sentence (issue 33, mutmut
survivors of ``common/blockhash_extra.py``): the LoRA path required from 0.31 on, lookahead
accepted from 0.33.0 itself, and the messages a 400 shows."""

from __future__ import annotations

import re

import pytest

from common.blockhash import BlockHasher, HashSettings
from common.blockhash_extra import MAX_MM_ITEMS, HashInputs, MmItem, check, plan

MAX_LOOKAHEAD = 64  # documented (docs/api.md): the limit itself, not read from the module

LOOKAHEAD_REFUSED = "vLLM < 0.33 does not hash lookahead tokens (lookahead must be 0)"


def _refusal(call: object) -> str | None:
    try:
        call()  # type: ignore[operator]
    except ValueError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize(
    ("version", "inputs", "refusal"),
    [
        ((0, 31, 0), HashInputs(lora_name="a"), "lora_path is required"),
        ((0, 30, 9), HashInputs(lora_name="a"), None),
        ((0, 31, 0), HashInputs(lora_name="a", lora_path="/p"), None),
        ((0, 33, 0), HashInputs(lookahead=2), None),
        ((0, 32, 9), HashInputs(lookahead=2), re.escape(LOOKAHEAD_REFUSED)),
        (
            (0, 11, 0),
            HashInputs(lora_name="a"),
            r"^vLLM 0\.11\.0 keys LoRA blocks by the server-assigned lora_int_id, which cannot be "
            r"derived from a LoRA name \(LoRA requests are supported from vLLM 0\.11\.1\)$",
        ),
    ],
)
def test_check_refuses_what_plan_refuses_with_the_same_sentence(
    version: tuple[int, int, int], inputs: HashInputs, refusal: str | None
) -> None:
    ids = list(range(10))
    checked = _refusal(lambda: check(version, inputs, len(ids)))
    planned = _refusal(lambda: plan(version, ids, 4, None, inputs))
    assert checked == planned
    if refusal is None:
        assert checked is None
    else:
        assert checked is not None and re.search(refusal, checked), checked
    if version == (0, 32, 9):
        assert checked == LOOKAHEAD_REFUSED


def test_an_item_that_is_no_mm_item_is_named_with_its_type() -> None:
    with pytest.raises(ValueError) as caught:
        HashInputs(mm_items=(MmItem("a", 0, 1), "b"))  # type: ignore[arg-type]
    assert str(caught.value) == "mm_features[1] must be an MmItem, not str"


@pytest.mark.usefixtures("hash_path")
@pytest.mark.parametrize("n_tokens", [0, 1, 5, 6])
def test_a_lookahead_prompt_without_a_block_followed_by_l_tokens_hashes_nothing(
    n_tokens: int,
) -> None:
    """Lookahead 2, blocks of 4: 0 to 5 tokens hash no block (the empty chain is built
    without a block's tail to index); 6 tokens hash one, as vLLM >= 0.33 does."""
    hasher = BlockHasher(HashSettings(vllm_version=(0, 33, 0)))
    inputs = HashInputs(lookahead=2)
    digests = hasher.digests(list(range(n_tokens)), 4, inputs=inputs)
    assert len(digests) == (1 if n_tokens == 6 else 0)
    ints = hasher.event_ints(list(range(n_tokens)), 4, inputs=inputs)
    assert ints == [int.from_bytes(d[-8:], "big") for d in digests]


def test_the_limits_are_inclusive_and_a_bad_lora_argument_is_named() -> None:
    """Lookahead 64 and 1,024 items are accepted (65 and 1,025 are not, as documented);
    a non-string ``lora_path`` is named with its type."""
    assert HashInputs(lookahead=MAX_LOOKAHEAD).lookahead == MAX_LOOKAHEAD
    with pytest.raises(ValueError, match=r"lookahead must be an integer in \[0, 64\]"):
        HashInputs(lookahead=MAX_LOOKAHEAD + 1)
    items = tuple(MmItem(f"i{n}", n, 1) for n in range(MAX_MM_ITEMS + 1))
    assert len(HashInputs(mm_items=items[:MAX_MM_ITEMS]).mm_items) == MAX_MM_ITEMS
    with pytest.raises(ValueError, match="1025 items, more than the limit of 1024"):
        HashInputs(mm_items=items)
    with pytest.raises(ValueError) as caught:
        HashInputs(lora_name="a", lora_path=7)  # type: ignore[arg-type]
    assert str(caught.value) == "lora_path must be a string, not int"


def test_a_salt_that_is_no_string_is_named_with_its_type() -> None:
    with pytest.raises(ValueError) as caught:
        plan((0, 31, 0), [1, 2, 3, 4], 4, 5, HashInputs())  # type: ignore[arg-type]
    assert str(caught.value) == "cache_salt must be a string, not int"
