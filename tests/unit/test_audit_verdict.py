"""The audit's comparison rule (services/api/audit_verdict.py), case by case."""

from __future__ import annotations

from typing import Any

import pytest

from services.api.audit_verdict import Cause, Evidence, Verdict, classify

QUESTION = {"n": 64, "bs": 16}


def _cand(l1: int, l3: int = 0, r1: tuple[str, ...] = (), r3: tuple[str, ...] = ()) -> Any:
    return {"l1": l1, "l3": l3, "r1": list(r1), "r3": list(r3)}


def test_the_prediction_is_the_longer_tier_and_exact_needs_no_cause() -> None:
    out = classify(QUESTION, _cand(16, 48), 48, 64, Evidence())
    assert (out.verdict, out.predicted, out.cause, out.explained) == (Verdict.EXACT, 48, None, True)
    assert out.first_differing_block is None
    out = classify(QUESTION, _cand(48, 16), 48, None, Evidence())
    assert out.verdict is Verdict.EXACT


@pytest.mark.parametrize(
    ("cand", "realized", "prompt", "evidence", "verdict", "cause", "explained"),
    [
        (_cand(16), 48, None, Evidence(index_holds_stop=True), "under", Cause.INDEXED_AFTER, True),
        (_cand(16), 48, None, Evidence(index_holds_stop=False), "under", Cause.NOT_INDEXED, False),
        (_cand(16), 48, None, Evidence(concurrent=True), "under", Cause.NOT_INDEXED, False),
        (
            _cand(0, r1=("unknown_group_kind",)),
            32,
            None,
            Evidence(),
            "under",
            Cause.LOWER_BOUND,
            True,
        ),
        (
            _cand(0, r1=("request_block_size_differs",)),
            32,
            None,
            Evidence(),
            "under",
            Cause.BLOCK_SIZE,
            False,
        ),
        (_cand(16), 48, 65, Evidence(index_holds_stop=True), "under", Cause.PROMPT_LENGTH, False),
        (_cand(16), 64, 64, Evidence(index_holds_stop=True), "under", Cause.EXCEEDS_PROMPT, False),
        (_cand(48), 16, None, Evidence(concurrent=True), "over", Cause.CONCURRENT, True),
        (_cand(48), 16, None, Evidence(), "over", Cause.EVICTED_OR_WRONG_KEY, False),
        (_cand(48), 16, None, Evidence(instance_busy=True), "over", Cause.CONCURRENT_TRAFFIC, True),
        (_cand(16), 48, None, Evidence(instance_busy=True), "under", Cause.NOT_INDEXED, False),
        (
            _cand(48, r1=("unknown_group_kind",)),
            16,
            None,
            Evidence(),
            "over",
            Cause.EVICTED_OR_WRONG_KEY,
            False,
        ),
    ],
)
def test_causes(
    cand: Any,
    realized: int,
    prompt: int | None,
    evidence: Evidence,
    verdict: str,
    cause: Cause,
    explained: bool,
) -> None:
    out = classify(QUESTION, cand, realized, prompt, evidence)
    assert (str(out.verdict), out.cause, out.explained) == (verdict, cause, explained)
    assert out.difference == realized - max(cand["l1"], cand["l3"])
    assert out.first_differing_block == min(realized, out.predicted) // 16
