"""``cache-indexer inspect``: the same report as the API, as JSON or a table (coloured on a TTY)."""

from __future__ import annotations

import io
import os
import pty
import subprocess
import sys
from pathlib import Path

import orjson
import redis

from services.tools import inspect_cmd
from tests.conftest import ROOT, RedisServer, reserve_port
from tests.services.test_api_instances import URL, populate
from tests.store_oracle import OracleStore


def _config(tmp_path: Path, url: str) -> str:
    path = tmp_path / "config.yaml"
    path.write_text(f"redis:\n  url: {url}\n", encoding="utf-8")
    return str(path)


def test_json_is_the_api_document(
    redis_server: RedisServer, redis_client: redis.Redis, tmp_path: Path
) -> None:
    populate(OracleStore(redis_client))
    out = io.StringIO()
    assert inspect_cmd.main(["--config", _config(tmp_path, redis_server.url), "--json"], out) == 0
    doc = orjson.loads(out.getvalue())
    assert [i["server_ip"] for i in doc["instances"]] == ["10.0.0.5", "10.0.0.6"]
    assert doc["instances"][1]["l1"]["state"] == "unassigned"
    assert doc["masters"][0]["sample_unparsed"] == "weird-key"


def test_table_has_one_line_per_instance_and_master(
    redis_server: RedisServer, redis_client: redis.Redis, tmp_path: Path
) -> None:
    populate(OracleStore(redis_client))
    out = io.StringIO()
    assert inspect_cmd.main(["--config", _config(tmp_path, redis_server.url)], out) == 0
    lines = out.getvalue().splitlines()
    assert lines[0].split()[:3] == ["SERVER_IP", "POD", "L1_STATE"]
    a = next(line for line in lines if line.startswith("10.0.0.5"))
    assert "synced" in a and "mismatch (0/3)" in a and "pythonHashSeed '1'" in a
    b = next(line for line in lines if line.startswith("10.0.0.6"))
    assert "unassigned" in b and "no ingester has reported on it" in b
    m = next(line for line in lines if line.startswith(URL))
    assert m.split()[1:5] == ["10", "2", "weird-key", "3"]
    assert "\033[" not in out.getvalue()  # not a terminal: no colour


def test_problems_are_coloured_on_a_terminal(
    redis_server: RedisServer, redis_client: redis.Redis, tmp_path: Path
) -> None:
    populate(OracleStore(redis_client))
    master, slave = pty.openpty()
    env = {k: v for k, v in os.environ.items() if k != "NO_COLOR"}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.cli",
            "inspect",
            "--config",
            _config(tmp_path, redis_server.url),
        ],
        cwd=ROOT,
        env=env,
        stdout=slave,
        stderr=subprocess.PIPE,
        timeout=60,
        check=False,
    )
    os.close(slave)
    chunks = []
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(master)
    text = b"".join(chunks).decode()
    assert proc.returncode == 0, proc.stderr
    red = [line for line in text.splitlines() if line.startswith("\033[31m")]
    assert any("10.0.0.5" in line for line in red)  # hash mismatch
    assert any("10.0.0.6" in line for line in red)  # unassigned


def test_unreachable_redis_exits_1_and_bad_config_2(tmp_path: Path) -> None:
    err = _config(tmp_path, f"redis://127.0.0.1:{reserve_port()}/0")
    assert inspect_cmd.main(["--config", err], io.StringIO()) == 1
    bad = tmp_path / "bad.yaml"
    bad.write_text("ingest:\n  l1:\n    hashCheckRate: -1\n", encoding="utf-8")
    assert inspect_cmd.main(["--config", str(bad)], io.StringIO()) == 2


def test_a_hybrid_shows_its_groups_and_exactness() -> None:
    inst = {
        "server_ip": "10.0.0.9",
        "pod": "g",
        "l1": {
            "state": "synced",
            "state_detail": "",
            "blocks": 3,
            "hash_check": "unchecked",
            "hash_check_ok": 0,
            "hash_check_mismatch": 0,
            "hash_check_detail": "",
            "last_event_age_s": 1.0,
            "gaps": 0,
            "ingester": "i",
        },
        "l3": {"blocks": None, "age_s": None, "stale": False, "master": None},
        "groups": {
            "hybrid": True,
            "hash_unit": 32,
            "exact": False,
            "inexact_reasons": ["unconfirmed_hash_unit"],
            "kv_cache_groups": [
                {"kind": "sliding_window"},
                {"kind": "mamba"},
                {"kind": "full_attention"},
            ],
        },
    }
    text = inspect_cmd.render_table({"instances": [inst], "masters": []})
    assert "KV_GROUPS" in text.splitlines()[0]
    assert "SWA+MAMBA+FA h32 lower bound: unconfirmed_hash_unit" in text
    inst["groups"] = {"hybrid": False}
    assert " 1 " in inspect_cmd.render_table({"instances": [inst], "masters": []})
    inst["groups"] = {"hybrid": False, "lookahead_tokens": 2, "lookahead_source": "events"}
    assert " 1 L=2 " in inspect_cmd.render_table({"instances": [inst], "masters": []})
