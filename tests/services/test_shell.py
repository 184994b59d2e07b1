"""The process shell: exit statuses, the metrics endpoint, and everything closed at the end."""

from __future__ import annotations

import argparse
import signal
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from common import shell
from common.config import Config
from common.errors import ConfigError
from common.settings import L1IngestSettings
from tests.conftest import RedisServer, reserve_port, wait_for


@pytest.fixture(autouse=True)
def _restore_signals() -> Iterator[None]:
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)


def _settings(cfg: Config, _args: argparse.Namespace) -> L1IngestSettings:
    return L1IngestSettings.from_config(cfg)


def _config(tmp_path: Path, text: str) -> str:
    path = tmp_path / "c.yaml"
    path.write_text(text, encoding="utf-8")
    return str(path)


def _never(_proc: shell.Process[L1IngestSettings]) -> None:
    raise AssertionError("the worker must not start")


def test_a_bad_config_exits_2_listing_every_problem(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _config(tmp_path, "ingest:\n  l1:\n    topic: [x]\n    bogus: 1\nlog:\n  level: loud\n")
    assert shell.run_worker("prog", "d", ["--config", path], translate=_settings, run=_never) == 2
    err = capsys.readouterr().err
    assert err.startswith("prog: invalid config")
    for key in ("ingest.l1.topic", "ingest.l1.bogus", "log.level"):
        assert key in err


def test_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert shell.run_worker("prog", "d", ["--help"], translate=_settings, run=_never) == 0
    assert "--metrics-port" in capsys.readouterr().out
    assert shell.run_worker("prog", "d", ["--nope"], translate=_settings, run=_never) == 2
    assert (
        shell.run_worker("prog", "d", ["--metrics-port", "x"], translate=_settings, run=_never) == 2
    )


def test_a_config_error_while_setting_up_exits_2_and_closes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    closed: list[str] = []

    def run(proc: shell.Process[L1IngestSettings]) -> None:
        proc.on_exit(lambda: closed.append("first"))
        proc.on_exit(lambda: closed.append("second"))
        raise ConfigError("no kubeconfig")

    assert (
        shell.run_worker(
            "prog", "d", ["--config", _config(tmp_path, "{}\n")], translate=_settings, run=run
        )
        == 2
    )
    assert capsys.readouterr().err == "prog: no kubeconfig\n"
    assert closed == ["second", "first"]


def _get(port: int, path: str) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return exc.code


def _clients(server: RedisServer, name: str) -> int:
    admin = redis.Redis.from_url(server.url)
    try:
        return sum(1 for c in admin.client_list() if c.get("name") == name)
    finally:
        admin.close()


def test_a_worker_runs_with_its_settings_metrics_and_redis_then_all_is_closed(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    port = reserve_port()
    path = _config(tmp_path, f"redis:\n  url: {redis_server.url}\ningest:\n  l1:\n    topic: t\n")
    seen: dict[str, object] = {}

    def run(proc: shell.Process[L1IngestSettings]) -> None:
        seen["topic"] = proc.settings.topic
        client = proc.redis()
        assert proc.redis() is client  # one client per process
        client.client_setname("shell-test")
        seen["client"] = client  # held, so only the shell's close can drop the connection
        seen["clients"] = _clients(redis_server, "shell-test")
        seen["healthz"] = _get(port, "/healthz")
        proc.registry.counter("shell_test_total", "a test counter").inc()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as resp:
            seen["metrics"] = resp.read().decode()

    assert (
        shell.run_worker(
            "prog",
            "d",
            ["--config", path, "--metrics-port", str(port)],
            translate=_settings,
            run=run,
        )
        == 0
    )
    assert seen["topic"] == "t" and seen["clients"] == 1 and seen["healthz"] == 200
    assert "shell_test_total 1.0" in str(seen["metrics"])
    wait_for(lambda: _clients(redis_server, "shell-test") == 0, what="the Redis client closed")
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2)
