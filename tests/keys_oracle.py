"""The one-call key parse that only tests make: a test oracle, kept out of
``services/l3_poller/keys_parser.py``, whose callers split a key and parse its prefix
themselves (:class:`services.l3_poller.index.MasterIndex` inlines :func:`split_key`).

:func:`parse_any` is :func:`split_key` then :func:`parse_prefix`, as the index applies them.
"""

from __future__ import annotations

from services.l3_poller.keys_parser import FAMILIES, AnyNamespace, parse_prefix, split_key


def parse_any(key: str, formats: tuple[str, ...] = FAMILIES) -> tuple[AnyNamespace, int] | None:
    """Any supported key → (namespace, u64), or ``None``."""
    split = split_key(key.encode("utf-8", "surrogateescape"))
    if split is None:
        return None
    prefix, layer, u64 = split
    ns = parse_prefix(prefix.decode("utf-8", "replace"), layer.decode(), formats)
    return None if ns is None else (ns, u64)
