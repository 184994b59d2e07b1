"""Mooncake store keys of the two supported connector families → namespace + u64 hash.

Family ``vllm`` — vLLM's in-tree ``MooncakeStoreConnector`` (one object per block × rank
namespace × KV-cache group, not per layer)::

    0.21        {model}@tp_rank:{r}@pcp{p}@dcp{d}@pp_rank:{pp}@{hex}
    0.22+       {model}@tp_rank:{r}@pcp{p}@dcp{d}@pp_rank:{pp}@group:{g}@{hex}
    0.26+       {cache_prefix}@ prepended when the connector's ``cache_prefix`` is set
    0.34        {model}{store_namespace}@tp_rank:…, store_namespace = @store_tp:{T}@store_pp:…

Everything before ``@tp_rank:`` is the *head* (``[prefix@]model[namespace][@cfg:…]``): two
keys with the same head belong to the same model deployment.

Family ``vllm-ascend`` — ``AscendStoreConnector`` (alias ``MooncakeConnectorStoreV1``),
vllm-ascend v0.13 → main; ``form`` names the release family of the key layout::

    A     v0.13–v0.19   {m}@pcp{p}@dcp{d}@head_or_tp_rank:{r}@pp_rank:{pp}@{hex}
    C     v0.20.2+      {m}@pcp{p}@dcp{d}@head_or_tp_rank:{r}@pp_rank:{pp}@group:{g}
                            @cache_role:{c}@cache_family:{f}@{hex}
    A-LW  v0.13–v0.19   {m}@pcp{p}@dcp{d}@head_or_tp_rank:{r}@{hex}@{layer}
    C-LW  v0.20.2       {m}@…@head_or_tp_rank:{r}@group:{g}@…@cache_family:{f}@{hex}@{layer}
    E-LW  v0.21+        {m}@…@cache_family:{f}@layer_id:{layer}@{hex}

(LW = ``use_layerwise``: one object per layer, no pp field.) In A-LW/C-LW keys the text
after the last ``@`` is the decimal layer id, not the hash.

``hex`` is the block hash (``BlockHash.hex()``: 64 hex digits for sha256, more for grouped
hashes of hybrid models); the integer vLLM's KV events and this project's API use is its
low 64 bits, ``int(hex[-16:], 16)``.

Pure functions, no I/O. The poller's hot path, :meth:`MasterIndex.feed`, splits a key's
``@{hex}`` tail itself (bytes in, no regex unless the prefix is new), calls
:func:`split_layer_tail` for any other tail and :func:`parse_prefix` once per distinct
(prefix, layer tail). The readable one-call versions it must agree with are test oracles
(``tests/keys_oracle.py``).
"""

from __future__ import annotations

import re
from typing import NamedTuple

from common.config import KEY_FORMATS

U64_MASK = (1 << 64) - 1
FAMILIES = KEY_FORMATS
"""Key families, as ``ingest.l3.keyFormats`` names them."""

_RANKS = r"@tp_rank:(\d+)@pcp(\d+)@dcp(\d+)@pp_rank:(\d+)(?:@group:(\d+))?"
_PREFIX = re.compile(r"(?P<head>.+?)" + _RANKS)
_ASCEND = re.compile(
    r"(?P<model>.+?)@pcp(?P<pcp>\d+)@dcp(?P<dcp>\d+)@head_or_tp_rank:(?P<head>\d+)"
    r"(?:@pp_rank:(?P<pp>\d+))?"
    r"(?:@group:(?P<group>\d+)@cache_role:(?P<role>[A-Za-z0-9_]+)"
    r"@cache_family:(?P<family>[A-Za-z0-9_]+))?"
    r"(?:@layer_id:(?P<layer>\d+))?"
)
HASH_HEX = re.compile(rb"[0-9a-f]{16,}")
"""A block hash as ``BlockHash.hex()`` writes it (64 digits for sha256; ≥ 16 for a u64)."""
_URL_SAFE = re.compile(rb"[A-Za-z0-9._~@:/=-]+")
"""Key bytes that go into a query string unencoded through httpx and every master version
(no ``%`` or ``+``: 0.3.12+ URL-decodes ``batch_query_keys``; no ``,``: its separator)."""


class Namespace(NamedTuple):
    """A vLLM key's object family: the model head, its rank namespace and group."""

    head: str
    tp: int
    pcp: int
    dcp: int
    pp: int
    group: int

    @property
    def deployment(self) -> tuple[str, ...]:
        return ("vllm", self.head)


class AscendNamespace(NamedTuple):
    """A vllm-ascend key's object family (``pp``/``layer`` are -1 where the form has none)."""

    model: str
    form: str
    pcp: int
    dcp: int
    head: int
    pp: int
    group: int
    role: str
    family: str
    layer: int

    @property
    def deployment(self) -> tuple[str, ...]:
        """Keys of one deployment: same model and same layout (a v0.18 and a v0.20 engine
        of the same model on one master write different keys, never usable by the other)."""
        return ("vllm-ascend", self.form, self.model)


AnyNamespace = Namespace | AscendNamespace


def hash_u64(hex_digest: str | bytes) -> int:
    """vLLM's KV-event integer of a block hash: its last 8 bytes, big-endian, unsigned."""
    return int(hex_digest[-16:], 16)


def _namespace(m: re.Match[str]) -> Namespace:
    g = m.groups()
    return Namespace(m["head"], int(g[1]), int(g[2]), int(g[3]), int(g[4]), int(g[5] or 0))


def _ascend(prefix: str, layer: str) -> AscendNamespace | None:
    m = _ASCEND.fullmatch(prefix)
    if m is None:
        return None
    pp, group, layer_id = m["pp"], m["group"], m["layer"]
    if layer:  # …@{hex}@{layer}: A-LW / C-LW, neither pp nor layer_id
        if pp is not None or layer_id is not None:
            return None
        form, lay = ("C-LW" if group else "A-LW"), int(layer)
    elif layer_id is not None:  # …@layer_id:{L}@{hex}: E-LW, always with a group
        if pp is not None or group is None:
            return None
        form, lay = "E-LW", int(layer_id)
    elif pp is not None:
        form, lay = ("C" if group else "A"), -1
    else:
        return None  # no pp and no layer: no release writes that
    return AscendNamespace(
        m["model"],
        form,
        int(m["pcp"]),
        int(m["dcp"]),
        int(m["head"]),
        -1 if pp is None else int(pp),
        int(group or 0),
        m["role"] or "kv",
        m["family"] or "default",
        lay,
    )


def parse_prefix(
    prefix: str, layer: str = "", formats: tuple[str, ...] = FAMILIES
) -> AnyNamespace | None:
    """Parse a key without its ``@{hex}`` (and without ``@{layer}`` after it, passed as
    ``layer``: the old layer-wise tail, ``""`` for any other key). Only the families in
    ``formats``."""
    if "vllm-ascend" in formats and "@head_or_tp_rank:" in prefix:
        return _ascend(prefix, layer)
    if "vllm" in formats and not layer:
        m = _PREFIX.fullmatch(prefix)
        return None if m is None else _namespace(m)
    return None


def split_layer_tail(prefix: bytes, layer: bytes) -> tuple[bytes, bytes] | None:
    """A key whose last ``@`` field (``layer``) is not a hash: (head, hash hex) when it is
    the old layer-wise ``<head>@<hex>@<layer>``, else ``None``."""
    head, sep, hexpart = prefix.rpartition(b"@")
    if sep and head and layer.isdigit() and HASH_HEX.fullmatch(hexpart) is not None:
        return head, hexpart
    return None


def is_url_safe(key: bytes) -> bool:
    """True when the key can be sent raw in a query string (see ``_URL_SAFE``)."""
    return _URL_SAFE.fullmatch(key) is not None


def host_of(endpoint: str) -> str:
    """Host part of a segment name / transport endpoint: ``10.0.0.5:12345`` → ``10.0.0.5``,
    ``[fd00::1]:12345`` → ``fd00::1``, Ascend ``10.0.0.5:12345:npu_0`` → ``10.0.0.5``,
    Ascend fabric-memory ``10.0.0.5`` → ``10.0.0.5``."""
    if endpoint.startswith("["):
        end = endpoint.find("]")
        return endpoint[1:end] if end > 0 else endpoint
    parts = endpoint.split(":")
    if len(parts) <= 3:
        return parts[0]
    return endpoint.rsplit(":", 1)[0]  # a bare IPv6 address with a port, not bracketed
