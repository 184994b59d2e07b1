"""The audit's comparison rule: an outcome report against the answer given at routing time;
pure, no I/O (docs/api.md "Outcome reports" says why each rule is what vLLM does).

The predicted quantity is ``max(l1_hit_tokens, l3_hit_tokens)`` of the reported instance:
vLLM's ``cached_tokens`` is its local prefix hit plus the tokens a KV connector loads beyond
it (the MooncakeStoreConnector asks for ``kvpool hit - local hit`` when positive), and both
tiers' answers are already capped below the prompt's last token as vLLM caps them.

A difference is **explained** (tolerated by the alerts) when it has a cause the indexer
cannot avoid, and **unexplained** when it points at a fault:

- ``lower_bound_answer`` (under, explained): the answer said it was only a lower bound
  (``*_inexact_reason``), except ``request_block_size_differs``, which is the caller's error;
- ``indexed_after_question`` (under, explained): the engine reused more than the index held
  at routing time, and the index now holds the block where the prediction stopped, under the
  question's own hash: the engine's blocks are the ones asked about, their events arrived
  after the answer (another request stored them, or the index lagged);
- ``concurrent_question`` (over, explained): another question about the same prompt prefix
  was in flight with this one — asked from ``raceWindow`` before it until its report, and
  not reported before it was asked: concurrent requests evict and store the same blocks
  between routing and scheduling;
- ``concurrent_traffic`` (over, explained): another request's outcome was reported on the
  same instance between this question and its report: with requests in flight together the
  engine evicts blocks between routing and scheduling that the index still held;
- unexplained: ``prompt_length_differs`` (the engine saw another number of tokens than the
  router asked about: a chat template, an extra BOS), ``block_size_differs``,
  ``engine_blocks_not_indexed`` (under, and the index does not hold the engine's blocks under
  the question's hashes: other tokens, salt, block size or hash settings than asked about, or
  the instance's events are not arriving), ``evicted_or_wrong_key`` (over, no concurrent
  question, no concurrent traffic), ``realized_exceeds_prompt``.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any


class Verdict(StrEnum):
    EXACT = "exact"
    UNDER = "under"  # the engine reused more than predicted
    OVER = "over"  # the engine reused less than predicted


class Cause(StrEnum):
    LOWER_BOUND = "lower_bound_answer"
    INDEXED_AFTER = "indexed_after_question"
    CONCURRENT = "concurrent_question"
    CONCURRENT_TRAFFIC = "concurrent_traffic"
    PROMPT_LENGTH = "prompt_length_differs"
    BLOCK_SIZE = "block_size_differs"
    NOT_INDEXED = "engine_blocks_not_indexed"
    EVICTED_OR_WRONG_KEY = "evicted_or_wrong_key"
    EXCEEDS_PROMPT = "realized_exceeds_prompt"


EXPLAINED = frozenset(
    {Cause.LOWER_BOUND, Cause.INDEXED_AFTER, Cause.CONCURRENT, Cause.CONCURRENT_TRAFFIC}
)
CALLER_REASONS = frozenset({"request_block_size_differs"})
"""Inexact reasons that are the caller's mistake, not a limit of the index."""


@dataclass(frozen=True)
class Report:
    """One outcome report as ``POST /kv-cache/outcome`` received it (validated)."""

    request_id: str
    server_ip: str
    cached_tokens: int
    prompt_tokens: int | None = None
    source: str = "router"


@dataclass(frozen=True)
class Evidence:
    """What the outcome endpoint read at report time."""

    concurrent: bool = False
    """Another question about the same prefix within the race window."""
    index_holds_stop: bool | None = None
    """The instance's index now holds the block where the prediction stopped (None: unknown)."""
    instance_busy: bool = False
    """Another outcome was reported on the instance between the question and this report."""


@dataclass(frozen=True)
class Outcome:
    verdict: Verdict
    predicted: int
    realized: int
    cause: Cause | None
    first_differing_block: int | None

    @property
    def difference(self) -> int:
        return self.realized - self.predicted

    @property
    def explained(self) -> bool:
        return self.cause is None or self.cause in EXPLAINED

    def document(self) -> dict[str, Any]:
        return {
            "verdict": str(self.verdict),
            "predicted_tokens": self.predicted,
            "realized_tokens": self.realized,
            "difference": self.difference,
            "explained": self.explained,
            "cause": None if self.cause is None else str(self.cause),
            "first_differing_block": self.first_differing_block,
        }


def predicted_tokens(candidate: dict[str, Any]) -> int:
    """What vLLM's ``cached_tokens`` should be: the longer of the local and connector hits."""
    return max(int(candidate.get("l1", 0)), int(candidate.get("l3", 0)))


def stop_block(candidate: dict[str, Any], block_size: int) -> int:
    """The first block the prediction said is missing."""
    return predicted_tokens(candidate) // block_size


def classify(
    question: dict[str, Any],
    candidate: dict[str, Any],
    realized: int,
    prompt_tokens: int | None,
    evidence: Evidence,
) -> Outcome:
    """Compare ``realized`` with the answer ``candidate`` of ``question`` (the record)."""
    predicted = predicted_tokens(candidate)
    n, bs = int(question["n"]), int(question["bs"])
    if realized == predicted:
        return Outcome(Verdict.EXACT, predicted, realized, None, None)
    verdict = Verdict.UNDER if realized > predicted else Verdict.OVER
    first = min(realized, predicted) // bs
    cause = _cause(verdict, candidate, realized, n, prompt_tokens, evidence)
    return Outcome(verdict, predicted, realized, cause, first)


def _cause(
    verdict: Verdict,
    candidate: dict[str, Any],
    realized: int,
    n: int,
    prompt_tokens: int | None,
    evidence: Evidence,
) -> Cause:
    if prompt_tokens is not None and prompt_tokens != n:
        return Cause.PROMPT_LENGTH
    if realized >= max(n, 1):
        return Cause.EXCEEDS_PROMPT
    reasons = set(candidate.get("r1", ())) | set(candidate.get("r3", ()))
    if reasons & CALLER_REASONS:
        return Cause.BLOCK_SIZE
    if verdict is Verdict.UNDER:
        if reasons:
            return Cause.LOWER_BOUND
        return Cause.INDEXED_AFTER if evidence.index_holds_stop else Cause.NOT_INDEXED
    if evidence.concurrent:
        return Cause.CONCURRENT
    return Cause.CONCURRENT_TRAFFIC if evidence.instance_busy else Cause.EVICTED_OR_WRONG_KEY
