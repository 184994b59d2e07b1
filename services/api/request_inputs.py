"""The hit-rate body's optional hash inputs: ``lora_name``, ``lora_path``, ``mm_features``.

They become one :class:`~common.blockhash_extra.HashInputs` that every chain of the request
is hashed with (L1 and L3, every hash unit of a hybrid model, ``?detail=1``). A body with
none of them gives :data:`~common.blockhash_extra.PLAIN`, and the hasher is called without
extra keys. Every problem is a 400 with one sentence naming the field:

- ``lora_name`` / ``lora_path``: a string or null; ``""`` means no LoRA. A LoRA on vLLM
  0.10.2 - 0.11.0 (keyed by a server-assigned id) and a missing ``lora_path`` on >= 0.31
  (which hashes the path) are refused, naming the configured release.
- ``mm_features``: a list of at most :data:`~common.blockhash_extra.MAX_MM_ITEMS` objects
  ``{"identifier": non-empty string, "offset": integer >= 0, "length": integer >= 1}``
  (an optional ``"modality"`` string is accepted and ignored: it does not enter vLLM's hash);
  each item inside ``token_ids``, no two overlapping. They are sorted by offset (stable) as
  vLLM's input processor sorts them.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from common import blockhash_extra as extras
from common.blockhash_extra import HashInputs, MmItem
from common.errors import RequestError

FIELDS = ("lora_name", "lora_path", "mm_features")
_ITEM_FIELDS = ("identifier", "offset", "length", "modality")
_ITEM_REQUIRED = ("identifier", "offset", "length")


def parse_inputs(body: dict[str, Any], n_tokens: int, vllm_version: tuple[int, ...]) -> HashInputs:
    """The HashInputs of a validated body's optional fields; RequestError (400) if bad."""
    if not any(name in body for name in FIELDS):
        return extras.PLAIN
    names = {}
    for label in ("lora_name", "lora_path"):
        value = body.get(label)
        if value is not None and not isinstance(value, str):
            raise _bad(f"body.{label} must be a string or null, got {_kind(value)}")
        names[label] = value or None
    items = _items(body.get("mm_features"))
    try:
        inputs = HashInputs(names["lora_name"], names["lora_path"], items)
        extras.check(_release(vllm_version), inputs, n_tokens)
    except ValueError as exc:
        raise _bad(f"body.{exc}" if str(exc).startswith(FIELDS) else str(exc)) from None
    return extras.PLAIN if inputs.plain else inputs


def _items(raw: Any) -> tuple[MmItem, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise _bad(f"body.mm_features must be a list of objects, got {_kind(raw)}")
    if len(raw) > extras.MAX_MM_ITEMS:
        raise _bad(
            f"body.mm_features has {len(raw)} items, more than the limit of {extras.MAX_MM_ITEMS}"
        )
    return tuple(_item(i, doc) for i, doc in enumerate(raw))


def _item(i: int, doc: Any) -> MmItem:
    where = f"body.mm_features[{i}]"
    doc = check_object(doc, where, f"{where}.", _ITEM_FIELDS, _ITEM_REQUIRED)
    identifier, modality = doc["identifier"], doc.get("modality")
    if not isinstance(identifier, str) or not identifier:
        raise _bad(f"{where}.identifier must be a non-empty string, got {_kind(identifier)}")
    if modality is not None and not isinstance(modality, str):
        raise _bad(f"{where}.modality must be a string, got {_kind(modality)}")
    for name, least in (("offset", 0), ("length", 1)):
        value = doc[name]
        if type(value) is not int or value < least:
            shown = value if type(value) is int else _kind(value)
            raise _bad(f"{where}.{name} must be an integer >= {least}, got {shown}")
    return MmItem(identifier, doc["offset"], doc["length"])


def _release(version: tuple[int, ...]) -> tuple[int, int, int]:
    padded = (*version, 0, 0, 0)[:3]
    return padded[0], padded[1], padded[2]


def check_object(
    doc: Any,
    where: str,
    prefix: str,
    allowed: Collection[str],
    required: Collection[str],
    *,
    noun: str = "an object",
    empty: bool = True,
) -> dict[str, Any]:
    """``doc`` if it is an object with only ``allowed`` fields and every ``required`` one;
    else the refusal naming ``where`` (the object) or ``prefix`` + the field."""
    if not isinstance(doc, dict):
        raise bad(f"{where} must be {noun}, got {kind(doc, empty=empty)}")
    for name in doc:
        if name not in allowed:
            raise bad(f"the request has an unknown field {prefix}{name}")
    for name in required:
        if name not in doc:
            raise bad(f"the required field {prefix}{name} is missing")
    return doc


def _kind(value: Any) -> str:
    return kind(value, empty=True)


def kind(value: Any, *, empty: bool = False) -> str:
    """A JSON value's type as a refusal names it (``empty``: ``""`` as an empty string)."""
    names = {
        dict: "an object",
        list: "a list",
        str: "an empty string" if empty and value == "" else "a string",
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        type(None): "null",
    }
    return names.get(type(value), type(value).__name__)


def bad(message: str) -> RequestError:
    """A refusal of the request (400)."""
    return RequestError(400, message)


_bad = bad
