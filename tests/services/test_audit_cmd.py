"""``cache-indexer audit``: the API's audit document, as JSON or a table."""

from __future__ import annotations

import io
from pathlib import Path

import orjson
import redis

from common.blockhash import BlockHasher
from common.settings import ApiSettings
from common.store import Store
from services.tools import audit_cmd
from tests.conftest import RedisServer, reserve_port
from tests.services.test_api_audit import (
    A,
    VIEW,
    _ask,
    _client,
    _members,
    _populate,
    _recorded,
    _report,
)


def _config(tmp_path: Path, url: str) -> str:
    path = tmp_path / "config.yaml"
    path.write_text(f"redis:\n  url: {url}\n", encoding="utf-8")
    return str(path)


def _discrepancies(redis_client: redis.Redis) -> dict:
    hasher = BlockHasher(ApiSettings().hash)
    store = Store(redis_client)
    _populate(store, A, _members(hasher)[:1])
    client = _client(store, hasher)
    for rid in ("c-0", "c-1", "c-2"):
        _ask(client, [A], rid)
        _recorded(redis_client, rid)
    _report(client, request_id="c-0", server_ip=A, cached_tokens=16)
    _report(client, request_id="c-1", server_ip=A, cached_tokens=48, prompt_tokens=65)
    _report(client, request_id="c-2", server_ip=A, cached_tokens=32, source="probe")
    doc: dict = client.simulate_get(VIEW).json
    return doc


def test_json_is_the_api_document(
    redis_server: RedisServer, redis_client: redis.Redis, tmp_path: Path
) -> None:
    api = _discrepancies(redis_client)
    out = io.StringIO()
    assert audit_cmd.main(["--config", _config(tmp_path, redis_server.url), "--json"], out) == 0
    assert orjson.loads(out.getvalue()) == api
    assert len(api["recent_discrepancies"]) == 2


def test_table_shows_totals_worst_instances_and_discrepancies(
    redis_server: RedisServer, redis_client: redis.Redis, tmp_path: Path
) -> None:
    _discrepancies(redis_client)
    out = io.StringIO()
    assert audit_cmd.main(["--config", _config(tmp_path, redis_server.url)], out) == 0
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("reports 3  exact 1 (33.3%)  under 2  over 0  unexplained 2")
    header = next(i for i, line in enumerate(lines) if line.startswith("SERVER_IP"))
    assert lines[header + 1].split()[:7] == [A, "3", "1", "2", "0", "2", "66.7"]
    rows = [line for line in lines if "c-1" in line]
    assert len(rows) == 1
    assert "prompt_length_differs (unexplained)" in rows[0] and "64≠65" in rows[0]
    assert "+32" in rows[0]
    assert "\033[" not in out.getvalue()


def test_unreachable_redis_is_exit_1(tmp_path: Path) -> None:
    url = f"redis://127.0.0.1:{reserve_port()}/0"
    assert audit_cmd.main(["--config", _config(tmp_path, url)], io.StringIO()) == 1
