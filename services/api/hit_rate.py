"""``POST /kv-cache/hit-rate``: read and validate the request, hash the prompt, score instances.

The contract (original-contract.md §1) in short: one score per ``server_ip`` in input order,
duplicates kept; ``n = len(token_ids) // block_size`` full blocks; a ratio is the
instance's hit in a tier divided by ``n``, the hit being vLLM's rule as
:mod:`services.api.scoring` applies it (the longest run from block 0 for a single-group
model). A request's Redis reads are one pipelined round trip, plus one more only for
candidates whose group descriptors changed meanwhile (:mod:`services.api.scoring`). Every
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
key every chain the request hashes; without them the hasher is called exactly as before.
"""

from __future__ import annotations

import logging
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import falcon
import numpy as np
import orjson
import redis

from common.blockhash_extra import PLAIN, HashInputs
from common.config import HTTP
from common.errors import RequestError
from services.api import request_inputs
from services.api.api_metrics import ApiMetrics
from services.api.scoring import Hit, Scorer, StoreReads, ViewCache, parse_view, raw_of

logger = logging.getLogger(__name__)

PATH = "/kv-cache/hit-rate"
_READ_CHUNK = 64 * 1024
_TOP_FIELDS = ("server_ip", "body")
_BODY_FIELDS = ("token_ids", "cache_salt", "block_size", *request_inputs.FIELDS)
_BODY_REQUIRED = ("token_ids", "block_size")
DEFAULT_MAX_CANDIDATES = HTTP().max_candidates
LOOKUPS_PER_CANDIDATE = 4096
"""Full blocks per distinct candidate that one request may have looked up, on average."""
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


@dataclass(frozen=True)
class HitRateRequest:
    server_ips: list[str]
    token_ids: Sequence[int]  # usually an array("Q") (:func:`_token_ids`)
    block_size: int
    cache_salt: str | None  # "" in the request means no salt: stored as None
    inputs: HashInputs = PLAIN  # LoRA and multimodal items (:mod:`services.api.request_inputs`)


def read_body(req: falcon.Request, limit: int) -> bytes:
    """The raw body, refusing (413) anything over ``limit`` bytes without reading it all."""
    length = req.content_length
    if length is not None:
        if length > limit:
            raise RequestError(413, f"the request body is larger than the limit of {limit} bytes")
        return req.bounded_stream.read()
    if "chunked" not in (req.get_header("Transfer-Encoding") or "").lower():
        return b""  # no Content-Length and not chunked: HTTP says there is no body
    data = bytearray()
    while len(data) <= limit:
        chunk = req.stream.read(min(_READ_CHUNK, limit + 1 - len(data)))
        if not chunk:
            break
        data += chunk
    if len(data) > limit:
        raise RequestError(413, f"the request body is larger than the limit of {limit} bytes")
    return bytes(data)


def parse_request(
    raw: bytes,
    max_candidates: int = DEFAULT_MAX_CANDIDATES,
    vllm_version: tuple[int, ...] = (0, 28, 0),
) -> HitRateRequest:
    """Decode and validate a hit-rate request body; :class:`RequestError` (400) if invalid,
    including more than ``max_candidates`` distinct ``server_ip`` values, and LoRA or
    multimodal fields the configured ``vllm_version`` cannot hash."""
    if not raw.strip():
        raise _bad("the request body is empty")
    try:
        doc = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise _bad(f"the request body is not valid JSON ({exc})") from None
    top = _fields(doc, "", _TOP_FIELDS, _TOP_FIELDS)
    ips = top["server_ip"]
    if not isinstance(ips, list):
        raise _bad(f"server_ip must be a list of strings, got {_kind(ips)}")
    if not ips:
        raise _bad("server_ip must not be empty")
    for i, ip in enumerate(ips):
        if not isinstance(ip, str):
            raise _bad(f"server_ip[{i}] must be a string, got {_kind(ip)}")
    if len(ips) > max_candidates and len(set(ips)) > max_candidates:
        raise _bad(
            f"server_ip names {len(set(ips))} distinct instances, more than the limit "
            f"of {max_candidates} (http.maxCandidates)"
        )
    body = _fields(top["body"], "body.", _BODY_FIELDS, _BODY_REQUIRED)
    block_size = body["block_size"]
    if type(block_size) is not int:
        raise _bad(f"body.block_size must be an integer, got {_kind(block_size)}")
    if block_size <= 0:
        raise _bad(f"body.block_size must be greater than 0, got {block_size}")
    salt = body.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise _bad(f"body.cache_salt must be a string or null, got {_kind(salt)}")
    token_ids = _token_ids(body["token_ids"], raw)
    inputs = request_inputs.parse_inputs(body, len(token_ids), vllm_version)
    request = HitRateRequest(ips, token_ids, block_size, salt or None, inputs)
    _check_lookups(request, max_candidates)
    return request


def _check_lookups(request: HitRateRequest, max_candidates: int) -> None:
    """Bound one request's Redis work: distinct candidates × full blocks (set look-ups per
    tier) at most ``max_candidates × LOOKUPS_PER_CANDIDATE``; a tiny block size over a long
    prompt would otherwise ask Redis for billions of look-ups."""
    blocks = len(request.token_ids) // request.block_size
    limit = max_candidates * LOOKUPS_PER_CANDIDATE
    if blocks * len(request.server_ips) > limit:  # cheap bound first: duplicates cost nothing
        distinct = len(set(request.server_ips))
        if blocks * distinct > limit:
            raise _bad(
                f"the request needs {blocks * distinct} block look-ups per tier "
                f"({distinct} instances × {blocks} blocks), more than the limit of "
                f"{limit} (http.maxCandidates × {LOOKUPS_PER_CANDIDATE})"
            )


def _fields(
    doc: Any, prefix: str, allowed: tuple[str, ...], required: tuple[str, ...]
) -> dict[str, Any]:
    where = prefix.rstrip(".") or "the request body"
    if not isinstance(doc, dict):
        raise _bad(f"{where} must be a JSON object, got {_kind(doc)}")
    for name in doc:
        if name not in allowed:
            raise _bad(f"the request has an unknown field {prefix}{name}")
    for name in required:
        if name not in doc:
            raise _bad(f"the required field {prefix}{name} is missing")
    return doc


def _token_ids(ids: Any, raw: bytes) -> Sequence[int]:
    """JSON integers only (no ``true``, no ``1.0``); the range is the hasher's to check.

    Usually returns the ids as an ``array("Q")``: the conversion that validates them is the
    one the hasher needs, so it is done once per request.
    """
    if not isinstance(ids, list):
        raise _bad(f"body.token_ids must be a list of integers, got {_kind(ids)}")
    if not ids:
        return ids
    if (converted := _plain_ints(ids, raw)) is not None:
        return converted
    # The loop below only names the culprit (or finds none: ints the hasher range-checks).
    for i, t in enumerate(ids):
        if type(t) is not int:
            raise _bad(f"body.token_ids[{i}] must be a non-negative integer, got {t!r}")
    return ids


def _plain_ints(ids: list[Any], raw: bytes) -> array[int] | None:
    """The ids as ``array("Q")`` if every one is an int (not a bool) in ``[0, 2**64)``, in C
    passes over the list; else None.

    ``array("Q", …)`` takes exactly the ints and bools in ``[0, 2**64)``, a bool as 0 or 1;
    so only the ids that came out as 0 or 1 need their type checked (numpy finds them), and
    none at all when the body has no ``true``/``false`` anywhere.
    """
    try:
        converted = array("Q", ids)
    except (TypeError, OverflowError):
        return None
    zeros_and_ones = np.flatnonzero(np.frombuffer(converted, np.uint64) <= 1).tolist()
    if zeros_and_ones and (b"true" in raw or b"false" in raw):
        if any(type(ids[i]) is not int for i in zeros_and_ones):
            return None
    return converted


def _kind(value: Any) -> str:
    names = {
        dict: "an object",
        list: "a list",
        str: "a string",
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        type(None): "null",
    }
    return names.get(type(value), type(value).__name__)


def _bad(message: str) -> RequestError:
    return RequestError(400, message)


def score(
    request: HitRateRequest,
    store: StoreReads,
    hasher: Hasher,
    metrics: ApiMetrics,
    views: ViewCache | None = None,
    *,
    detail: bool = False,
    vllm_version: tuple[int, ...] = (0, 28, 0),
) -> list[dict[str, Any]]:
    """One ``{server_ip, l1_hit_ratio, l3_hit_ratio}`` per requested ip, in input order;
    with ``detail`` also each tier's hit in tokens, whether it is exact, and why not.

    The prompt is hashed once per distinct hash unit among the candidates (the request's
    block size for single-group instances); the reads are one pipelined round trip, plus
    one for the candidates whose KV-cache groups changed since this worker last saw them
    (:mod:`services.api.scoring`)."""
    views = views if views is not None else ViewCache()
    chains: dict[int, Sequence[bytes]] = {}
    # LoRA and items only when given: a plain request calls the hasher exactly as before
    extra = {} if request.inputs is PLAIN else {"inputs": request.inputs}

    def chain(unit: int) -> Sequence[bytes]:
        if unit not in chains:  # hashes every full unit, range-checks every id
            chains[unit] = hasher.member_keys(request.token_ids, unit, request.cache_salt, **extra)
            metrics.hashed_blocks.inc(len(chains[unit]))
        return chains[unit]

    try:
        chain(request.block_size)
    except ValueError as exc:  # a negative id, or one wider than the configured vLLM's ids
        raise RequestError(400, f"body.token_ids cannot be hashed for vLLM: {exc}") from None
    distinct = list(dict.fromkeys(request.server_ips))
    n_tokens = len(request.token_ids)
    if n_tokens < request.block_size:  # no full block: nothing to read
        hits = {ip: (Hit(0, 0.0), Hit(0, 0.0)) for ip in distinct}
    else:
        try:
            hits = _read_hits(
                distinct,
                Scorer(n_tokens, request.block_size, chain, store),
                views,
                vllm_version,
                metrics,
            )
        except redis.RedisError as exc:
            metrics.redis_errors.inc(op="hit_rate")
            logger.warning("hit rate: Redis failed: %s", exc)
            raise RequestError(500, UNREACHABLE) from None
    for l1, l3 in hits.values():
        for tier, hit in (("l1", l1), ("l3", l3)):
            for reason in hit.reasons:
                metrics.inexact.inc(tier=tier, reason=reason)
    if hits:  # what the router can gain from this request: its best candidate, per tier
        metrics.best_hit_ratio.observe(max(h[0].ratio for h in hits.values()), tier="l1")
        metrics.best_hit_ratio.observe(max(h[1].ratio for h in hits.values()), tier="l3")
    return [_answer(ip, *hits[ip], detail) for ip in request.server_ips]


def _read_hits(
    ips: list[str],
    scorer: Scorer,
    views: ViewCache,
    vllm_version: tuple[int, ...],
    metrics: ApiMetrics,
) -> dict[str, tuple[Hit, Hit]]:
    """Round trip 1 with every candidate's cached view; a second for the changed ones."""
    old = {ip: views.get(ip) for ip in ips}
    slots = {ip: scorer.queue(ip, old[ip]) for ip in ips}
    replies = scorer.store_execute()
    out, changed = {}, {}
    for ip in ips:
        s = slots[ip]
        if raw_of(replies[s.groups], replies[s.l3_groups]) == old[ip].raw:
            out[ip] = scorer.evaluate(old[ip], s, replies)
        else:
            fresh = parse_view(replies[s.groups], replies[s.l3_groups], vllm_version)
            views.put(ip, fresh)
            changed[ip] = fresh
    if changed:
        metrics.group_rereads.inc(len(changed))
        again = scorer.fresh()
        slots2 = {ip: again.queue(ip, view, descriptors=False) for ip, view in changed.items()}
        replies2 = again.store_execute()
        for ip, view in changed.items():
            out[ip] = again.evaluate(view, slots2[ip], replies2)
    return out


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
    ) -> None:
        self.store, self.hasher, self.metrics = store, hasher, metrics
        self.body_limit, self.max_candidates = body_limit, max_candidates
        self.vllm_version = vllm_version
        self.views = ViewCache()

    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        request = parse_request(
            read_body(req, self.body_limit), self.max_candidates, self.vllm_version
        )
        detail = req.get_param_as_bool("detail", default=False)
        scores = score(
            request,
            self.store,
            self.hasher,
            self.metrics,
            self.views,
            detail=bool(detail),
            vllm_version=self.vllm_version,
        )
        resp.content_type = falcon.MEDIA_JSON
        resp.data = orjson.dumps({"server_score_list": scores, "message": "", "status": 0})


class PostOnly:
    """Middleware: every method but POST on this path is a 405 with ``Allow: POST``.

    Falcon alone would answer OPTIONS itself (200) and call a non-standard method a 400.
    """

    def process_resource(
        self, req: falcon.Request, resp: falcon.Response, resource: object, params: dict[str, Any]
    ) -> None:
        if req.uri_template == PATH and req.method != "POST":
            raise falcon.HTTPMethodNotAllowed(["POST"])
