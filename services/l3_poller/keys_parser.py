"""vLLM ``MooncakeStoreConnector`` store keys → (model head, rank namespace, group, u64 hash).

Key formats (one object per block × rank namespace × KV-cache group, not per layer)::

    0.21        {model}@tp_rank:{r}@pcp{p}@dcp{d}@pp_rank:{pp}@{hex}
    0.22+       {model}@tp_rank:{r}@pcp{p}@dcp{d}@pp_rank:{pp}@group:{g}@{hex}
    0.26+       {cache_prefix}@ prepended when the connector's ``cache_prefix`` is set
    0.34        {model}{store_namespace}@tp_rank:…, store_namespace = @store_tp:{T}@store_pp:…

Everything before ``@tp_rank:`` is the *head* (``[prefix@]model[namespace][@cfg:…]``): two
keys with the same head belong to the same model deployment. ``hex`` is the block hash
(``BlockHash.hex()``, 64 hex digits for sha256/sha256_cbor); the integer that vLLM's KV
events and this project's API use is its low 64 bits, ``int(hex[-16:], 16)``.

Pure functions, no I/O. The poller's hot path is :func:`split_key` (bytes in, no regex
unless the prefix is new) plus :func:`parse_prefix` once per distinct prefix.
"""

from __future__ import annotations

import re
from typing import NamedTuple

U64_MASK = (1 << 64) - 1

_RANKS = r"@tp_rank:(\d+)@pcp(\d+)@dcp(\d+)@pp_rank:(\d+)(?:@group:(\d+))?"
_PREFIX = re.compile(r"(?P<head>.+?)" + _RANKS)
_KEY = re.compile(r"(?P<head>.+?)" + _RANKS + r"@(?P<hex>[0-9a-f]{16,64})")
HASH_HEX = re.compile(rb"[0-9a-f]{16,64}")
"""A block hash as ``BlockHash.hex()`` writes it (64 digits for sha256; ≥ 16 for a u64)."""
_URL_SAFE = re.compile(rb"[A-Za-z0-9._~@:/=-]+")
"""Key bytes that go into a query string unencoded through httpx and every master version
(no ``%`` or ``+``: 0.3.12+ URL-decodes ``batch_query_keys``; no ``,``: its separator)."""


class Namespace(NamedTuple):
    """Which object family a key belongs to: the model head, its rank namespace and group."""

    head: str
    tp: int
    pcp: int
    dcp: int
    pp: int
    group: int


class ParsedKey(NamedTuple):
    head: str
    tp: int
    pcp: int
    dcp: int
    pp: int
    group: int
    hash_u64: int

    @property
    def namespace(self) -> Namespace:
        return Namespace(*self[:6])


def hash_u64(hex_digest: str | bytes) -> int:
    """vLLM's KV-event integer of a block hash: its last 8 bytes, big-endian, unsigned."""
    return int(hex_digest[-16:], 16)


def _namespace(m: re.Match[str]) -> Namespace:
    g = m.groups()
    return Namespace(m["head"], int(g[1]), int(g[2]), int(g[3]), int(g[4]), int(g[5] or 0))


def parse_key(key: str) -> ParsedKey | None:
    """Parse one store key; ``None`` when it is not a vLLM MooncakeStoreConnector key."""
    m = _KEY.fullmatch(key)
    if m is None:
        return None
    return ParsedKey(*_namespace(m), hash_u64(m["hex"]))


def parse_prefix(prefix: str) -> Namespace | None:
    """Parse a key without its final ``@{hex}`` (what :func:`split_key` returns)."""
    m = _PREFIX.fullmatch(prefix)
    return None if m is None else _namespace(m)


def split_key(key: bytes) -> tuple[bytes, int] | None:
    """``b"<prefix>@<hex>"`` → (prefix, u64 hash), or ``None`` when the tail is not a hash."""
    prefix, sep, tail = key.rpartition(b"@")
    if not sep or not prefix or HASH_HEX.fullmatch(tail) is None:
        return None
    return prefix, int(tail[-16:], 16)


def is_url_safe(key: bytes) -> bool:
    """True when the key can be sent raw in a query string (see ``_URL_SAFE``)."""
    return _URL_SAFE.fullmatch(key) is not None


def host_of(endpoint: str) -> str:
    """Host part of a segment name / transport endpoint: ``10.0.0.5:12345`` → ``10.0.0.5``,
    ``[fd00::1]:12345`` → ``fd00::1``, Ascend ``10.0.0.5:12345:npu_0`` → ``10.0.0.5``."""
    if endpoint.startswith("["):
        end = endpoint.find("]")
        return endpoint[1:end] if end > 0 else endpoint
    parts = endpoint.split(":")
    if len(parts) <= 3:
        return parts[0]
    return endpoint.rsplit(":", 1)[0]  # a bare IPv6 address with a port, not bracketed
