"""The batch's form ("array", "map", "empty") on the careful, event-by-event route (issue 33,
a mutmut survivor of ``common/events.py``): a batch with a bad event is decoded event by
event, and its form is still that of its first array or map event, not "array" whatever."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest

from common.events import BlockRemoved, decode_batch

MAP_EVENT = {"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU"}
ARRAY_EVENT = ["BlockRemoved", [1], "GPU"]
BAD_MAP = {"type": "NoSuchEvent"}
BAD_ARRAY = ["NoSuchEvent"]


def _batch(*events: Any) -> bytes:
    return bytes(msgpack.packb([1.0, list(events), 0]))


@pytest.mark.parametrize(
    ("events", "form"),
    [
        ((MAP_EVENT, BAD_MAP), "map"),
        ((BAD_MAP, MAP_EVENT), "map"),
        ((7, MAP_EVENT, BAD_MAP), "map"),  # the first array or map event decides
        (("x", BAD_MAP, ARRAY_EVENT), "map"),
        ((ARRAY_EVENT, BAD_ARRAY), "array"),
        ((7, ARRAY_EVENT, MAP_EVENT), "array"),
        ((7, "x"), "empty"),
    ],
)
def test_the_careful_route_names_the_form_of_the_first_array_or_map_event(
    events: tuple[Any, ...], form: str
) -> None:
    batch = decode_batch(_batch(*events))
    assert batch.form == form
    good = sum(e in (MAP_EVENT, ARRAY_EVENT) for e in events)
    assert batch.events == [BlockRemoved([1], "GPU")] * good
    assert len(batch.skipped) == len(events) - good
