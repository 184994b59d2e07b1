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
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, NamedTuple

import httpx
import orjson

from common.errors import UpstreamError

Replicas = tuple[str, ...]
"""Transport endpoints (``host:port``) of a key's replicas; ``()`` = no segment (disk only)."""

MAX_URL_BYTES = 32 * 1024
"""Bound on a batch query URL (httpx refuses URLs over 64 KiB; keep well below)."""
MAX_KEY_BYTES = 4096
"""Longest ``/get_all_keys`` line kept. vLLM keys are ~130 bytes (model name + ranks + 64
hex); a longer line is some other tool's key (or a body that is not a key list) and is
skipped and counted (``reason="too_long"``), never buffered whole."""


class MasterError(UpstreamError):
    """A master request failed: ``reason`` is down, timeout, status_<code>, garbage, truncated."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


class NoBatchEndpoint(MasterError):
    """The master predates ``/batch_query_keys`` (< 0.3.9): use ``/query_key``."""


def _garbage(what: str, body: bytes) -> MasterError:
    return MasterError(f"{what}: bad body {body[:120]!r}", "garbage")


def _endpoints(replicas: Any, field: str, what: str, body: bytes) -> list[str]:
    """The ``field`` of each replica object of a list (``null`` = none). A replica without a
    string endpoint cannot be located and is left out; anything but a list of objects is
    garbage."""
    if replicas is None:
        return []
    if not isinstance(replicas, list) or not all(isinstance(r, dict) for r in replicas):
        raise _garbage(what, body)
    return [ep for r in replicas if isinstance(ep := r.get(field), str) and ep]


def replicas_of(entry: dict[str, Any], body: bytes = b"") -> Replicas:
    """Endpoints of one key's entry: memory replicas and local-disk replicas (≥ 0.3.12)."""
    out = _endpoints(entry.get("values"), "transport_endpoint_", "batch_query_keys", body)
    out += _endpoints(
        entry.get("local_disk_values"), "transport_endpoint", "batch_query_keys", body
    )
    return tuple(dict.fromkeys(out))


def parse_batch_body(body: bytes) -> dict[str, Replicas | None]:
    """``/batch_query_keys`` (0.3.9 … 0.3.13): key → replica endpoints, ``None`` = not found.
    Any other shape is a :class:`MasterError` ``garbage``."""
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise MasterError(f"batch_query_keys: bad body ({exc})", "garbage") from exc
    data = doc.get("data") if isinstance(doc, dict) and doc.get("success") is True else None
    if not isinstance(data, dict) or not all(isinstance(e, dict) for e in data.values()):
        raise _garbage("batch_query_keys", body)
    return {k: replicas_of(e, body) if e.get("ok") is True else None for k, e in data.items()}


def parse_query_key_body(status: int, body: bytes) -> Replicas | None:
    """``/query_key`` in both formats; ``None`` when the key is not found (404). Any other
    shape is a :class:`MasterError` ``garbage``."""
    if status == 404:
        return None
    if status != 200:
        raise MasterError(f"query_key: HTTP {status}", f"status_{status}")
    text = body.strip()
    if not text:
        return ()  # ≤ 0.3.11: no memory replica
    try:
        doc = orjson.loads(text)
    except orjson.JSONDecodeError:
        doc = None  # ≤ 0.3.11 with several replicas: one object per line
    if isinstance(doc, dict) and "success" in doc:  # ≥ 0.3.12 envelope
        if doc["success"] is False:
            return None
        if doc["success"] is not True or not isinstance(doc.get("data"), list):
            raise _garbage("query_key", body)
        replicas = doc["data"]
    elif doc is not None:
        replicas = [doc]
    else:
        try:
            replicas = [orjson.loads(line) for line in text.splitlines() if line.strip()]
        except orjson.JSONDecodeError as exc:
            raise MasterError(f"query_key: bad body ({exc})", "garbage") from exc
    return tuple(dict.fromkeys(_endpoints(replicas, "transport_endpoint_", "query_key", body)))


PER_KEY = ("master_evicted_key_count", "master_remove_requests_total")
"""Counters that grow by one per key removed (evicted, or one ``Remove`` request)."""
_CHURN_WORDS = ("remove", "evict", "promot", "drain", "move", "copy")
_NOT_CHURN = ("fail", "attempt", "bytes", "_size", "successful_evictions")


class Churn(NamedTuple):
    """What ``/metrics`` says of keys leaving replicas: ``per_key`` counts one per key
    (:data:`PER_KEY`); ``other`` sums every other counter of keys leaving or moving
    (batch/all/regex removes, promotions, drains, …), which cannot be counted per key."""

    per_key: int
    other: int


def parse_removals(body: bytes) -> Churn | None:
    """The :class:`Churn` counters of a ``/metrics`` body; None without a per-key one."""
    per_key = other = 0
    found = False
    for line in body.decode("utf-8", "replace").splitlines():
        if not line.startswith("master_"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if not any(w in name for w in _CHURN_WORDS) or any(w in name for w in _NOT_CHURN):
            continue
        if name not in PER_KEY and name.startswith(PER_KEY):
            continue  # a breakdown of a per-key count (0.3.13: master_evicted_key_count_mem)
        try:
            value = int(float(line.rsplit(" ", 1)[1]))
        except ValueError:
            continue
        if name in PER_KEY:
            per_key, found = per_key + value, True
        else:
            other += value
    return Churn(per_key, other) if found else None


def parse_segments_body(body: bytes) -> list[str]:
    return [s for s in body.decode("utf-8", "replace").splitlines() if s.strip()]


def parse_segments_detail(body: bytes) -> dict[str, str]:
    """``/get_segments_detail`` → te_endpoint → segment name (every status)."""
    try:
        doc = orjson.loads(body)
        return {
            s["te_endpoint"]: str(s["segment_name"])
            for s in doc["segments"]
            if isinstance(s["te_endpoint"], str)
        }
    except (orjson.JSONDecodeError, KeyError, TypeError) as exc:
        raise MasterError(f"get_segments_detail: bad body ({exc})", "garbage") from exc


class MasterClient:
    """One master; ``base_url`` already has its scheme (``http://10.0.0.9:9003``)."""

    def __init__(
        self,
        base_url: str,
        timeout: float,
        segments_timeout: float,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._segments_timeout = segments_timeout
        self._http = httpx.Client(
            timeout=timeout, transport=transport, headers={"Accept-Encoding": "identity"}
        )

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

    def iter_keys(
        self, deadline: float, skipped: Counter[str] | None = None
    ) -> Iterator[list[bytes]]:
        """Stream ``/get_all_keys`` as lists of lines (one per 64 KiB read); raises if the
        body is cut or is not key text. Never holds the whole body; lines longer than
        :data:`MAX_KEY_BYTES` are dropped and counted in ``skipped["too_long"]``."""
        try:
            with self._http.stream("GET", self.base_url + "/get_all_keys") as resp:
                _check(resp, "get_all_keys", "text/plain")
                yield from split_lines(
                    _checked(resp.iter_bytes(1 << 16), deadline),
                    skipped if skipped is not None else Counter(),
                )
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

    def removals(self) -> Churn | None:
        """The master's counts of keys that left a replica (``/metrics``, see
        :func:`parse_removals`); ``None`` if it does not say."""
        resp = self._get("/metrics", self._segments_timeout)
        if resp.status_code != 200:
            return None
        return parse_removals(resp.content)

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


def _checked(chunks: Iterator[bytes], deadline: float) -> Iterator[bytes]:
    for chunk in chunks:
        if b"\0" in chunk:
            raise MasterError("get_all_keys: binary body", "garbage")
        if time.monotonic() > deadline:
            raise MasterError("get_all_keys: body too slow", "timeout")
        yield chunk


def split_lines(
    chunks: Iterable[bytes], skipped: Counter[str], max_line: int = MAX_KEY_BYTES
) -> Iterator[list[bytes]]:
    """``\n``-terminated lines of a chunked body, one list per chunk. A line longer than
    ``max_line`` is dropped as it streams (``skipped["too_long"]``): at most ``max_line``
    bytes are carried between chunks, so a body without newlines costs linear time and
    bounded memory. An unterminated last line raises ``truncated``."""
    carry, overlong = b"", False
    for chunk in chunks:
        lines = chunk.split(b"\n")
        tail = lines.pop()
        if lines:
            if overlong or len(carry) + len(lines[0]) > max_line:
                del lines[0]  # the end of a line already too long
                skipped["too_long"] += 1
            else:
                lines[0] = carry + lines[0]
            carry, overlong = b"", False
            if lines and max(map(len, lines)) > max_line:  # only if a chunk > max_line
                n = len(lines)
                lines = [line for line in lines if len(line) <= max_line]
                skipped["too_long"] += n - len(lines)
        if overlong or len(carry) + len(tail) > max_line:
            carry, overlong = b"", True
        else:
            carry += tail
        yield lines
    if carry or overlong:
        raise MasterError("get_all_keys: last line not terminated", "truncated")


def _check(resp: httpx.Response, what: str, content_type: str) -> None:
    if resp.status_code != 200:
        raise MasterError(f"{what}: HTTP {resp.status_code}", f"status_{resp.status_code}")
    if content_type and not resp.headers.get("content-type", "").startswith(content_type):
        raise MasterError(
            f"{what}: unexpected content type {resp.headers.get('content-type')!r}", "garbage"
        )
