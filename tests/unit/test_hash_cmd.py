"""``cache-indexer hash`` as a real subprocess: vLLM's golden hashes, exit codes, no tracebacks."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from tests.conftest import DATA, ROOT

GOLDEN = json.loads((DATA / "vllm_golden.json").read_text())["versions"]
VECTORS = json.loads((DATA / "vllm_hash_vectors.json").read_text(encoding="utf-8"))["versions"]


def _case(version: str, name: str, data: dict[str, Any] = GOLDEN) -> dict[str, Any]:
    cases = data[version]["hash_cases"] if data is GOLDEN else data[version]
    return next(case for case in cases if case["name"] == name)


def _run(env: dict[str, str], stdin: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "services.cli", "hash", *args],
        input=stdin,
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=30,
        check=False,
    )


def _ok(proc: subprocess.CompletedProcess[str]) -> Any:
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    return json.loads(proc.stdout)


def test_default_settings_print_event_ints(subprocess_env: dict[str, str]) -> None:
    case = _case("0.28.0", "seed0_bs16_3blocks_plus5")
    out = _ok(_run(subprocess_env, json.dumps(case["token_ids"]), "--block-size", "16"))
    assert (
        out
        == case["block_hashes_event_int"]
        == [11738959596286628545, 16840481562209356096, 3840565935786626674]
    )


def test_hex_salt_lora_and_pickle(subprocess_env: dict[str, str]) -> None:
    case = _case("0.23.0", "seed0_bs16_lora_salt")
    args = [
        "--block-size",
        "16",
        "--vllm-version",
        "0.23.0",
        "--cache-salt",
        "tenant-a",
        "--lora-name",
        "sql-lora",
        "--hex",
    ]
    assert (
        _ok(_run(subprocess_env, json.dumps(case["token_ids"]), *args)) == case["block_hashes_hex"]
    )
    case = _case("0.28.0", "seed0_bs16_sha256_pickle_salt")
    args = ["--block-size", "16", "--algo", "sha256", "--cache-salt", "tenant-a"]
    out = _ok(_run(subprocess_env, json.dumps(case["token_ids"]), *args))
    assert out == case["block_hashes_event_int"]


def test_tagged_lora_and_unset_seed_on_034(subprocess_env: dict[str, str]) -> None:
    case = _case("0.34.0", "lora_salt", VECTORS)
    args = [
        "--block-size",
        "16",
        "--vllm-version",
        "0.34.0",
        "--cache-salt",
        case["cache_salt"],
        "--lora-name",
        case["lora_name"],
        "--lora-path",
        case["lora_path"],
        "--hex",
    ]
    assert (
        _ok(_run(subprocess_env, json.dumps(case["token_ids"]), *args)) == case["block_hashes_hex"]
    )
    case = _case("0.34.0", "no_seed", VECTORS)
    args = ["--block-size", "16", "--vllm-version", "0.34.0", "--no-seed", "--hex"]
    assert (
        _ok(_run(subprocess_env, json.dumps(case["token_ids"]), *args)) == case["block_hashes_hex"]
    )


def test_empty_seed_flag(subprocess_env: dict[str, str]) -> None:
    case = _case("0.28.0", "empty_seed", VECTORS)
    out = _ok(
        _run(
            subprocess_env,
            json.dumps(case["token_ids"]),
            "--block-size",
            "16",
            "--seed",
            "",
            "--hex",
        )
    )
    assert out == case["block_hashes_hex"]


@pytest.mark.parametrize(
    ("stdin", "args", "message"),
    [
        ("[1, 2]", ["--block-size", "1", "--no-seed"], "blockKey.pythonHashSeed"),
        ("[1, -2]", ["--block-size", "1"], "token id -2"),
        ("[1, 2.5]", ["--block-size", "1"], "JSON array of integer"),
        ("[true]", ["--block-size", "1"], "JSON array of integer"),
        ('{"a": 1}', ["--block-size", "1"], "JSON array of integer"),
        ("[1, 2", ["--block-size", "1"], "not JSON"),
        ("[1]", ["--block-size", "0"], "block_size"),
        ("[1]", ["--block-size", "1", "--vllm-version", "0.9.0"], "0.10.2"),
        ("[1]", ["--block-size", "1", "--vllm-version", "0.34.0", "--lora-name", "a"], "lora_path"),
        ("[1]", [], "--block-size"),
        ("[1]", ["--block-size", "x"], "invalid int"),
        ("[1]", ["--block-size", "1", "--algo", "xxhash"], "invalid choice"),
        ("[1]", ["--block-size", "1", "--seed", "1", "--no-seed"], "not allowed"),
    ],
)
def test_bad_input_exits_2_without_traceback(
    subprocess_env: dict[str, str], stdin: str, args: list[str], message: str
) -> None:
    proc = _run(subprocess_env, stdin, *args)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


def test_help_exits_0(subprocess_env: dict[str, str]) -> None:
    proc = _run(subprocess_env, "", "--help")
    assert proc.returncode == 0 and "--block-size" in proc.stdout
