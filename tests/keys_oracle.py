"""The readable, one-call key parses that only tests make: oracles kept out of
``services/l3_poller/keys_parser.py``, whose hot path
(:meth:`services.l3_poller.index.MasterIndex.feed`) splits a key and parses its prefix
itself, for speed. The tests check that it agrees with these.

:func:`split_key` splits the hash tail off a key (either tail shape); :func:`parse_any` is
:func:`split_key` then :func:`parse_prefix`, as the index applies them; :func:`parse_key` is
an independent spelling of vLLM's in-tree key format, one regex over the whole key.
"""

from __future__ import annotations

import re
from typing import NamedTuple

from services.l3_poller.keys_parser import (
    FAMILIES,
    HASH_HEX,
    AnyNamespace,
    Namespace,
    hash_u64,
    parse_prefix,
    split_layer_tail,
)

_VLLM_KEY = re.compile(
    r"(?P<head>.+?)@tp_rank:(\d+)@pcp(\d+)@dcp(\d+)@pp_rank:(\d+)(?:@group:(\d+))?"
    r"@(?P<hex>[0-9a-f]{16,})"
)


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


def parse_key(key: str) -> ParsedKey | None:
    """Parse one vLLM (in-tree) store key; ``None`` for anything else."""
    m = _VLLM_KEY.fullmatch(key)
    if m is None:
        return None
    g = m.groups()
    ranks = (int(g[1]), int(g[2]), int(g[3]), int(g[4]), int(g[5] or 0))
    return ParsedKey(m["head"], *ranks, hash_u64(m["hex"]))


def split_key(key: bytes) -> tuple[bytes, bytes, int] | None:
    """``b"<prefix>@<hex>"`` → (prefix, b"", u64); ``b"<prefix>@<hex>@<layer>"`` (old
    layer-wise) → (prefix, layer, u64); ``None`` when neither tail shape is there."""
    prefix, sep, tail = key.rpartition(b"@")
    if not sep or not prefix:
        return None
    if HASH_HEX.fullmatch(tail) is not None:
        return prefix, b"", int(tail[-16:], 16)
    layered = split_layer_tail(prefix, tail)
    return None if layered is None else (layered[0], tail, int(layered[1][-16:], 16))


def parse_any(key: str, formats: tuple[str, ...] = FAMILIES) -> tuple[AnyNamespace, int] | None:
    """Any supported key → (namespace, u64), or ``None``."""
    split = split_key(key.encode("utf-8", "surrogateescape"))
    if split is None:
        return None
    prefix, layer, u64 = split
    ns = parse_prefix(prefix.decode("utf-8", "replace"), layer.decode(), formats)
    return None if ns is None else (ns, u64)
