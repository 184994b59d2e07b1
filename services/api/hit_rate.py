"""``POST /kv-cache/hit-rate``: read and validate the request, hash the prompt, score instances.

The contract (original-contract.md §1) in short: one score per ``server_ip`` in input order,
duplicates kept; ``n = len(token_ids) // block_size`` full blocks; a ratio is the
instance's hit in a tier divided by ``n``, the hit being vLLM's rule as
:mod:`services.api.scoring` applies it (the longest run from block 0 for a single-group
model). A request's Redis reads are one or two pipelined round trips as the read plan
needs them (:mod:`services.api.read_plan`), a candidate whose group descriptors changed
meanwhile starting over in the next one (:mod:`services.api.scoring`). Every
failure is a :class:`~common.errors.RequestError` whose status is both the HTTP status and
the body's ``status``; :mod:`services.api.app` renders it.

At most ``http.maxCandidates`` distinct ``server_ip`` values are accepted (a repeated ip is
read once), checked before any hashing or Redis work, and the distinct candidates × full
blocks at most maxCandidates × 4,096 (a 400 otherwise, also before any work).
The body is never read past ``http.maxHitRateBodyBytes``: a larger ``Content-Length`` is
refused before reading, and a chunked body is read at most ``limit + 1`` bytes.
Token ids must be JSON integers (``true`` and ``1.0`` are not) that the configured vLLM can
hold: ``[0, 2**64)``, or ``[0, 2**31)`` for vLLM >= 0.34 (:mod:`common.blockhash` decides,
for the partial tail block too); anything else is a 400, as vLLM would refuse the prompt.
The optional ``lora_name``, ``lora_path`` and ``mm_features`` (:mod:`services.api.request_inputs`)
key every chain the request hashes; without them the hasher is called with no ``inputs``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, Protocol

import falcon
import orjson
import redis

from common.blockhash_extra import PLAIN, HashInputs
from common.errors import RequestError
from services.api.api_metrics import ApiMetrics
from services.api.hit_rate_request import DEFAULT_MAX_CANDIDATES as DEFAULT_MAX_CANDIDATES
from services.api.hit_rate_request import HitRateRequest as HitRateRequest
from services.api.hit_rate_request import parse_request as parse_request
from services.api.hit_rate_request import read_body as read_body
from services.api.audit_record import HEADER as REQUEST_ID_HEADER
from services.api.audit_record import Recorder, hybrid_stops, parse_request_id
from services.api.scoring import (
    Chain,
    ChainKey,
    Hit,
    Scorer,
    StoreReads,
    ViewCache,
    parse_view,
    raw_of,
)

logger = logging.getLogger(__name__)

PATH = "/kv-cache/hit-rate"
UNREACHABLE = "the hit rate could not be computed: the state store is unreachable"


class Hasher(Protocol):
    """What the API needs of :class:`common.blockhash.BlockHasher`."""

    def member_keys(
        self,
        token_ids: Sequence[int],
        block_size: int,
        cache_salt: str | None = None,
        *,
        inputs: HashInputs | None = None,
    ) -> list[bytes]: ...


def score(
    request: HitRateRequest,
    store: StoreReads,
    hasher: Hasher,
    metrics: ApiMetrics,
    views: ViewCache | None = None,
    *,
    detail: bool = False,
    vllm_version: tuple[int, ...] = (0, 28, 0),
    on_hits: Callable[[dict[str, tuple[Hit, Hit]], Chain, ViewCache], None] | None = None,
) -> list[dict[str, Any]]:
    """One ``{server_ip, l1_hit_ratio, l3_hit_ratio}`` per requested ip, in input order;
    with ``detail`` also each tier's hit in tokens, whether it is exact, and why not.

    The prompt is hashed once per distinct hash unit and lookahead L among the candidates
    (the request's block size for single-group instances); the reads are the read plan's one
    or two pipelined round trips (:mod:`services.api.read_plan`), the candidates whose
    KV-cache groups changed since this worker last saw them starting over in the next one.
    ``on_hits`` gets every distinct candidate's hits, the prompt's chains and the candidates'
    views (the audit's record)."""
    views = views if views is not None else ViewCache()
    chains: dict[ChainKey, Sequence[bytes]] = {}

    def chain(unit: int, lookahead: int = 0) -> Sequence[bytes]:
        if (unit, lookahead) not in chains:  # hashes every full unit, range-checks every id
            try:
                keys = _member_keys(hasher, request, unit, lookahead)
            except ValueError as exc:  # a negative id, or one wider than the vLLM's ids
                raise RequestError(
                    400, f"body.token_ids cannot be hashed for vLLM: {exc}"
                ) from None
            chains[unit, lookahead] = keys
            metrics.hashed_blocks.inc(len(keys))
        return chains[unit, lookahead]

    chain(request.block_size, views.empty.lookahead)  # every id checked before any read
    distinct = list(dict.fromkeys(request.server_ips))
    n_tokens = len(request.token_ids)
    if n_tokens < request.block_size:  # no full block: nothing to read
        hits = {ip: (Hit(0, 0.0), Hit(0, 0.0)) for ip in distinct}
    else:
        scorer = Scorer(n_tokens, request.block_size, chain, store)
        hits = _read_hits(distinct, scorer, views, vllm_version, metrics)
    _count_inexact(hits, metrics)
    if on_hits is not None:
        on_hits(hits, chain, views)
    if hits:  # what the router can gain from this request: its best candidate, per tier
        metrics.best_hit_ratio.observe(max(h[0].ratio for h in hits.values()), tier="l1")
        metrics.best_hit_ratio.observe(max(h[1].ratio for h in hits.values()), tier="l3")
    return [_answer(ip, *hits[ip], detail) for ip in request.server_ips]


def _count_inexact(hits: dict[str, tuple[Hit, Hit]], metrics: ApiMetrics) -> None:
    for l1, l3 in hits.values():
        for tier, hit in (("l1", l1), ("l3", l3)):
            for reason in hit.reasons:
                metrics.inexact.inc(tier=tier, reason=reason)


def _member_keys(hasher: Hasher, request: HitRateRequest, unit: int, lookahead: int) -> list[bytes]:
    """The request's chain at ``unit``, each block hashed with the ``lookahead`` tokens after
    it (spec vllm-extra-keys.md §5; 0 = vLLM's plain chain). LoRA, items and lookahead only
    when there are some: a plain request calls the hasher with no ``inputs``."""
    inputs = request.inputs
    if lookahead:
        inputs = replace(inputs, lookahead=lookahead)
    if inputs is PLAIN:
        return hasher.member_keys(request.token_ids, unit, request.cache_salt)
    return hasher.member_keys(request.token_ids, unit, request.cache_salt, inputs=inputs)


def _read_hits(
    ips: list[str],
    scorer: Scorer,
    views: ViewCache,
    vllm_version: tuple[int, ...],
    metrics: ApiMetrics,
) -> dict[str, tuple[Hit, Hit]]:
    """Round 1 with every candidate's cached view and its descriptors; a candidate whose
    descriptors changed starts over with its new view in the next round trip, together
    with the reads the others still need (:mod:`services.api.read_plan`). A Redis failure is
    counted, logged and answered 500."""
    try:
        old = {ip: views.get(ip) for ip in ips}
        first = {ip: scorer.queue(ip, old[ip]) for ip in ips}
        scorer.execute()
        changed = 0
        for ip in ips:
            fields, l3_groups = first[ip].descriptors
            if raw_of(fields, l3_groups) != old[ip].raw:
                fresh = parse_view(fields, l3_groups, vllm_version, views.empty.lookahead)
                views.put(ip, fresh)
                scorer.queue(ip, fresh, descriptors=False)
                changed += 1
        if changed:
            metrics.group_rereads.inc(changed)
        return scorer.finish()
    except redis.RedisError as exc:
        metrics.redis_errors.inc(op="hit_rate")
        logger.warning("hit rate: Redis failed: %s", exc)
        raise RequestError(500, UNREACHABLE) from None


def _answer(ip: str, l1: Hit, l3: Hit, detail: bool) -> dict[str, Any]:
    doc: dict[str, Any] = {"server_ip": ip, "l1_hit_ratio": l1.ratio, "l3_hit_ratio": l3.ratio}
    if detail:
        for tier, hit in (("l1", l1), ("l3", l3)):
            doc[f"{tier}_hit_tokens"] = hit.tokens
            doc[f"{tier}_exact"] = not hit.reasons
            doc[f"{tier}_inexact_reason"] = ",".join(hit.reasons) or None
    return doc


def error_document(status: int, message: str) -> bytes:
    return orjson.dumps({"server_score_list": [], "message": message, "status": status})


def error_body(path: str, status: int, message: str) -> bytes:
    """The JSON of an error answer on ``path``: the contract's document on the hit-rate
    path, ``{"message", "status"}`` on every other."""
    if path == PATH:
        return error_document(status, message)
    return orjson.dumps({"message": message, "status": status})


class HitRateResource:
    """``/kv-cache/hit-rate``; other methods are refused by :class:`PostOnly`."""

    def __init__(
        self,
        store: StoreReads,
        hasher: Hasher,
        metrics: ApiMetrics,
        body_limit: int,
        max_candidates: int = DEFAULT_MAX_CANDIDATES,
        vllm_version: tuple[int, ...] = (0, 28, 0),
        recorder: Recorder | None = None,
        lookahead: int = 0,
    ) -> None:
        self.store, self.hasher, self.metrics = store, hasher, metrics
        self.recorder = recorder
        self.body_limit, self.max_candidates = body_limit, max_candidates
        self.vllm_version = vllm_version
        self.views = ViewCache(lookahead=lookahead)
        """Views by instance; ``lookahead`` is the L of those whose events showed none."""

    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        request = parse_request(
            read_body(req, self.body_limit), self.max_candidates, self.vllm_version
        )
        detail = req.get_param_as_bool("detail", default=False)
        rid = request.request_id or parse_request_id(
            req.get_header(REQUEST_ID_HEADER), f"the {REQUEST_ID_HEADER} header"
        )
        scores = score(
            request,
            self.store,
            self.hasher,
            self.metrics,
            self.views,
            detail=bool(detail),
            vllm_version=self.vllm_version,
            on_hits=self._recording(request, rid),
        )
        resp.content_type = falcon.MEDIA_JSON
        doc: dict[str, Any] = {"server_score_list": scores, "message": "", "status": 0}
        if rid is not None:
            doc["request_id"] = rid
        resp.data = orjson.dumps(doc)

    def _recording(
        self, request: HitRateRequest, rid: str | None
    ) -> Callable[[dict[str, tuple[Hit, Hit]], Chain, ViewCache], None] | None:
        """What records the answer under ``rid`` (None: no id, or the audit is off)."""
        recorder = self.recorder
        if rid is None or recorder is None:
            return None

        def record(hits: dict[str, tuple[Hit, Hit]], chain: Chain, views: ViewCache) -> None:
            recorder.offer(
                rid,
                len(request.token_ids),
                request.block_size,
                request.cache_salt is not None,
                hits,
                chain(request.block_size, 0),
                hybrid_stops(hits, views, chain, request.block_size),
            )

        return record


class PostOnly:
    """Middleware: every method but POST on this path is a 405 with ``Allow: POST``.

    Falcon alone would answer OPTIONS itself (200) and call a non-standard method a 400.
    """

    def process_resource(
        self, req: falcon.Request, resp: falcon.Response, resource: object, params: dict[str, Any]
    ) -> None:
        if req.uri_template == PATH and req.method != "POST":
            raise falcon.HTTPMethodNotAllowed(["POST"])
