"""HTTP client of one Mooncake master's admin port, and parsers of its response bodies.

Endpoints used (all GET): ``/get_all_keys`` (streamed, one key per ``\\n``-terminated line),
``/get_all_segments`` (one segment name per line), ``/get_segments_detail`` (≥ 0.3.12;
te_endpoint → segment name), ``/batch_query_keys?keys=k1,k2`` (≥ 0.3.9; read-only from
0.3.12) and ``/query_key?key=k`` (fallback for masters without the batch endpoint).

Keys are sent **raw**: ``/query_key`` never URL-decodes its parameter and
``/batch_query_keys`` decodes it only from 0.3.12, so a percent-encoded key is a false miss
on some version. httpx sends a URL *string* as is for the characters vLLM keys use (``@``,
``:``; checked in the tests), whereas ``params=`` would encode them; callers only pass keys
that :func:`~services.l3_poller.keys_parser.is_url_safe` accepts.

Two body formats of ``/query_key``: ≤ 0.3.11 ``text/plain`` with one replica JSON object
per line (miss: 404 ``OBJECT_NOT_FOUND``); ≥ 0.3.12 ``{"success":true,"data":[…]}``.
Every failure is a :class:`MasterError` whose ``reason`` labels the error counter.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Any

import httpx
import orjson

from common.errors import UpstreamError

Replicas = tuple[str, ...]
"""Transport endpoints (``host:port``) of a key's replicas; ``()`` = no segment (disk only)."""

MAX_URL_BYTES = 32 * 1024
"""Bound on a batch query URL (httpx refuses URLs over 64 KiB; keep well below)."""


class MasterError(UpstreamError):
    """A master request failed: ``reason`` is down, timeout, status_<code>, garbage, truncated."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


class NoBatchEndpoint(MasterError):
    """The master predates ``/batch_query_keys`` (< 0.3.9): use ``/query_key``."""


def replicas_of(entry: dict[str, Any]) -> Replicas:
    """Endpoints of one key's entry: memory replicas and local-disk replicas (≥ 0.3.12)."""
    out = [str(v["transport_endpoint_"]) for v in entry.get("values") or ()]
    out += [str(v["transport_endpoint"]) for v in entry.get("local_disk_values") or ()]
    return tuple(dict.fromkeys(out))


def parse_batch_body(body: bytes) -> dict[str, Replicas | None]:
    """``/batch_query_keys`` (0.3.9 … 0.3.13): key → replica endpoints, ``None`` = not found."""
    try:
        doc = orjson.loads(body)
        data = doc["data"] if doc.get("success") else None
        if not isinstance(data, dict):
            raise MasterError(f"batch_query_keys failed: {body[:200]!r}", "garbage")
        return {k: replicas_of(e) if e.get("ok") else None for k, e in data.items()}
    except (orjson.JSONDecodeError, AttributeError, KeyError, TypeError) as exc:
        raise MasterError(f"batch_query_keys: bad body ({exc})", "garbage") from exc


def parse_query_key_body(status: int, body: bytes) -> Replicas | None:
    """``/query_key`` in both formats; ``None`` when the key is not found (404)."""
    if status == 404:
        return None
    if status != 200:
        raise MasterError(f"query_key: HTTP {status}", f"status_{status}")
    text = body.strip()
    if not text:
        return ()  # ≤ 0.3.11: no memory replica
    try:
        doc = orjson.loads(text)
        if isinstance(doc, dict) and "success" in doc:  # ≥ 0.3.12 envelope
            if not doc["success"]:
                return None
            return tuple(dict.fromkeys(str(v["transport_endpoint_"]) for v in doc["data"]))
        lines = [doc]
    except orjson.JSONDecodeError:
        lines = []  # ≤ 0.3.11 with several replicas: one object per line
    try:
        lines = lines or [orjson.loads(line) for line in text.splitlines() if line.strip()]
        return tuple(dict.fromkeys(str(v["transport_endpoint_"]) for v in lines))
    except (orjson.JSONDecodeError, KeyError, TypeError) as exc:
        raise MasterError(f"query_key: bad body ({exc})", "garbage") from exc


def parse_segments_body(body: bytes) -> list[str]:
    return [s for s in body.decode("utf-8", "replace").splitlines() if s.strip()]


def parse_segments_detail(body: bytes) -> dict[str, str]:
    """``/get_segments_detail`` → te_endpoint → segment name (every status)."""
    try:
        doc = orjson.loads(body)
        return {str(s["te_endpoint"]): str(s["segment_name"]) for s in doc["segments"]}
    except (orjson.JSONDecodeError, KeyError, TypeError) as exc:
        raise MasterError(f"get_segments_detail: bad body ({exc})", "garbage") from exc


def batches(keys: Sequence[bytes], size: int) -> Iterator[Sequence[bytes]]:
    """Split keys into runs of at most ``size`` keys and :data:`MAX_URL_BYTES` bytes."""
    start, length = 0, 0
    for i, key in enumerate(keys):
        if i > start and (i - start >= size or length + len(key) + 1 > MAX_URL_BYTES):
            yield keys[start:i]
            start, length = i, 0
        length += len(key) + 1
    if start < len(keys):
        yield keys[start:]


class MasterClient:
    """One master; ``base_url`` already has its scheme (``http://10.0.0.9:9003``)."""

    def __init__(self, base_url: str, timeout: float, segments_timeout: float,
                 transport: httpx.BaseTransport | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self._segments_timeout = segments_timeout
        self._http = httpx.Client(timeout=timeout, transport=transport,
                                  headers={"Accept-Encoding": "identity"})

    def close(self) -> None:
        self._http.close()

    def _get(self, path: str, timeout: float | None = None) -> httpx.Response:
        try:
            if timeout is None:
                return self._http.get(self.base_url + path)
            return self._http.get(self.base_url + path, timeout=timeout)
        except httpx.TimeoutException as exc:
            raise MasterError(f"{path.split('?')[0]}: {exc!r}", "timeout") from exc
        except httpx.HTTPError as exc:
            raise MasterError(f"{path.split('?')[0]}: {exc!r}", "down") from exc

    def iter_keys(self, deadline: float) -> Iterator[list[bytes]]:
        """Stream ``/get_all_keys`` as lists of lines (one per 64 KiB read); raises if the
        body is cut or is not key text. Never holds the whole body."""
        try:
            with self._http.stream("GET", self.base_url + "/get_all_keys") as resp:
                _check(resp, "get_all_keys", "text/plain")
                carry = b""
                for chunk in resp.iter_bytes(1 << 16):
                    if b"\0" in chunk:
                        raise MasterError("get_all_keys: binary body", "garbage")
                    if time.monotonic() > deadline:
                        raise MasterError("get_all_keys: body too slow", "timeout")
                    lines = (carry + chunk).split(b"\n")
                    carry = lines.pop()
                    yield lines
                if carry:
                    raise MasterError("get_all_keys: last line not terminated", "truncated")
        except httpx.TimeoutException as exc:
            raise MasterError(f"get_all_keys: {exc!r}", "timeout") from exc
        except httpx.RemoteProtocolError as exc:
            raise MasterError(f"get_all_keys: {exc!r}", "truncated") from exc
        except httpx.HTTPError as exc:
            raise MasterError(f"get_all_keys: {exc!r}", "down") from exc

    def segments(self) -> list[str]:
        resp = self._get("/get_all_segments", self._segments_timeout)
        _check(resp, "get_all_segments", "text/plain")
        return parse_segments_body(resp.content)

    def segments_detail(self) -> dict[str, str] | None:
        """te_endpoint → segment name, or ``None`` on masters without the endpoint (≤ 0.3.11)."""
        resp = self._get("/get_segments_detail", self._segments_timeout)
        if resp.status_code == 404:
            return None
        _check(resp, "get_segments_detail", "application/json")
        return parse_segments_detail(resp.content)

    def batch_query(self, keys: Sequence[bytes]) -> dict[str, Replicas | None]:
        resp = self._get("/batch_query_keys?keys=" + b",".join(keys).decode())
        if resp.status_code == 404:
            raise NoBatchEndpoint("no /batch_query_keys on this master", "no_batch")
        _check(resp, "batch_query_keys", "application/json")
        return parse_batch_body(resp.content)

    def query_key(self, key: bytes) -> Replicas | None:
        resp = self._get("/query_key?key=" + key.decode())
        if resp.status_code not in (200, 404):
            _check(resp, "query_key", "")
        return parse_query_key_body(resp.status_code, resp.content)


def _check(resp: httpx.Response, what: str, content_type: str) -> None:
    if resp.status_code != 200:
        raise MasterError(f"{what}: HTTP {resp.status_code}", f"status_{resp.status_code}")
    if content_type and not resp.headers.get("content-type", "").startswith(content_type):
        raise MasterError(f"{what}: unexpected content type "
                          f"{resp.headers.get('content-type')!r}", "garbage")
