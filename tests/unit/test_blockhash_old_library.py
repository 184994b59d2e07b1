"""A C library built from an older ``_cbor_blocks.c`` (no per-block tails) leaves keyed
requests to the Python chain, which must hash every input the C chain would: the salt too.

Issue 33 (mutation testing of ``common/blockhash.py``): the cache salt dropped on that
fallback passed the suite, whose older-library test sends no salt
(``test_blockhash_native.py::test_a_library_that_cannot_take_block_tails_is_not_given_any``).
"""

from __future__ import annotations

import copy

import pytest

from common import blockhash_native as native
from common.blockhash import BlockHasher, HashInputs, HashSettings, MmItem
from tests.conftest import require


@pytest.mark.parametrize(
    "inputs",
    [
        HashInputs(mm_items=(MmItem("img", 20, 30),)),
        HashInputs("a", "/p", (MmItem("img", 3, 4),)),
        HashInputs(lookahead=3),
    ],
    ids=["image", "lora-image", "lookahead"],
)
def test_the_python_fallback_of_an_older_library_keeps_the_salt(inputs: HashInputs) -> None:
    saved = native.ENCODER
    require(
        saved is not None and saved.sha is not None and saved.block_tails,
        f"the C chain with per-block tails is not built ({native.status()})",
    )
    old = copy.copy(saved)
    old.block_tails = False  # what blockhash_native reports for a library without them
    hasher = BlockHasher(HashSettings(vllm_version=(0, 34, 0)))
    tokens = list(range(100))
    want = hasher.digests(tokens, 16, "tenant-a", inputs=inputs)  # the C chain, with tails
    assert want != hasher.digests(tokens, 16, inputs=inputs)  # the salt is hashed
    native.ENCODER = old
    try:
        assert hasher.digests(tokens, 16, "tenant-a", inputs=inputs) == want
        assert hasher.event_ints(tokens, 16, "tenant-a", inputs=inputs) == [
            int.from_bytes(d[-8:], "big") for d in want
        ]
    finally:
        native.ENCODER = saved
