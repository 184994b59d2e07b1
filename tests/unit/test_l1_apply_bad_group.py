"""An event naming a negative KV-cache group is skipped, written nowhere and counted under
its own type and the ``skipped:bad_group`` outcome (``services.l1_ingest.apply.plan_ops``);
found unpinned by mutation testing (issue 33)."""

from __future__ import annotations

from common.event_types import BlockRemoved, BlockStored, EventBatch
from services.l1_ingest.apply import plan_ops


def test_events_of_a_negative_group_are_skipped_and_counted_by_type() -> None:
    events = [
        BlockStored([1], None, [1, 2, 3, 4], 4, medium="GPU", group_idx=-1),
        BlockRemoved([2], medium="GPU", group_idx=-2),
        BlockStored([3], None, [1, 2, 3, 4], 4, medium="GPU", group_idx=1),
    ]
    plan = plan_ops(EventBatch(1.0, events, 0, [], "map"))  # type: ignore[arg-type]
    assert plan.outcomes == {
        ("BlockStored", "skipped:bad_group"): 1,
        ("BlockRemoved", "skipped:bad_group"): 1,
        ("BlockStored", "l1"): 1,
    }
    # no descriptor for a bad group; the instance's settings ops ("H", "A": lookahead) aside
    kept = [op for op in plan.ops.ops if op[0] not in ("H", "A")]
    hashes = [op[3] for op in kept if op[0] != "D"]
    assert hashes == [[3]] and [op[2] for op in kept] == [1, 1], plan.ops.ops
