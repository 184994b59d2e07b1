"""vllm-ascend completeness with model pins (issue 33): ``ingest.l3.models`` gives a model's
KV heads, pp ranks and layers; a pin decides what a block needs whatever the keys show (a
head, pp rank or layer that vanished whole still counts; one beyond the pin does not), and a
zero leaves that count to the keys. Pins are per model (the key's model field, a path's
basename) and per count: one pinned count never stands in for another.
"""

from __future__ import annotations

from collections.abc import Iterable

import pytest

from services.l3_poller.completeness import ModelPin, pins_by_model
from services.l3_poller.index import MasterIndex, SegmentMap

NO_SEGMENTS = SegmentMap([], None)
MODEL = "Qwen2.5-7B-Instruct"
BLOCKS = (1, 2)


def normal(heads: Iterable[int], pps: Iterable[int], blocks: Iterable[int] = BLOCKS) -> set[str]:
    return {
        f"{MODEL}@pcp0@dcp0@head_or_tp_rank:{h}@pp_rank:{p}@group:0@cache_role:kv"
        f"@cache_family:default@{b:064x}"
        for h in heads
        for p in pps
        for b in blocks
    }


def layerwise(
    heads: Iterable[int], layers: Iterable[int], blocks: Iterable[int] = BLOCKS
) -> set[str]:
    return {
        f"{MODEL}@pcp0@dcp0@head_or_tp_rank:{h}@group:0@cache_role:kv@cache_family:default"
        f"@layer_id:{ly}@{b:064x}"
        for h in heads
        for ly in layers
        for b in blocks
    }


def complete(keys: Iterable[str], pin: ModelPin | None = None, model: str = MODEL) -> set[int]:
    """The complete blocks of one poll of ``keys`` by a fresh index with ``pin`` for ``model``."""
    index = MasterIndex(locate=False, pins={model: pin} if pin else {})
    index.begin(NO_SEGMENTS)
    assert index.feed([k.encode() for k in keys]) == []
    index.commit(0)
    return set(index.blocks("pool").pool or ())


def without(keys: set[str], *parts: str) -> set[str]:
    """``keys`` less block 2's keys that contain every one of ``parts``."""
    tail = f"@{2:064x}"
    return {k for k in keys if not (k.endswith(tail) and all(p in k for p in parts))}


# -- pp ranks --------------------------------------------------------------------------------


def test_a_pp_rank_that_vanished_whole_counts_only_when_pinned() -> None:
    keys = normal(range(2), [0])  # pp rank 1's keys are all gone
    assert complete(keys) == {1, 2}  # inferred: looks like a pp-1 deployment
    assert complete(keys, ModelPin(pp_ranks=2)) == set()
    assert complete(keys, ModelPin(heads=2, pp_ranks=2)) == set()
    assert complete(keys, ModelPin(pp_ranks=1)) == {1, 2}


def test_pp_ranks_beyond_the_pin_do_not_count() -> None:
    keys = normal(range(2), range(2))
    assert complete(without(keys, "pp_rank:1"), ModelPin(pp_ranks=1)) == {1, 2}
    assert complete(without(keys, "pp_rank:1")) == {1}  # inferred: pp 1 is needed
    assert complete(without(keys, "pp_rank:0", "head_or_tp_rank:1"), ModelPin(pp_ranks=1)) == {1}


def test_a_pp_pin_above_what_is_seen_makes_nothing_complete() -> None:
    assert complete(normal(range(2), range(2)), ModelPin(pp_ranks=3)) == set()
    assert complete(normal(range(2), range(3)), ModelPin(pp_ranks=3)) == {1, 2}


# -- heads -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pin", "whole", "missing_head1"),
    [
        (None, {1, 2}, {1}),
        (ModelPin(heads=2), {1, 2}, {1}),
        (ModelPin(heads=1), {1, 2}, {1, 2}),  # head 1 beyond the pin: it does not count
        (ModelPin(heads=4), set(), set()),  # heads 2, 3 never seen
        (ModelPin(heads=0, pp_ranks=2), {1, 2}, {1}),  # heads inferred, pp pinned as seen
    ],
)
def test_heads_follow_the_pin_or_the_keys(
    pin: ModelPin | None, whole: set[int], missing_head1: set[int]
) -> None:
    keys = normal(range(2), range(2))
    assert complete(keys, pin) == whole
    assert complete(without(keys, "head_or_tp_rank:1@pp_rank:1"), pin) == missing_head1


def test_a_head_that_vanished_whole_counts_only_when_pinned() -> None:
    keys = normal([0], range(2))
    assert complete(keys) == {1, 2}
    assert complete(keys, ModelPin(heads=2)) == set()
    assert complete(keys, ModelPin(pp_ranks=2)) == {1, 2}  # a pp pin is not a head pin


# -- layers (layer-wise keys have no pp rank) ------------------------------------------------


@pytest.mark.parametrize(
    ("pin", "whole", "missing_layer2"),
    [
        (None, {1, 2}, {1}),
        (ModelPin(layers=3), {1, 2}, {1}),
        (ModelPin(layers=2), {1, 2}, {1, 2}),  # layer 2 beyond the pin
        (ModelPin(layers=4), set(), set()),
        (ModelPin(heads=2, pp_ranks=4, layers=3), {1, 2}, {1}),  # pp is not in these keys
        (ModelPin(pp_ranks=4), {1, 2}, {1}),
    ],
)
def test_layers_follow_the_pin_or_the_keys(
    pin: ModelPin | None, whole: set[int], missing_layer2: set[int]
) -> None:
    keys = layerwise(range(2), range(3))
    assert complete(keys, pin) == whole
    assert complete(without(keys, "head_or_tp_rank:0@", "layer_id:2@"), pin) == missing_layer2


def test_a_layer_that_vanished_whole_counts_only_when_pinned() -> None:
    keys = layerwise(range(2), range(2))
    assert complete(keys) == {1, 2}
    assert complete(keys, ModelPin(layers=3)) == set()
    assert complete(keys, ModelPin(heads=2)) == {1, 2}
    only_layer0 = layerwise(range(2), [0])
    assert complete(only_layer0) == {1, 2}
    assert complete(only_layer0, ModelPin(layers=2)) == set()


# -- which model a pin is for ----------------------------------------------------------------


def test_a_pin_applies_to_its_model_only() -> None:
    keys = normal(range(2), [0])
    assert complete(keys, ModelPin(pp_ranks=2), model="Qwen2.5-0.5B-Instruct") == {1, 2}
    pins = pins_by_model([(f"/models/{MODEL}/", 0, 2, 0), ("Other", 8, 8, 8)])
    assert pins == {MODEL: ModelPin(0, 2, 0), "Other": ModelPin(8, 8, 8)}
    index = MasterIndex(locate=False, pins=pins)
    index.begin(NO_SEGMENTS)
    assert index.feed([k.encode() for k in keys]) == []
    index.commit(0)
    assert set(index.blocks("pool").pool or ()) == set()  # pinned by its path's basename
