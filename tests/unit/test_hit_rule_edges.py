"""common.hit_rule at edges its other tests left open (found by mutation testing, issue 33).

Each test names the plausible wrong version it kills; each was applied by hand and seen to
fail (docs/testing.md, "Issue 33", the hit rule's survivors).
"""

from __future__ import annotations

import numpy as np
import pytest

from common.hit_rule import GroupSpec, build_rule, hit_tokens, probe_indices, last_token_bound
from tests.unit.test_hit_rule import SHAPES


@pytest.mark.parametrize("version", [(0, 26), (0, 27)])
def test_an_unknown_kind_off_the_hash_unit_turns_partial_hits_off_without_refusing(
    version: tuple[int, int],
) -> None:
    """vLLM 0.26/0.27 assert only for a sliding-window or chunked-local group whose block is
    not the hash unit; a group of unknown kind there just keeps partial hits off (the lower
    bound). Kills ``or`` for ``and`` and ``not in`` for ``in`` in ``_auto_partial``'s refusal."""
    rule = build_rule([GroupSpec("mamba", 64), GroupSpec("new_kind", 32)], 16, vllm_version=version)
    assert rule.partial_hits is False
    assert rule.alignment == 64
    with pytest.raises(ValueError, match="asserts on every lookup"):
        build_rule(
            [GroupSpec("mamba", 64), GroupSpec("sliding_window", 32, 64)], 16, vllm_version=version
        )
    # the unknown kind at the hash unit does not block them
    assert build_rule(
        [GroupSpec("mamba", 64), GroupSpec("new_kind", 16)], 16, vllm_version=version
    ).partial_hits


def test_a_length_of_one_unit_is_a_fixed_point_only_if_every_class_accepts_it() -> None:
    """h = 1, three classes: after the first pass the Mamba state leaves 1 token, which the
    sliding window (its block 0 missing) does not accept, so the second pass ends at 0. Kills
    the fixed point's exit at ``cur == 1`` instead of ``cur == 0``."""
    groups = [
        GroupSpec("full_attention", 1),
        GroupSpec("sliding_window", 1, 3),  # needs the 2 blocks before L
        GroupSpec("mamba", 1),
    ]
    rule = build_rule(groups, 1)
    n = 7  # bound 6
    fa = [1] * n
    swa = [0, 0, 0, 1, 1, 0, 0]  # accepts L = 5 (blocks 3, 4); L = 1 needs block 0
    mamba = [1, 0, 0, 0, 0, 0, 0]  # a state only at L = 1
    assert hit_tokens(rule, n, [fa, swa, mamba]) == 0
    swa[0] = 1  # now L = 1 is accepted by every class
    assert hit_tokens(rule, n, [fa, swa, mamba]) == 1


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_no_probe_lies_past_the_last_token_bound(name: str) -> None:
    """Every chain index a rule may read names tokens below the last-token bound: a read past
    it costs Redis work for nothing (issue 32). Kills the sparse window's edges running one
    block past ``nb`` (``range(r, nb + 2, r)``), among others."""
    groups, h = SHAPES[name]
    rule = build_rule(groups, h)
    for n in range(1, 40 * rule.alignment, max(1, rule.alignment // 7)):
        limit = last_token_bound(n) // h
        for g in range(len(groups)):
            idx = list(probe_indices(rule, g, n))
            assert all(0 <= i < limit for i in idx), (name, n, g, idx[-3:], limit)


def test_the_sparse_window_reads_no_edge_past_the_bound() -> None:
    """DSV4's SWA-MLA4 (w8: 2 blocks, a = 256): with 127 blocks below the bound the only
    a-aligned edge is at block 64; the edge at 128 lies past the bound."""
    rule = build_rule(SHAPES["dsv4"][0], 4)
    assert list(probe_indices(rule, 3, 510)) == [0, 1, 62, 63]


def test_a_window_or_chunk_of_one_token_is_valid_and_zero_is_not() -> None:
    """The smallest window and chunk are one token; only a value below 1 is refused. Kills
    ``used <= 1`` and ``used < 2`` in ``_validate``."""
    swa = build_rule([GroupSpec("full_attention", 16), GroupSpec("sliding_window", 16, 1)], 16)
    assert hit_tokens(swa, 49, [[1, 1, 1], [0, 0, 1]]) == 48  # w1 needs no block before L
    chunked = [GroupSpec("full_attention", 16), GroupSpec("chunked_local_attention", 16, None, 1)]
    assert build_rule(chunked, 16).alignment == 16
    for bad in (0, -1):
        with pytest.raises(ValueError, match="must be an int >= 1"):
            build_rule([GroupSpec("sliding_window", 16, bad)], 16)
        with pytest.raises(ValueError, match="must be an int >= 1"):
            build_rule([GroupSpec("chunked_local_attention", 16, None, bad)], 16)


def test_a_chunk_size_is_checked_only_on_the_groups_that_use_it() -> None:
    """The registry gives an instance's configured chunk to every group
    (common.group_view); only a chunked-local group reads it, so a full-attention or
    sliding-window group is never refused for it. Kills ``_validate`` reading the chunk of
    every non-sliding-window group."""
    groups = [GroupSpec("full_attention", 16, None, 0), GroupSpec("sliding_window", 16, 32, 0)]
    assert build_rule(groups, 16).alignment == 16


def test_flags_of_any_truthy_kind_count_as_held() -> None:
    """``present[g][i]`` is truthy (the hit rule's contract): 0/1 ints, bools, values past a
    byte, and numpy arrays of a wider dtype (whose raw bytes are not one per flag) give the
    same hit. Kills ``as_bytes``' slow path broken (``None``, ``map(None, …)``), its
    fallback after a refused ``bytearray`` (``raw = None``), and the length check inverted
    (a numpy int64 array read byte by byte)."""
    rule = build_rule([GroupSpec("sliding_window", 16, 48), GroupSpec("full_attention", 16)], 16)
    n = 16 * 12 + 1
    swa = [0, 1, 0, 0, 1, 1, 1, 1, 0, 1, 1, 1]
    fa = [1] * 10 + [0, 1]
    want = hit_tokens(rule, n, [swa, fa])
    assert want == 8 * 16
    for kind in (
        lambda f: [bool(x) for x in f],
        lambda f: [x * 1000 for x in f],
        lambda f: np.array(f, dtype=np.int64),
        lambda f: np.array(f, dtype=np.uint8),
    ):
        assert hit_tokens(rule, n, [kind(swa), kind(fa)]) == want
