"""vLLM KV-cache events: the typed events, the batch decoder, and an encoder for the simulator.

Wire format (spec vllm-kv-events.md §2): an EventBatch is always a msgpack array
``[ts, events, data_parallel_rank]``. Events are ``[tag, field, ...]`` arrays up to vLLM 0.23
and ``{"type": tag, field: value, ...}`` maps from 0.24. The decoder accepts both forms. It
needs only ``block_hashes`` (plus ``token_ids`` and ``block_size`` for BlockStored, and in
array form the positions before them); any other missing field reads as None, and unknown keys
and trailing elements are ignored. Field types are checked exactly (an int is an int, not a
bool), so callers can trust the dataclasses. An event that fails becomes a
:class:`SkippedEvent` and the rest of the batch is still returned; a payload that is not a
batch at all raises :class:`~common.errors.NotABatchError`, and nothing else.

Hashes are ints (uint64, the default ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``) or bytes (raw
digests). Bytes must be a non-empty multiple of 16 long: 32 for sha256, 16 for xxhash, and k
concatenated digests for a hybrid group in 0.12-0.23 (§4.5). :func:`hash_to_int` maps both to
the uint64 the index is keyed by. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import msgpack

from common.errors import DecodeError, NotABatchError
from common.event_types import (
    MAP_FORM_SINCE,
    REMOVED_FIELDS,
    STORED_FIELDS,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    EventBatch,
    FieldSpec,
    Hash,
    SkippedEvent,
    Version,
)

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "Event",
    "EventBatch",
    "Hash",
    "SkippedEvent",
    "decode_batch",
    "encode_batch",
    "hash_to_int",
]

_STORED_KEYS = tuple(name for name, _, _ in STORED_FIELDS)
_REMOVED_KEYS = tuple(name for name, _, _ in REMOVED_FIELDS)
_STORED_NONES = [None] * len(_STORED_KEYS)
_REMOVED_NONES = [None] * len(_REMOVED_KEYS)
_STORED_INTS = ("lora_id", "group_idx", "kv_cache_spec_sliding_window")
_STORED_STRS = ("medium", "lora_name", "kv_cache_spec_kind", "locality", "ownership", "session_id")
_REMOVED_INTS = ("group_idx",)
_REMOVED_STRS = ("medium", "locality", "ownership")
_U64_END = 1 << 64
_HASH_KIND = "a uint64 or a 16n-byte digest"
_INT_ONLY = frozenset((int,))
# What vLLM puts in extra keys (names, ids, mm identifiers, offsets, digests), nested in arrays.
_EXTRA_KEY_LEAVES = frozenset((str, int, bytes, float, bool, type(None)))


def hash_to_int(h: Hash) -> int:
    """The uint64 an event hash stands for: an int as is, bytes by their last 8 (big-endian)."""
    if type(h) is int and 0 <= h < _U64_END:
        return h
    if type(h) is bytes:
        return int.from_bytes(h[-8:], "big")
    raise DecodeError(f"not a block hash: {_describe(h)}")


def _hashable_pairs(pairs: list[tuple[Any, Any]]) -> dict[Any, Any]:
    return {k: v for k, v in pairs if type(k) not in (list, dict)}


def _unpack_tolerant(payload: bytes) -> Any:
    """The slow path of :func:`decode_batch`: unhashable map keys are left out."""
    try:
        return msgpack.unpackb(
            payload, raw=False, strict_map_key=False, object_pairs_hook=_hashable_pairs
        )
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise NotABatchError(f"not msgpack: {exc}", "not_a_batch") from exc


def decode_batch(payload: bytes) -> EventBatch:
    """Decode one ZMQ payload; raise NotABatchError (and nothing else) if it is not a batch."""
    try:
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except TypeError:
        # A map with an array or map as a key (unhashable): decode again keeping the other
        # keys, so only that event is affected (a key we cannot name is an unknown key).
        batch = _unpack_tolerant(payload)
    except (ValueError, msgpack.UnpackException) as exc:
        raise NotABatchError(f"not msgpack: {exc}", "not_a_batch") from exc
    if type(batch) is not list or len(batch) < 2:
        raise NotABatchError(f"batch is {_describe(batch)}, not an array of 2+", "not_a_batch")
    ts, raw_events = batch[0], batch[1]
    rank = batch[2] if len(batch) > 2 else None
    if type(ts) is not float and type(ts) is not int:
        raise NotABatchError(f"ts is {_describe(ts)}", "not_a_batch")
    if type(raw_events) is not list:
        raise NotABatchError(f"events is {_describe(raw_events)}", "not_a_batch")
    if rank is not None and (type(rank) is not int or rank < 0):
        raise NotABatchError(f"data_parallel_rank is {_describe(rank)}", "not_a_batch")
    events: list[Event] = []
    skipped: list[SkippedEvent] = []
    for index, raw in enumerate(raw_events):
        try:
            events.append(_decode_event(raw))
        except DecodeError as exc:
            skipped.append(SkippedEvent(index, exc.reason, str(exc)))
    return EventBatch(float(ts), events, rank, skipped, _form_of(raw_events))


def _form_of(raw_events: list[Any]) -> str:
    for raw in raw_events:
        if type(raw) is list:
            return "array"
        if type(raw) is dict:
            return "map"
    return "empty"


def _decode_event(raw: object) -> Event:
    if type(raw) is list:
        tag = raw[0] if raw else None
        builder = _ARRAY_BUILDERS.get(tag) if type(tag) is str else None
    elif type(raw) is dict:
        tag = raw.get("type")
        builder = _MAP_BUILDERS.get(tag) if type(tag) is str else None
    else:
        raise DecodeError(f"event is {_describe(raw)}, not an array or map", "not_an_event")
    if builder is None:
        raise DecodeError(f"unknown event type {_describe(tag)}", "unknown_type")
    return builder(raw)


def _stored_from_array(raw: list[Any]) -> BlockStored:
    n = len(raw)
    if n < 5:
        raise DecodeError(f"BlockStored array has {n - 1} fields, needs 4+")
    return _build_stored(raw[1:16] if n >= 16 else raw[1:] + _STORED_NONES[n - 1 :])


def _stored_from_map(raw: dict[Any, Any]) -> BlockStored:
    return _build_stored(list(map(raw.get, _STORED_KEYS)))


def _build_stored(f: list[Any]) -> BlockStored:
    hashes, parent, tokens, block_size = f[0], f[1], f[2], f[3]
    _check_hashes("block_hashes", hashes)
    if parent is not None and not _is_hash(parent):
        raise _bad("parent_block_hash", parent, _HASH_KIND + " or nil")
    _check_ints("token_ids", tokens)
    if type(block_size) is not int or block_size < 0:
        raise _bad("block_size", block_size, "a non-negative int")
    _check_optional(_STORED_INTS, (f[4], f[8], f[10]), int)
    _check_optional(_STORED_STRS, (f[5], f[6], f[9], f[11], f[12], f[13]), str)
    if f[7] is not None:
        _check_extra_keys(f[7])
    if f[14] is not None:
        _check_lookahead(f[14])
    return BlockStored(*f)


def _removed_from_array(raw: list[Any]) -> BlockRemoved:
    n = len(raw)
    if n < 2:
        raise DecodeError("BlockRemoved array has no block_hashes")
    return _build_removed(raw[1:6] if n >= 6 else raw[1:] + _REMOVED_NONES[n - 1 :])


def _removed_from_map(raw: dict[Any, Any]) -> BlockRemoved:
    return _build_removed(list(map(raw.get, _REMOVED_KEYS)))


def _build_removed(f: list[Any]) -> BlockRemoved:
    _check_hashes("block_hashes", f[0])
    _check_optional(_REMOVED_INTS, (f[2],), int)
    _check_optional(_REMOVED_STRS, (f[1], f[3], f[4]), str)
    return BlockRemoved(*f)


def _cleared(raw: object) -> AllBlocksCleared:
    return AllBlocksCleared()


_ARRAY_BUILDERS: dict[str, Callable[[Any], Event]] = {
    "BlockStored": _stored_from_array,
    "BlockRemoved": _removed_from_array,
    "AllBlocksCleared": _cleared,
}
_MAP_BUILDERS: dict[str, Callable[[Any], Event]] = {
    "BlockStored": _stored_from_map,
    "BlockRemoved": _removed_from_map,
    "AllBlocksCleared": _cleared,
}


def _is_hash(h: object) -> bool:
    if type(h) is int:
        return 0 <= h < _U64_END
    return type(h) is bytes and len(h) > 0 and len(h) % 16 == 0


def _check_hashes(field: str, value: object) -> None:
    if type(value) is not list:
        raise _bad(field, value, "an array of hashes")
    if not all(map(_is_hash, value)):
        i = next(i for i, h in enumerate(value) if not _is_hash(h))
        raise _bad(f"{field}[{i}]", value[i], _HASH_KIND)


def _check_ints(field: str, value: object) -> None:
    if type(value) is not list:
        raise _bad(field, value, "an array of ints")
    if value and not {*map(type, value)} <= _INT_ONLY:
        i = next(i for i, x in enumerate(value) if type(x) is not int)
        raise _bad(f"{field}[{i}]", value[i], "an int")


def _check_optional(fields: tuple[str, ...], values: tuple[object, ...], kind: type) -> None:
    for field, value in zip(fields, values, strict=True):
        if value is not None and type(value) is not kind:
            raise _bad(field, value, f"{kind.__name__} or nil")


def _check_extra_keys(value: object) -> None:
    if type(value) is not list:
        raise _bad("extra_keys", value, "an array or nil")
    for i, entry in enumerate(value):
        if entry is not None and (type(entry) is not list or not _is_plain(entry)):
            raise _bad(f"extra_keys[{i}]", entry, "nil or an array of str/int/bytes/arrays")


def _is_plain(items: list[Any]) -> bool:
    """True if ``items`` nests only lists and scalar leaves; iterative, so depth is no risk."""
    stack = [items]
    while stack:
        for item in stack.pop():
            if type(item) is list:
                stack.append(item)
            elif type(item) not in _EXTRA_KEY_LEAVES:
                return False
    return True


def _check_lookahead(value: object) -> None:
    if type(value) is not list:
        raise _bad("lookahead_token_ids", value, "an array of int arrays or nil")
    for i, tokens in enumerate(value):
        _check_ints(f"lookahead_token_ids[{i}]", tokens)


def _bad(field: str, value: object, expected: str) -> DecodeError:
    return DecodeError(f"{field}: expected {expected}, got {_describe(value)}", "malformed")


def _describe(value: object) -> str:
    """A short description of a decoded value for a log line; never the whole payload."""
    if isinstance(value, (list, dict, bytes, str)) and len(value) > 24:
        return f"{type(value).__name__} of length {len(value)}"
    return f"{type(value).__name__} {value!r}"


def encode_batch(
    events: Sequence[Event],
    *,
    ts: float,
    data_parallel_rank: int | None,
    vllm_version: Version,
) -> bytes:
    """Encode a batch as that vLLM release's msgspec encoder would (§2.1-§2.3).

    msgspec sizes a struct's map header by its *declared* field count and patches the count
    after omitting defaults, so a BlockStored with 16 declared keys (0.33+) gets a map16 header
    even when 11 are written; this is reproduced. Strings, ints and floats take msgpack's
    shortest forms except ts, always float64 - the same choices as msgpack-python's packer.
    """
    packer = msgpack.Packer(use_bin_type=True)
    encode = _encode_map_event if vllm_version >= MAP_FORM_SINCE else _encode_array_event
    parts = [b"\x93", packer.pack(float(ts)), packer.pack_array_header(len(events))]
    parts.extend(encode(packer, event, vllm_version) for event in events)
    parts.append(packer.pack(data_parallel_rank))
    return b"".join(parts)


def _layout(event: Event) -> tuple[str, FieldSpec]:
    if isinstance(event, BlockStored):
        return "BlockStored", STORED_FIELDS
    if isinstance(event, BlockRemoved):
        return "BlockRemoved", REMOVED_FIELDS
    if isinstance(event, AllBlocksCleared):
        return "AllBlocksCleared", ()
    raise TypeError(f"not a KV event: {type(event).__name__}")


def _encode_array_event(packer: msgpack.Packer, event: Event, version: Version) -> bytes:
    tag, fields = _layout(event)
    values = [getattr(event, name) for name, since, _ in fields if since <= version]
    return bytes(packer.pack([tag, *values]))


def _encode_map_event(packer: msgpack.Packer, event: Event, version: Version) -> bytes:
    tag, fields = _layout(event)
    declared = [(name, always) for name, since, always in fields if since <= version]
    written: list[tuple[str, Any]] = [("type", tag)]
    for name, always in declared:
        value = getattr(event, name)
        if always or value is not None:  # omit_defaults: every default is None
            written.append((name, value))
    if len(declared) + 1 < 16:
        header = bytes((0x80 | len(written),))
    else:
        header = b"\xde" + len(written).to_bytes(2, "big")
    return header + b"".join(packer.pack(k) + packer.pack(v) for k, v in written)
