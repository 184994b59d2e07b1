"""The hit-rate request: its body read within the limit and validated into a
:class:`HitRateRequest` (original-contract.md §1; the limits are in :mod:`services.api.hit_rate`'s
docstring). Every refusal is a :class:`~common.errors.RequestError` (400, or 413 for a body
over ``http.maxHitRateBodyBytes``).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import falcon
import numpy as np
import orjson

from common.blockhash_extra import PLAIN, HashInputs
from common.config import HTTP
from common.errors import RequestError
from services.api import request_inputs
from services.api.audit_record import parse_request_id

_kind, _bad = request_inputs.kind, request_inputs.bad

_READ_CHUNK = 64 * 1024
_TOP_FIELDS = ("server_ip", "body", "request_id")
_TOP_REQUIRED = ("server_ip", "body")
_BODY_FIELDS = ("token_ids", "cache_salt", "block_size", *request_inputs.FIELDS)
_BODY_REQUIRED = ("token_ids", "block_size")
DEFAULT_MAX_CANDIDATES = HTTP().max_candidates
LOOKUPS_PER_CANDIDATE = 4096
"""Full blocks per distinct candidate that one request may have looked up, on average."""


@dataclass(frozen=True)
class HitRateRequest:
    server_ips: list[str]
    token_ids: Sequence[int]  # usually an array("Q") (:func:`_token_ids`)
    block_size: int
    cache_salt: str | None  # "" in the request means no salt: stored as None
    inputs: HashInputs = PLAIN  # LoRA and multimodal items (:mod:`services.api.request_inputs`)
    request_id: str | None = None  # the audit's key (services/api/audit_record.py)


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
    top = _fields(doc, "", _TOP_FIELDS, _TOP_REQUIRED)
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
    request = HitRateRequest(
        ips,
        token_ids,
        block_size,
        salt or None,
        inputs,
        request_id=parse_request_id(top.get("request_id")),
    )
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
    return request_inputs.check_object(
        doc, where, prefix, allowed, required, noun="a JSON object", empty=False
    )


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
