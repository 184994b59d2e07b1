"""``cache-indexer decode``: print the events of one vLLM KV-event payload as JSON lines.

Reads one payload (ZMQ frame 2) from stdin: raw msgpack bytes, or hex text with ``--hex``.
Prints one JSON object per event, in batch order. Decoded events carry every field of
:mod:`common.events` plus ``block_hashes_int`` (and ``parent_block_hash_int``), the uint64s the
index is keyed by; bytes are shown as hex. Skipped events print as
``{"index": 1, "skipped": true, "reason": ..., "detail": ...}``.

Exit status: 0 decoded (even with skipped events), 1 not a KV-event batch, 2 bad usage or hex.
"""

from __future__ import annotations

import argparse
import msgspec
import json
import os
import sys
from typing import Any

from common.errors import NotABatchError
from common.events import BlockRemoved, BlockStored, EventBatch, decode_batch, hash_to_int

_PROG = "cache-indexer decode"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog=_PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("--hex", action="store_true", help="stdin is hex text, not raw bytes")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse has printed usage or help already
        return 0 if exc.code == 0 else 2
    data = sys.stdin.buffer.read()
    if args.hex:
        try:
            data = _from_hex(data)
        except ValueError as exc:
            print(f"{_PROG}: bad hex on stdin: {exc}", file=sys.stderr)
            return 2
    try:
        batch = decode_batch(data)
    except NotABatchError as exc:
        print(f"{_PROG}: not a KV-event batch ({len(data)} bytes): {exc}", file=sys.stderr)
        return 1
    if not batch.events and not batch.skipped:
        print(f"{_PROG}: empty batch, ts={batch.ts}", file=sys.stderr)
    return _write("".join(json.dumps(line, default=_hex) + "\n" for line in render(batch)))


def render(batch: EventBatch) -> list[dict[str, Any]]:
    """One JSON-ready dict per event of ``batch``, decoded and skipped, in batch order."""
    lines: list[dict[str, Any]] = [
        {"index": s.index, "skipped": True, "reason": s.reason, "detail": s.detail}
        for s in batch.skipped
    ]
    skipped = {s.index for s in batch.skipped}
    indexes = (i for i in range(len(batch.events) + len(skipped)) if i not in skipped)
    for index, event in zip(indexes, batch.events, strict=True):
        line: dict[str, Any] = {"index": index, "type": type(event).__name__}
        line.update((f.name, getattr(event, f.name)) for f in msgspec.structs.fields(event))
        if isinstance(event, BlockStored | BlockRemoved):
            line["block_hashes_int"] = [hash_to_int(h) for h in event.block_hashes]
        if isinstance(event, BlockStored):
            parent = event.parent_block_hash
            line["parent_block_hash_int"] = None if parent is None else hash_to_int(parent)
        line["ts"] = batch.ts
        line["data_parallel_rank"] = batch.data_parallel_rank
        lines.append(line)
    return sorted(lines, key=lambda line: int(line["index"]))


def _from_hex(data: bytes) -> bytes:
    text = data.decode("ascii").strip()  # UnicodeDecodeError is a ValueError
    if text[:2] in ("0x", "0X"):
        text = text[2:]
    return bytes.fromhex(text)


def _hex(value: object) -> str:
    if isinstance(value, bytes):
        return value.hex()
    raise TypeError(f"not JSON serializable: {type(value).__name__}")


def _write(text: str) -> int:
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:  # e.g. piped into `head`; stop quietly, as other CLI tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0
