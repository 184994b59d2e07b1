"""The operator's view of every instance and master (``GET /kv-cache/instances``, ``inspect``).

The Redis reads are the store's: :class:`common.store_status.StatusReader` returns a
:class:`~common.store_status.Raw` (both importable from here too, for the callers that
still do). :func:`build_report` turns the raw hashes into the document; ``l1.state`` is decided by
:func:`l1_state` (its checks in order, the first that matches wins; what each state means to
an operator: the table in docs/api.md).

``groups`` describes the instance's KV-cache groups (:func:`common.group_view.describe`):
their kinds and block sizes, the hash unit, and ``exact``: false, with the reasons, where the
hit ratio of a hybrid model can only be a lower bound.

Ages are computed against Redis ``TIME``; ``*_ms`` stamps are the writers' wall clocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from common import group_view
from common.config import BlockKey, IngestL1
from common.store_status import Raw, StatusReader


class InstanceState(StrEnum):
    """An instance's ``l1.state`` (decided by :func:`l1_state`); the values are what the API,
    ``inspect`` and the state gauge's label show."""

    SYNCED = "synced"
    RESYNCING = "resyncing"
    REPLAYING = "replaying"
    GAP = "gap"
    NO_EVENTS = "no_events"
    UNREACHABLE = "unreachable"
    UNASSIGNED = "unassigned"


class ConnState(StrEnum):
    """The connection state an L1 ingester reports for an instance (``conn``), best first."""

    CONNECTED = "connected"
    CONNECTING = "connecting"
    DISCONNECTED = "disconnected"
    UNREACHABLE = "unreachable"
    RETRYING = "retrying"
    """No socket: the ingester waits to resubscribe (see ``conn_detail``)."""


class HashCheck(StrEnum):
    """An ingester's block-hash self-check verdict for an instance (``hash_check``)."""

    OK = "ok"
    MISMATCH = "mismatch"
    UNCHECKED = "unchecked"


__all__ = [
    "STATES",
    "ConnState",
    "HashCheck",
    "InstanceState",
    "Limits",
    "Raw",
    "StatusReader",
    "build_report",
    "l1_state",
]

STATES = tuple(InstanceState)
"""Every ``l1.state`` (the order of the per-instance state gauge)."""
_UNREACHABLE = frozenset({ConnState.UNREACHABLE, ConnState.DISCONNECTED, ConnState.RETRYING})
_MIN_FRESH_S = 3.0


@dataclass(frozen=True)
class Limits:
    """The config values the states depend on (seconds), and the release the hit rule of
    hybrid models follows."""

    no_events_after: float = float(IngestL1().no_events_after)
    lease_ttl: float = float(IngestL1().lease_ttl)
    vllm_version: tuple[int, ...] = tuple(map(int, BlockKey().vllm_version.split(".")))


def build_report(raw: Raw, limits: Limits) -> dict[str, Any]:
    """The ``GET /kv-cache/instances`` document."""
    return {
        "instances": [_instance(ip, parts, raw, limits) for ip, parts in raw.instances.items()],
        "masters": [_master(url, state, raw.now_ms) for url, state in raw.masters.items()],
    }


def _instance(ip: str, parts: dict[str, Any], raw: Raw, limits: Limits) -> dict[str, Any]:
    l1: dict[str, str] = parts["l1"]
    l3: dict[str, str] = parts["l3"]
    state, why = l1_state(l1, parts["owner"], raw, limits)
    return {
        "server_ip": ip,
        "pod": parts["meta"].get("pod", ""),
        "l1": {
            "state": state,
            "state_detail": why,
            "blocks": int(parts["blocks"] or 0),
            "hash_check": l1.get("hash_check", HashCheck.UNCHECKED),
            "hash_check_detail": l1.get("hash_check_detail", ""),
            "hash_check_ok": _int(l1.get("hash_check_ok")),
            "hash_check_mismatch": _int(l1.get("hash_check_mismatch")),
            "last_event_age_s": _age(l1.get("last_event_ms"), raw.now_ms),
            "gaps": sum(_int(v) for k, v in l1.items() if k.startswith("gap:")),
            "ingester": parts["owner"] or l1.get("ingester") or None,
            "reset_reason": l1.get("reset_reason") or None,
            "resyncs": _int(l1.get("resyncs")),
            "resync_detail": l1.get("resync_detail") or None,
            "lifetime_detail": l1.get("lifetime_detail") or None,
            "lifetime_age_s": _age(l1.get("lifetime_ms"), raw.now_ms),
        },
        "groups": group_view.describe(
            group_view.parse_groups(parts.get("groups") or {}, limits.vllm_version),
            l1.get("hash_check"),
        ),
        "l3": {
            "blocks": _int(l3.get("blocks")) if l3 else None,
            "age_s": _age(l3.get("updated_ms"), raw.now_ms),
            "stale": l3.get("stale") == "1",
            "master": l3.get("master") or None,
        },
    }


def l1_state(
    l1: dict[str, str], owner: str | None, raw: Raw, limits: Limits
) -> tuple[InstanceState, str]:
    """(state, one-line reason) of an instance's L1 index: the first check that matches."""
    now = raw.now_ms
    status_age = _age(l1.get("status_ms"), now)
    fresh_s = max(limits.lease_ttl, _MIN_FRESH_S)
    if owner is not None and raw.ingesters.get(owner, 0) <= now:
        return InstanceState.UNASSIGNED, f"its owner {owner} stopped heartbeating"
    if status_age is None or status_age > fresh_s:
        return InstanceState.UNASSIGNED, (
            "no ingester has reported on it"
            if status_age is None
            else f"no ingester has reported on it for {status_age:.0f}s"
        )
    conn = l1.get("conn", "")
    if conn in _UNREACHABLE:
        return InstanceState.UNREACHABLE, f"{conn}: {l1.get('conn_detail', '')}".rstrip(": ")
    if l1.get("resyncing") == "1":
        return InstanceState.RESYNCING, l1.get("resync_detail", "the stored cursor moved")
    if l1.get("replaying") == "1":
        return InstanceState.REPLAYING, "catching up through the replay endpoint"
    gaps = sum(_int(v) for k, v in l1.items() if k.startswith("gap:"))
    if gaps:
        return InstanceState.GAP, (
            f"{gaps} unrecoverable gap(s) kept: blocks may be missing or stale"
        )
    quiet = _age(l1.get("last_event_ms") or l1.get("subscribed_ms"), now) or 0.0
    if quiet > limits.no_events_after:
        seen = "nothing received" if "last_event_ms" not in l1 else "no batch"
        return InstanceState.NO_EVENTS, (
            f"{seen} for {quiet:.0f}s (noEventsAfter {limits.no_events_after:g}s)"
        )
    return InstanceState.SYNCED, ""


def _master(url: str, state: dict[str, str], now_ms: int) -> dict[str, Any]:
    return {
        "url": url,
        "keys": _int(state.get("keys")) if state else None,
        "keys_unparsed": _int(state.get("keys_unparsed")) if state else None,
        "sample_unparsed": state.get("sample_unparsed") or None,
        "keys_unmappable_group": _int(state.get("keys_unmappable_group")) if state else None,
        "blocks": _int(state.get("blocks")) if state else None,
        "age_s": _age(state.get("updated_ms"), now_ms),
        "stale": state.get("stale") == "1",
        "error": state.get("error") or None,
    }


def _age(stamp_ms: str | None, now_ms: int) -> float | None:
    if not stamp_ms:
        return None
    try:
        return round(max(0.0, (now_ms - int(stamp_ms)) / 1000), 3)
    except ValueError:
        return None


def _int(value: str | None) -> int:
    try:
        return int(value or 0)
    except ValueError:
        return 0
