"""Access to tests/data/vllm_golden.json (payloads produced by vLLM 0.28.0 and 0.23.0 itself).

Turns the golden file's expected events (dicts; bytes hashes as ``{"hex": ...}``) into
:mod:`common.events` objects, and lists every encoded payload the file holds.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.events import AllBlocksCleared, BlockRemoved, BlockStored, Event

GOLDEN_PATH = Path(__file__).resolve().parents[1] / "data" / "vllm_golden.json"
VERSIONS = {"0.28.0": (0, 28, 0), "0.23.0": (0, 23, 0)}
MODES = ("events_int_hashes", "events_bytes_hashes")
_CLASSES: dict[str, Any] = {
    "BlockStored": BlockStored,
    "BlockRemoved": BlockRemoved,
    "AllBlocksCleared": AllBlocksCleared,
}


@dataclass(frozen=True)
class GoldenPayload:
    version: str
    mode: str
    label: str
    payload: bytes
    events: list[dict[str, Any]]  # as the golden file states them
    rank: int | None

    @property
    def id(self) -> str:
        return f"{self.version}-{self.mode.split('_')[1]}-{self.label}"


@functools.cache
def golden() -> dict[str, Any]:
    with GOLDEN_PATH.open() as f:
        return dict(json.load(f))


def golden_payloads() -> list[GoldenPayload]:
    """Every encoded batch: the 5 steps, ``mixed`` and its 2 rank variants, per version/mode."""
    out = []
    for version in VERSIONS:
        for mode in MODES:
            section = golden()["versions"][version][mode]
            for step in [*section["steps"], section["mixed"]]:
                payload = bytes.fromhex(step["payload_hex"])
                rank = step["payload_decoded_plain_msgpack"][2]
                events = step["events"]
                out.append(GoldenPayload(version, mode, step["label"], payload, events, rank))
            for rank in (1, None):
                payload = bytes.fromhex(section["variants"][f"mixed_batch_dp_rank_{rank}_hex"])
                label = f"mixed_rank_{rank}"
                events = section["mixed"]["events"]
                out.append(GoldenPayload(version, mode, label, payload, events, rank))
    return out


def zmq_payloads() -> list[tuple[str, int, bytes, list[Any]]]:
    """(capture name, seq, payload, plain msgpack decoding) of every live frame captured."""
    captures = golden()["versions"]["0.28.0"]["zmq_capture"]
    return [
        (
            name,
            frame["seq"],
            bytes.fromhex(frame["frames_hex"][2]),
            frame["payload_decoded_plain_msgpack"],
        )
        for name, capture in captures.items()
        for frame in capture["live_frames"]
    ]


def zmq_replay_payloads() -> list[tuple[str, int, bytes]]:
    """(capture name, seq, payload) of every DEALER replay reply except the end marker."""
    captures = golden()["versions"]["0.28.0"]["zmq_capture"]
    out = []
    for name, capture in captures.items():
        for key in ("replay_dealer", "replay_dealer_from_0"):
            for frames in capture[key]["replies_frames_hex"]:
                seq_hex, payload_hex = frames[-2], frames[-1]
                if payload_hex:
                    out.append((name, int(seq_hex, 16), bytes.fromhex(payload_hex)))
    return out


def _hash(value: Any) -> Any:
    return bytes.fromhex(value["hex"]) if isinstance(value, dict) else value


def expected_event(d: dict[str, Any]) -> Event:
    """The common.events object for one golden event dict."""
    fields = {k: v for k, v in d.items() if k != "type"}
    if "block_hashes" in fields:
        fields["block_hashes"] = [_hash(h) for h in fields["block_hashes"]]
    if fields.get("parent_block_hash") is not None:
        fields["parent_block_hash"] = _hash(fields["parent_block_hash"])
    event: Event = _CLASSES[d["type"]](**fields)
    return event
