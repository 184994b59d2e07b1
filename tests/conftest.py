"""Shared fixtures: a real redis-server per session, a flushed client per test, helpers.

``redis-server`` must be on PATH (``.ci/run`` installs Debian's package). Tests that
need to kill Redis start their own with :class:`RedisServer`.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

DATA = Path(__file__).parent / "data"
ROOT = Path(__file__).resolve().parent.parent


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def wait_for(cond: Callable[[], Any], timeout: float = 10.0, interval: float = 0.02,
             what: str = "condition") -> Any:
    """Poll ``cond`` until it returns something truthy; fail the test after ``timeout``."""
    deadline = time.monotonic() + timeout
    last_exc: BaseException | None = None
    while time.monotonic() < deadline:
        try:
            value = cond()
            if value:
                return value
        except Exception as exc:  # noqa: BLE001 - the condition may fail while starting
            last_exc = exc
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last error: {last_exc!r}")


class RedisServer:
    """A real redis-server on a free loopback port, in its own temp dir."""

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.dir = tempfile.mkdtemp(prefix="ci-redis-")
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
        self.proc = subprocess.Popen(
            [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", self.dir, "--protected-mode", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        client = redis.Redis(port=self.port, socket_timeout=1)
        wait_for(client.ping, timeout=10, what="redis-server to answer PING")
        client.close()
        return self

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer().start()
    yield server
    server.cleanup()


@pytest.fixture()
def redis_client(redis_server: RedisServer) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    yield client
    client.close()


@pytest.fixture(params=["fakeredis", "redis-server"])
def any_store(request: pytest.FixtureRequest) -> Iterator[Any]:
    """A :class:`common.store.Store` on fakeredis and, as a second case, on a real server."""
    import fakeredis

    from common.store import Store

    if request.param == "fakeredis":
        client: redis.Redis = fakeredis.FakeRedis()
    else:
        client = request.getfixturevalue("redis_client")
    yield Store(client)


@pytest.fixture()
def procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Child processes a test starts; SIGTERM then (after 15 s) SIGKILL, by PID, at the end."""
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in started:
        try:
            p.wait(15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


@pytest.fixture()
def subprocess_env() -> dict[str, str]:
    """Environment for child processes: the project importable, no inherited config."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("CACHE_INDEXER_CONFIG", None)
    env.pop("CACHE_INDEXER_REDIS_URL", None)
    return env
