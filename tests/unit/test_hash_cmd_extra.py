"""``cache-indexer hash`` with LoRA, multimodal items and lookahead: every golden extra-keys
and lookahead vector (in process, stdin given), and the flags through a real subprocess."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from typing import Any

import pytest

from services.tools import hash_cmd
from tests.conftest import DATA, ROOT

FILES = sorted((DATA / "extra-keys").glob("*.json"))
CASES = [
    pytest.param(case, id=f"{doc['release']}-{case['name']}")
    for doc in (json.loads(p.read_text(encoding="utf-8")) for p in FILES)
    for case in doc["cases"]
]


def _args(case: dict[str, Any]) -> list[str]:
    seed = ["--no-seed"] if case["seed"] is None else ["--seed", case["seed"]]
    return ["--vllm-version", case["release"], "--algo", case["algo"], *seed]


def _document(case: dict[str, Any]) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "token_ids": case["token_ids"],
        "block_size": case["block_size"],
        "cache_salt": case["cache_salt"],
        "lookahead": case.get("lookahead_tokens", 0),
        "mm_features": case["mm_features"][::-1],  # any order; "modality" is accepted
    }
    if case["lora"]:
        doc["lora_name"], doc["lora_path"] = case["lora"]["name"], case["lora"]["path"]
    return doc


@pytest.mark.parametrize("case", CASES)
def test_every_vector_from_a_json_document(
    case: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    stdin = io.StringIO(json.dumps(_document(case)))
    assert hash_cmd.main([*_args(case), "--hex"], stdin) == 0
    assert json.loads(capsys.readouterr().out) == case["block_hashes_hex"]


@pytest.mark.parametrize("case", CASES[::7])
def test_vectors_from_flags(case: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    args = [*_args(case), "--block-size", str(case["block_size"])]
    for item in case["mm_features"]:
        args += ["--mm-feature", f"{item['identifier']}:{item['offset']}:{item['length']}"]
    if case["lora"]:
        args += ["--lora-name", case["lora"]["name"], "--lora-path", case["lora"]["path"]]
    if case["cache_salt"] is not None:
        args += ["--cache-salt", case["cache_salt"]]
    if case.get("lookahead_tokens"):
        args += ["--lookahead", str(case["lookahead_tokens"])]
    assert hash_cmd.main(args, io.StringIO(json.dumps(case["token_ids"]))) == 0
    assert json.loads(capsys.readouterr().out) == case["block_hashes_event_int"]


def test_flag_identifiers_may_hold_colons(capsys: pytest.CaptureFixture[str]) -> None:
    case = next(
        c.values[0] for c in CASES if c.values[0]["name"] == "bs16_lora_prefixed_identifier"
    )
    assert ":" in case["mm_features"][0]["identifier"]
    test_vectors_from_flags(case, capsys)


def _run(env: dict[str, str], stdin: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "services.cli", "hash", *args],
        input=stdin,
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=60,
        check=False,
    )


def test_subprocess_with_items_and_lookahead(subprocess_env: dict[str, str]) -> None:
    case = next(
        c.values[0]
        for c in CASES
        if c.values[0]["release"] == "0.34.0"
        and c.values[0].get("lookahead_tokens")
        and c.values[0]["mm_features"]
    )
    proc = _run(subprocess_env, json.dumps(_document(case)), *_args(case))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == case["block_hashes_event_int"]


@pytest.mark.parametrize(
    ("stdin", "args", "message"),
    [
        ('{"token_ids": [1], "x": 1}', ["--block-size", "1"], "unknown field 'x'"),
        ('{"token_ids": [1]}', [], "--block-size is required"),
        ('{"token_ids": [1], "block_size": 1}', ["--block-size", "1"], "both as a flag"),
        ("[1, 2]", ["--block-size", "1", "--mm-feature", "a:1"], "IDENTIFIER:OFFSET:LENGTH"),
        ("[1, 2]", ["--block-size", "1", "--mm-feature", "a:1:5"], "outside the prompt"),
        ("[1, 2]", ["--block-size", "1", "--mm-feature", ":0:1"], "non-empty string"),
        ("[1, 2]", ["--block-size", "1", "--lookahead", "1"], "vLLM < 0.33"),
        (
            '{"token_ids": [1], "mm_features": [{"identifier": "a"}]}',
            ["--block-size", "1"],
            "offset, length",
        ),
        ("[1]", ["--block-size", "1", "--vllm-version", "0.11.0", "--lora-name", "a"], "0.11.0"),
    ],
)
def test_bad_input_exits_2(
    stdin: str, args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert hash_cmd.main(args, io.StringIO(stdin)) == 2
    out = capsys.readouterr()
    assert out.out == "" and message in out.err and "Traceback" not in out.err
