"""``cache-indexer decode`` run as a real subprocess: output lines, exit codes, no tracebacks."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import msgpack
import pytest

from tests.conftest import ROOT
from tests.unit.vllm_golden import golden

MAP_BYTES = golden()["versions"]["0.28.0"]["events_bytes_hashes"]["mixed"]["payload_hex"]
MAP_INTS = golden()["versions"]["0.28.0"]["events_int_hashes"]["mixed"]["payload_hex"]
ARRAY_STEP4 = golden()["versions"]["0.23.0"]["events_int_hashes"]["steps"][3]["payload_hex"]


def _run(env: dict[str, str], stdin: bytes, *args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, "-m", "services.cli", "decode", *args],
        input=stdin,
        capture_output=True,
        cwd=ROOT,
        env=env,
        timeout=30,
        check=False,
    )


def _lines(proc: subprocess.CompletedProcess[bytes]) -> list[dict[str, Any]]:
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line) for line in proc.stdout.decode().splitlines()]


def test_hex_input_with_bytes_hashes(subprocess_env: dict[str, str]) -> None:
    proc = _run(subprocess_env, f"  0x{MAP_BYTES}\n".encode(), "--hex")
    stored, removed, cleared = _lines(proc)
    assert proc.stderr == b""
    assert stored["index"] == 0 and stored["type"] == "BlockStored"
    assert stored["block_hashes"] == [
        "22a4d3a8f8f231b4f40cae431bd1f4b5bd1e1c3edb05d2728b4e98dcc30acc03"
    ]
    assert stored["block_hashes_int"] == [10038128693387906051]
    assert stored["parent_block_hash_int"] == 3517906107173601916
    assert stored["extra_keys"] == [["sql-lora"]] and stored["lookahead_token_ids"] is None
    assert stored["data_parallel_rank"] == 0 and stored["ts"] == 1700000000.25
    assert removed["block_hashes_int"] == [12847776495901374948] and removed["medium"] == "GPU"
    assert cleared == {
        "index": 2,
        "type": "AllBlocksCleared",
        "ts": 1700000000.25,
        "data_parallel_rank": 0,
    }


def test_binary_input_int_hashes_both_forms(subprocess_env: dict[str, str]) -> None:
    ints = _lines(_run(subprocess_env, bytes.fromhex(MAP_INTS)))
    assert ints[0]["block_hashes"] == ints[0]["block_hashes_int"] == [10038128693387906051]
    step4 = _lines(_run(subprocess_env, bytes.fromhex(ARRAY_STEP4)))
    assert [line["type"] for line in step4] == ["BlockRemoved", "BlockRemoved", "BlockStored"]
    assert len(step4[2]["block_hashes"]) == 6 and step4[2]["parent_block_hash"] is None


def test_skipped_events_are_printed_in_place(subprocess_env: dict[str, str]) -> None:
    good = {"type": "BlockRemoved", "block_hashes": [1]}
    payload = msgpack.packb([1.0, [good, {"type": "BlockMoved"}, ["BlockStored", "x"], good], 2])
    lines = _lines(_run(subprocess_env, payload))
    assert [line["index"] for line in lines] == [0, 1, 2, 3]
    assert lines[1]["skipped"] is True and lines[1]["reason"] == "unknown_type"
    assert "BlockMoved" in lines[1]["detail"]
    assert lines[2]["skipped"] is True and lines[2]["reason"] == "malformed"
    assert lines[3]["block_hashes_int"] == [1] and lines[3]["data_parallel_rank"] == 2


@pytest.mark.parametrize(
    "stdin,args,code",
    [
        (b"\x05", (), 1),
        (bytes.fromhex(MAP_INTS)[:-3], (), 1),
        (b"", (), 1),
        (b"93", ("--hex",), 1),
        (b"zz", ("--hex",), 2),
        (b"0", ("--hex",), 2),
        ("é".encode(), ("--hex",), 2),
        (b"", ("--bogus",), 2),
    ],
)
def test_failures_exit_nonzero_without_traceback(
    subprocess_env: dict[str, str],
    stdin: bytes,
    args: tuple[str, ...],
    code: int,
) -> None:
    proc = _run(subprocess_env, stdin, *args)
    assert proc.returncode == code
    assert proc.stdout == b""
    assert proc.stderr.strip() and b"Traceback" not in proc.stderr
