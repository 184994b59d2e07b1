"""vLLM KV-cache events: the batch decoder and the encoder, both msgspec as in vLLM itself.

Wire format (spec vllm-kv-events.md §2): an EventBatch is always a msgpack array
``[ts, events, data_parallel_rank]``. Events are ``[tag, field, ...]`` arrays up to vLLM 0.23
and ``{"type": tag, field: value, ...}`` maps from 0.24. The decoder reads both into the
Structs of :mod:`common.event_types` (which say what is required and how each field is
checked); missing trailing fields default, unknown keys and trailing elements are ignored.
The batch's events are read as ``list[msgspec.Raw]`` and decoded one by one, so an event that
fails becomes a :class:`SkippedEvent` and the rest of the batch is still returned; a payload
that is not a batch at all raises :class:`~common.errors.NotABatchError`, and nothing else.

:func:`hash_to_int` maps a hash (uint64 or digest bytes) to the uint64 the index is keyed by.
Pure: no I/O.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import msgpack
import msgspec

from common.errors import DecodeError, NotABatchError
from common.event_types import (
    MAP_FORM_SINCE,
    REMOVED_FIELDS,
    STORED_FIELDS,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Count,
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

_U64_END = 1 << 64


class _WireBatch(msgspec.Struct, array_like=True, gc=False):
    """vLLM's EventBatch, its events left undecoded; extra trailing elements are ignored."""

    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: Count | None = None


class _PlainBatch(_WireBatch):
    """The same batch checked from plain objects (the deep-payload route, below)."""

    events: list[Any]


# The array form (vLLM <= 0.23): the same Structs, array_like; decoded, then re-typed.
class _StoredArray(BlockStored, array_like=True, tag="BlockStored"):
    pass


class _RemovedArray(BlockRemoved, array_like=True, tag="BlockRemoved"):
    pass


class _ClearedArray(AllBlocksCleared, array_like=True, tag="AllBlocksCleared"):
    pass


_MAP_TYPES: dict[str, type[Event]] = {
    "BlockStored": BlockStored,
    "BlockRemoved": BlockRemoved,
    "AllBlocksCleared": AllBlocksCleared,
}
_ARRAY_TYPES: dict[str, type[Event]] = {
    "BlockStored": _StoredArray,
    "BlockRemoved": _RemovedArray,
    "AllBlocksCleared": _ClearedArray,
}
_CANONICAL: dict[type[Event], type[Event]] = {
    _StoredArray: BlockStored,
    _RemovedArray: BlockRemoved,
    _ClearedArray: AllBlocksCleared,
}
_MapEvent = BlockStored | BlockRemoved | AllBlocksCleared
_ArrayEvent = _StoredArray | _RemovedArray | _ClearedArray


class _MapBatch(_WireBatch):
    events: list[_MapEvent]  # type: ignore[assignment]


class _ArrayBatch(_WireBatch):
    events: list[_ArrayEvent]  # type: ignore[assignment]


_BATCH = msgspec.msgpack.Decoder(_WireBatch)
_MAP_BATCH = msgspec.msgpack.Decoder(_MapBatch)
_ARRAY_BATCH = msgspec.msgpack.Decoder(_ArrayBatch)
_MAP = msgspec.msgpack.Decoder(_MapEvent)
_ARRAY = msgspec.msgpack.Decoder(_ArrayEvent)
# An event's form from its first byte: fixarray, array16/32; fixmap, map16/32.
_ARRAY_BYTES = frozenset((*range(0x90, 0xA0), 0xDC, 0xDD))
_MAP_BYTES = frozenset((*range(0x80, 0x90), 0xDE, 0xDF))


def hash_to_int(h: Hash) -> int:
    """The uint64 an event hash stands for: an int as is, bytes by their last 8 (big-endian)."""
    if type(h) is int and 0 <= h < _U64_END:
        return h
    if type(h) is bytes:
        return int.from_bytes(h[-8:], "big")
    raise DecodeError(f"not a block hash: {_describe(h)}")


def decode_batch(payload: bytes) -> EventBatch:
    """Decode one ZMQ payload; raise NotABatchError (and nothing else) if it is not a batch."""
    try:
        return _decode_whole(payload)
    except msgspec.ValidationError:
        pass  # a bad event, mixed forms, or not a batch at all: event by event below
    except (msgspec.DecodeError, TypeError) as exc:  # TypeError: not bytes-like
        raise NotABatchError(f"not a batch: {exc}", "not_a_batch") from exc
    except RecursionError:
        return _decode_deep(payload)
    try:
        wire = _BATCH.decode(payload)
    except msgspec.MsgspecError as exc:
        raise NotABatchError(f"not a batch: {exc}", "not_a_batch") from exc
    except RecursionError:
        return _decode_deep(payload)
    return _decode_each(wire)


def _decode_whole(payload: bytes) -> EventBatch:
    """The fast route: the whole batch in one call, all maps (>= 0.24) or all arrays."""
    try:
        batch: _WireBatch = _MAP_BATCH.decode(payload)
        events: list[Event] = batch.events  # type: ignore[assignment]
        form = "map"
    except msgspec.ValidationError:
        batch = _ARRAY_BATCH.decode(payload)
        events = [_CANONICAL[type(e)](*msgspec.structs.astuple(e)) for e in batch.events]
        form = "array"
    form = form if events else "empty"
    return EventBatch(batch.ts, events, batch.data_parallel_rank, [], form)


def _decode_each(wire: _WireBatch) -> EventBatch:
    """The careful route: each event on its own, a bad one skipped with its reason."""
    events: list[Event] = []
    skipped: list[SkippedEvent] = []
    form = "empty"
    for index, raw in enumerate(wire.events):
        first = memoryview(raw)[0]
        if form == "empty" and (first in _ARRAY_BYTES or first in _MAP_BYTES):
            form = "array" if first in _ARRAY_BYTES else "map"
        try:
            if first in _MAP_BYTES:
                events.append(_MAP.decode(raw))
            elif first in _ARRAY_BYTES:
                event = _ARRAY.decode(raw)
                events.append(_CANONICAL[type(event)](*msgspec.structs.astuple(event)))
            else:
                raise msgspec.ValidationError("not an event")
        except (msgspec.MsgspecError, RecursionError):
            _decode_plain_event(_unpack_tolerant(raw), index, events, skipped)
    return EventBatch(wire.ts, events, wire.data_parallel_rank, skipped, form)


def _decode_deep(payload: bytes) -> EventBatch:
    """A payload nested deeper than msgspec's recursion limit (Python's, ~1,000 levels; vLLM
    never sends one): read by msgpack's own stack (1,024 levels), then checked by msgspec."""
    try:
        wire = msgspec.convert(_unpack_tolerant(payload), _PlainBatch)
    except (msgspec.MsgspecError, RecursionError) as exc:
        raise NotABatchError(f"not a batch: {exc}", "not_a_batch") from exc
    events: list[Event] = []
    skipped: list[SkippedEvent] = []
    for index, raw in enumerate(wire.events):
        _decode_plain_event(raw, index, events, skipped)
    return EventBatch(wire.ts, events, wire.data_parallel_rank, skipped, _form_of(wire.events))


def _form_of(raw_events: list[Any]) -> str:
    for raw in raw_events:
        if type(raw) is list:
            return "array"
        if type(raw) is dict:
            return "map"
    return "empty"


def _decode_plain_event(
    raw: object, index: int, events: list[Event], skipped: list[SkippedEvent]
) -> None:
    """The slow route, for an event the typed decoder refused: name why, or keep the event
    if only a key msgspec cannot read (not a string) was in the way."""
    try:
        events.append(_event_from_plain(raw))
    except DecodeError as exc:
        skipped.append(SkippedEvent(index, exc.reason, str(exc)))


def _event_from_plain(raw: object) -> Event:
    if type(raw) is list:
        tag = raw[0] if raw else None
        types = _ARRAY_TYPES
    elif type(raw) is dict:
        tag = raw.get("type")
        # Keys that are not strings are unknown keys; a map may leave out parent_block_hash,
        # which vLLM always writes but which cannot default in a Struct (fields follow it).
        raw = {"parent_block_hash": None, **{k: v for k, v in raw.items() if type(k) is str}}
        types = _MAP_TYPES
    else:
        raise DecodeError(f"event is {_describe(raw)}, not an array or map", "not_an_event")
    cls = types.get(tag) if type(tag) is str else None
    if cls is None:
        raise DecodeError(f"unknown event type {_describe(tag)}", "unknown_type")
    try:
        event = msgspec.convert(raw, cls)
    except msgspec.ValidationError as exc:
        raise DecodeError(f"{tag}: {exc}", "malformed") from exc
    canonical = _CANONICAL.get(type(event))
    return event if canonical is None else canonical(*msgspec.structs.astuple(event))


def _hashable_pairs(pairs: list[tuple[Any, Any]]) -> dict[Any, Any]:
    return {k: v for k, v in pairs if type(k) not in (list, dict)}


class _Ext:
    """A msgpack extension value, opaque: msgpack's own ``ExtType`` is a tuple, which
    ``msgspec.convert`` would take for an array."""

    def __init__(self, code: int, data: bytes) -> None:
        self.code, self.data = code, data

    def __repr__(self) -> str:
        return f"ext {self.code} of {len(self.data)} bytes"


def _unpack_tolerant(payload: bytes | msgspec.Raw) -> Any:
    """Plain objects; a map key that is an array or map is left out (msgspec refuses a map
    key that is a map). Invalid msgpack anywhere means the payload is not a batch."""
    try:
        return msgpack.unpackb(
            memoryview(payload),
            raw=False,
            strict_map_key=False,
            object_pairs_hook=_hashable_pairs,
            ext_hook=_Ext,
        )
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise NotABatchError(f"not msgpack: {exc}", "not_a_batch") from exc


def _describe(value: object) -> str:
    """A short description of a decoded value for a log line; never the whole payload."""
    if isinstance(value, (list, dict, bytes, str)) and len(value) > 24:
        return f"{type(value).__name__} of length {len(value)}"
    try:
        return f"{type(value).__name__} {value!r}"
    except RecursionError:  # a short container nested deeper than repr can go
        return f"{type(value).__name__} nested too deep to show"


class _EventBatchOut(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """vLLM's EventBatch for encoding (array_like ignores omit_defaults: msgspec#720)."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


_ENCODER = msgspec.msgpack.Encoder()


def encode_batch(
    events: Sequence[Event],
    *,
    ts: float,
    data_parallel_rank: int | None,
    vllm_version: Version,
) -> bytes:
    """Encode a batch as that vLLM release does: msgspec, with that release's Structs."""
    out = [_release_struct(type(e).__name__, vllm_version).of(e) for e in events]
    return _ENCODER.encode(_EventBatchOut(float(ts), out, data_parallel_rank))


class _ReleaseStruct:
    """One event type as one vLLM release declares it (fields, defaults, array or map)."""

    def __init__(self, tag: str, fields: FieldSpec, version: Version) -> None:
        declared = [(name, always) for name, since, always in fields if since <= version]
        self.count = len(declared)
        self.cls = msgspec.defstruct(
            tag,
            [(name, Any) if always else (name, Any, None) for name, always in declared],
            tag=True,
            array_like=version < MAP_FORM_SINCE,
            omit_defaults=True,
            gc=False,
        )

    def of(self, event: Event) -> Any:
        return self.cls(*msgspec.structs.astuple(event)[: self.count])


_LAYOUTS: dict[str, FieldSpec] = {
    "BlockStored": STORED_FIELDS,
    "BlockRemoved": REMOVED_FIELDS,
    "AllBlocksCleared": (),
}


@functools.cache
def _release_struct(tag: str, version: Version) -> _ReleaseStruct:
    if tag not in _LAYOUTS:
        raise TypeError(f"not a KV event: {tag}")
    return _ReleaseStruct(tag, _LAYOUTS[tag], version)
