"""One audit probe of one vLLM instance: ask the engine, ask the index, compare.

The steps (:meth:`Prober.probe`), each bounded by what is left of ``audit.probe.timeout``:

1. the served model: ``audit.probe.model``, else the first of the engine's ``GET /v1/models``;
2. a fresh prompt — random token ids in [``TOKEN_LOW``, ``TOKEN_HIGH``), ``promptBlocks`` full
   blocks plus one token — sent to ``POST /v1/completions`` (``max_tokens`` 1) with the
   prober's own ``cache_salt``: it can neither reuse nor pollute a user's cache entry;
3. ``POST /kv-cache/hit-rate?detail=1`` every :data:`POLL_S` until the index shows the
   prompt's blocks (ratio 1, or the same non-zero hit twice in a row: a hybrid model may
   reuse less than the whole prompt); ``indexDeadline`` passing first is the finding
   ``events_missing`` (the instance's KV events do not reach the index);
4. the question that is audited: the same hit-rate request with a ``request_id``;
5. the prompt again; the engine's ``usage.prompt_tokens_details.cached_tokens``;
6. ``POST /kv-cache/outcome`` with ``source: probe``: the API's verdict (exact, under, over);
   a 404 is retried for :data:`REPORT_RETRY_S` (the API writes its records in the background).

Every failure is an :class:`Outcome` with a one-line detail, never an exception: the engine
unreachable or refusing (``engine_error``), an engine that does not report cached tokens
(``no_cached_tokens``: vLLM runs without ``--enable-prompt-tokens-details``), the API failing
(``api_error``), the budget spent (``timeout``), no HTTP endpoint known (``no_endpoint``).
"""

from __future__ import annotations

import random
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import httpx

from common.settings import ProberSettings

TOKEN_LOW, TOKEN_HIGH = 1000, 30000
"""Probe token ids: inside every real vocabulary, away from the low special ids."""
POLL_S = 0.2
REPORT_RETRY_S = 3.0
"""How long a report answered 404 is retried (the record may not be written yet)."""


class Outcome(StrEnum):
    """A probe's result (the values are the ``outcome`` label of the prober's counter)."""

    EXACT = "exact"
    UNDER = "under"
    OVER = "over"
    EVENTS_MISSING = "events_missing"
    NO_CACHED_TOKENS = "no_cached_tokens"
    ENGINE_ERROR = "engine_error"
    API_ERROR = "api_error"
    TIMEOUT = "timeout"
    NO_ENDPOINT = "no_endpoint"


_VERDICTS = {o.value: o for o in (Outcome.EXACT, Outcome.UNDER, Outcome.OVER)}


@dataclass(frozen=True)
class Target:
    """One instance as ``GET /kv-cache/instances`` shows it."""

    ip: str
    http: str
    block_size: int
    """What the hit-rate question says: the index's hash unit for the instance, else config."""
    span: int
    """Tokens per prompt block: the largest block size of the instance's groups (≥ block_size),
    so that every group holds the prompt's blocks."""


@dataclass(frozen=True)
class Result:
    ip: str
    outcome: Outcome
    detail: str = ""
    predicted: int | None = None
    realized: int | None = None
    request_id: str = ""


class _NotYet(Exception):
    """The outcome endpoint does not know the question yet: the API records answers in the
    background, so a report right after its question may come before the record."""


class _Failed(Exception):
    def __init__(self, outcome: Outcome, detail: str) -> None:
        super().__init__(detail)
        self.outcome, self.detail = outcome, detail


class Prober:
    """Runs probes (thread-safe: one shared HTTP client, no other state)."""

    def __init__(
        self,
        settings: ProberSettings,
        client: httpx.Client,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
        stop: threading.Event | None = None,
    ) -> None:
        self.s, self.http, self.clock = settings, client, clock
        self.stop = stop or threading.Event()
        self._rng = rng or random.SystemRandom()

    def probe(self, target: Target) -> Result:
        if not target.http:
            return Result(target.ip, Outcome.NO_ENDPOINT, "discovery knows no HTTP port")
        deadline = self.clock() + self.s.timeout
        request_id = f"probe-{secrets.token_hex(8)}"
        try:
            return self._steps(target, deadline, request_id)
        except _Failed as f:
            return Result(target.ip, f.outcome, f.detail, request_id=request_id)

    def _steps(self, t: Target, deadline: float, request_id: str) -> Result:
        model = self.s.model or self._model(t, deadline)
        prompt = [
            self._rng.randrange(TOKEN_LOW, TOKEN_HIGH)
            for _ in range(self.s.prompt_blocks * t.span + 1)
        ]
        self._complete(t, model, prompt, deadline)
        self._wait_indexed(t, prompt, deadline)
        predicted = self._ask(t, prompt, deadline, request_id)
        realized = self._complete(t, model, prompt, deadline)
        verdict = self._report(t, request_id, realized, len(prompt), deadline)
        outcome = _VERDICTS.get(str(verdict.get("verdict")))
        if outcome is None:
            raise _Failed(Outcome.API_ERROR, f"unknown verdict {verdict.get('verdict')!r}")
        return Result(t.ip, outcome, "", predicted, realized, request_id)

    # -- the engine -------------------------------------------------------------------

    def _model(self, t: Target, deadline: float) -> str:
        doc = self._call(Outcome.ENGINE_ERROR, "GET", f"{t.http}/v1/models", deadline)
        try:
            return str(doc["data"][0]["id"])
        except (KeyError, IndexError, TypeError):
            raise _Failed(Outcome.ENGINE_ERROR, "GET /v1/models listed no model") from None

    def _complete(self, t: Target, model: str, prompt: list[int], deadline: float) -> int:
        body = {
            "model": model,
            "prompt": prompt,
            "max_tokens": 1,
            "temperature": 0,
            "cache_salt": self.s.cache_salt,
        }
        doc = self._call(
            Outcome.ENGINE_ERROR, "POST", f"{t.http}/v1/completions", deadline, json=body
        )
        usage = doc.get("usage") if isinstance(doc, dict) else None
        details = (usage or {}).get("prompt_tokens_details") if isinstance(usage, dict) else None
        if not isinstance(details, dict) or not isinstance(details.get("cached_tokens"), int):
            raise _Failed(
                Outcome.NO_CACHED_TOKENS,
                "the answer has no usage.prompt_tokens_details.cached_tokens "
                "(run vLLM with --enable-prompt-tokens-details)",
            )
        return int(details["cached_tokens"])

    # -- the index --------------------------------------------------------------------

    def _hit(self, t: Target, prompt: list[int], deadline: float, rid: str = "") -> dict[str, Any]:
        body: dict[str, Any] = {
            "server_ip": [t.ip],
            "body": {
                "token_ids": prompt,
                "block_size": t.block_size,
                "cache_salt": self.s.cache_salt,
            },
        }
        if rid:
            body["request_id"] = rid
        url = f"{self.s.api_url}/kv-cache/hit-rate?detail=1"
        doc = self._call(Outcome.API_ERROR, "POST", url, deadline, json=body)
        try:
            return dict(doc["server_score_list"][0])
        except (KeyError, IndexError, TypeError):
            raise _Failed(Outcome.API_ERROR, "the hit-rate answer has no score") from None

    def _wait_indexed(self, t: Target, prompt: list[int], deadline: float) -> None:
        give_up = min(deadline, self.clock() + self.s.index_deadline)
        previous = None
        while True:
            score = self._hit(t, prompt, deadline)
            ratio = float(score.get("l1_hit_ratio") or 0.0)
            if ratio >= 1.0 or (ratio > 0 and ratio == previous):
                return
            previous = ratio
            if self.clock() + POLL_S > give_up:
                break
            if self.stop.wait(POLL_S):
                raise _Failed(Outcome.TIMEOUT, "the prober is stopping")
        if give_up < deadline:
            raise _Failed(
                Outcome.EVENTS_MISSING,
                f"the index showed {previous:.2f} of the probe's blocks "
                f"{self.s.index_deadline:g}s after the engine stored them",
            )
        raise _Failed(Outcome.TIMEOUT, "the probe's budget ran out waiting for the index")

    def _ask(self, t: Target, prompt: list[int], deadline: float, request_id: str) -> int:
        score = self._hit(t, prompt, deadline, request_id)
        return max(int(score.get("l1_hit_tokens") or 0), int(score.get("l3_hit_tokens") or 0))

    def _report(
        self, t: Target, request_id: str, cached: int, prompt_tokens: int, deadline: float
    ) -> dict[str, Any]:
        body = {
            "request_id": request_id,
            "server_ip": t.ip,
            "cached_tokens": cached,
            "prompt_tokens": prompt_tokens,
            "source": "probe",
        }
        url = f"{self.s.api_url}/kv-cache/outcome"
        retry_until = min(deadline, self.clock() + REPORT_RETRY_S)
        while True:
            try:
                doc = self._call(Outcome.API_ERROR, "POST", url, deadline, json=body)
                break
            except _NotYet:
                if self.clock() + POLL_S > retry_until or self.stop.wait(POLL_S):
                    raise _Failed(
                        Outcome.API_ERROR,
                        f"POST {url}: the question {request_id} is not recorded "
                        f"{REPORT_RETRY_S:g}s after it was answered (audit.enabled? rate limit?)",
                    ) from None
        if not isinstance(doc, dict):
            raise _Failed(Outcome.API_ERROR, "the outcome answer is not a JSON object")
        return doc

    # -- HTTP -------------------------------------------------------------------------

    def _call(self, fails: Outcome, method: str, url: str, deadline: float, **kw: Any) -> Any:
        left = deadline - self.clock()
        if left <= 0:
            raise _Failed(Outcome.TIMEOUT, f"the probe's budget ran out before {method} {url}")
        try:
            resp = self.http.request(method, url, timeout=left, **kw)
        except httpx.TimeoutException:
            raise _Failed(Outcome.TIMEOUT, f"{method} {url}: no answer in time") from None
        except httpx.HTTPError as exc:
            raise _Failed(fails, f"{method} {url}: {type(exc).__name__}: {exc}") from None
        if resp.status_code == 404 and url.endswith("/kv-cache/outcome"):
            raise _NotYet()
        if resp.status_code != 200:
            raise _Failed(fails, f"{method} {url}: HTTP {resp.status_code} {resp.text[:200]!r}")
        try:
            return resp.json()
        except ValueError:
            raise _Failed(fails, f"{method} {url}: the answer is not JSON") from None
