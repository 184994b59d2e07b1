"""common.group_view: the descriptors the L1 ingester stores (``<g>`` → ``kind,B,w,bmin``, plus
``h_cfg``, ``chunk``, ``dp``) parsed into the hit rule's input (issue 33).

The hash unit without ``prefixMatchUnit`` is the GCD of every group's block size *and* of the
smallest block size seen (vLLM ≥ 0.26 publishes partial-tail entries with ``block_size = h``);
with ``h_cfg`` set, that is the unit. Each case below tells a plausible wrong version apart:
the smallest sizes ignored, the minimum instead of the GCD, one group's sizes only, the largest
instead of the smallest, ``h_cfg`` ignored or taken as the GCD's floor.
"""

from __future__ import annotations

import pytest

from common import hit_rule
from common.group_view import (
    DP_UNION,
    GROUPS_UNUSABLE,
    UNCONFIRMED_UNIT,
    Group,
    describe,
    parse_groups,
)

V34, V25 = (0, 34), (0, 25)


@pytest.mark.parametrize(
    ("fields", "unit"),
    [
        # Qwen3.5-style: Mamba and FA at 528, partial tails at 16 on both: h = 16
        ({"0": "mamba,528,,16", "1": "full_attention,528,,16"}, 16),
        # partial tails seen on one group only still give the unit
        ({"0": "mamba,528,,528", "1": "full_attention,528,,16"}, 16),
        ({"0": "mamba,528,,16", "1": "full_attention,528,,528"}, 16),
        # no partial entries: the block sizes alone
        ({"0": "mamba,528,,528", "1": "full_attention,528,,528"}, 528),
        ({"0": "mamba,528,", "1": "full_attention,528"}, 528),  # bmin absent: B
        # the GCD, not the minimum: 12 and 8 -> 4 (min would be 8)
        ({"0": "sliding_window,12,24,12", "1": "full_attention,8,,8"}, 4),
        # smallest sizes whose GCD is below every one of them: 48 and 80 -> 16
        ({"0": "mamba,528,,48", "1": "full_attention,528,,80"}, 16),
        # gpt-oss style, one block size everywhere
        ({"0": "sliding_window,16,128,16", "1": "full_attention,16,,16"}, 16),
    ],
)
def test_the_hash_unit_is_the_gcd_of_block_sizes_and_partial_tails(
    fields: dict[str, str], unit: int
) -> None:
    groups = parse_groups(fields, V34)
    assert groups.hash_unit == unit and not groups.unit_from_config
    assert groups.rule is not None and groups.rule.hash_unit == unit
    assert describe(groups, "ok")["hash_unit"] == unit


def test_partial_hits_follow_the_derived_unit() -> None:
    """With the unit from the partial tails (16 < 528), vLLM 0.26+ turns partial hits on and
    aligns to 16; without them the unit is 528 and hits align to 528."""
    fine = parse_groups({"0": "mamba,528,,16", "1": "full_attention,528,,16"}, V34)
    assert fine.rule is not None and (fine.rule.partial_hits, fine.rule.alignment) == (True, 16)
    coarse = parse_groups({"0": "mamba,528,,528", "1": "full_attention,528,,528"}, V34)
    assert coarse.rule is not None
    assert (coarse.rule.partial_hits, coarse.rule.alignment) == (False, 528)
    old = parse_groups({"0": "mamba,528,,16", "1": "full_attention,528,,16"}, V25)
    assert old.rule is not None and (old.rule.partial_hits, old.rule.alignment) == (False, 528)


@pytest.mark.parametrize(
    ("h_cfg", "unit"),
    [("16", 16), ("176", 176), ("0", 48), ("", 48), ("x", 48)],
)
def test_prefix_match_unit_from_config_wins(h_cfg: str, unit: int) -> None:
    fields = {"0": "mamba,528,,48", "1": "full_attention,528,,528", "h_cfg": h_cfg}
    groups = parse_groups(fields, V34)
    assert groups.hash_unit == unit
    assert groups.unit_from_config is (unit != 48)
    status = describe(groups, None)
    assert status["hash_unit_source"] == ("config" if unit != 48 else "events")
    assert (UNCONFIRMED_UNIT in status["inexact_reasons"]) is (unit == 48)  # type: ignore[operator]


def test_a_unit_that_is_not_a_divisor_makes_the_groups_unusable() -> None:
    groups = parse_groups({"0": "mamba,528,,528", "1": "full_attention,528", "h_cfg": "100"}, V34)
    assert (groups.rule, groups.usable, groups.hybrid) == (None, False, True)
    assert groups.reasons == (GROUPS_UNUSABLE,)
    assert describe(groups, "ok")["exact"] is False


def test_groups_are_parsed_field_by_field() -> None:
    fields = {
        "1": "full_attention,16,,16",
        "0": "sliding_window,32,64,16",
        "2": "-,16,,",
        "3": "mamba,0,,",  # no block size: not a group
        "h_cfg": "",
        "chunk": "",
        "dp": "1",
        "x": "full_attention,16",
    }
    groups = parse_groups(fields, V34)
    assert groups.groups == (
        Group(0, "sliding_window", 32, 64, 16),
        Group(1, "full_attention", 16, None, 16),
        Group(2, "-", 16, None, 16),
    )
    assert groups.ids == (0, 1, 2)
    assert groups.rule is not None
    assert [g.kind for g in groups.rule.groups] == ["sliding_window", "full_attention", None]
    assert [g.sliding_window for g in groups.rule.groups] == [64, None, None]
    assert groups.reasons == (str(hit_rule.Inexact.UNKNOWN_KIND),)


def test_the_chunk_setting_reaches_chunked_local_groups() -> None:
    fields = {"0": "chunked_local_attention,16,,16", "1": "full_attention,16,,16"}
    unknown = parse_groups(fields, V34)
    assert unknown.reasons == (str(hit_rule.Inexact.CHUNK_SIZE_UNKNOWN),)
    known = parse_groups({**fields, "chunk": "64"}, V34)
    assert known.rule is not None and known.reasons == ()
    assert [g.chunk for g in known.rule.groups] == [64, 64]


@pytest.mark.parametrize(
    ("fields", "single"),
    [
        ({}, True),
        ({"0": "full_attention,16,,16"}, True),
        ({"0": "-,16"}, True),
        ({"0": "mla_attention,64"}, True),
        ({"0": "sliding_window,16,64,16"}, False),  # one group, not full attention
        ({"1": "full_attention,16,,16"}, False),  # one group, but not group 0
        ({"0": "full_attention,16", "1": "full_attention,16"}, False),
    ],
)
def test_single_or_hybrid(fields: dict[str, str], single: bool) -> None:
    groups = parse_groups(fields, V34)
    assert groups.hybrid is not single and (groups.rule is None) is single
    if single and fields:
        assert groups.hash_unit == int(next(iter(fields.values())).split(",")[1])
    assert describe(groups, None)["hybrid"] is not single


@pytest.mark.parametrize(("dp", "union"), [("", False), ("1", False), ("2", True), ("8", True)])
def test_dp_ranks_as_one_union_are_a_reason(dp: str, union: bool) -> None:
    fields = {"0": "sliding_window,16,64,16", "1": "full_attention,16,,16", "dp": dp}
    groups = parse_groups(fields, V34)
    assert (DP_UNION in groups.reasons) is union
    assert describe(groups, "ok")["exact"] is not union


def test_describe_shows_the_descriptors() -> None:
    groups = parse_groups({"0": "sliding_window,32,64,16", "1": "-,16,,16"}, V34)
    assert describe(groups, "ok") == {
        "hybrid": True,
        "kv_cache_groups": [
            {"group": 0, "kind": "sliding_window", "block_size": 32, "sliding_window": 64},
            {"group": 1, "kind": None, "block_size": 16, "sliding_window": None},
        ],
        "hash_unit": 16,
        "hash_unit_source": "events",
        "exact": False,
        "inexact_reasons": [str(hit_rule.Inexact.UNKNOWN_KIND)],
    }
    assert describe(parse_groups({}, V34), None)["hash_unit_source"] is None
    assert describe(parse_groups({}, V34), None)["hash_unit"] is None
