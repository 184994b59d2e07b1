"""Shared fixtures: a real redis-server per session, a flushed client per test, helpers.

``redis-server`` must be on PATH (``.ci/run`` installs Debian's package). Tests that
need to kill Redis start their own with :class:`RedisServer`.
"""

from __future__ import annotations

import fcntl
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

DATA = Path(__file__).parent / "data"
ROOT = Path(__file__).resolve().parent.parent


def in_ci() -> bool:
    """True when running in CI (``CI=true``, as ``.ci/run`` and most CI systems set it)."""
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def require(condition: object, why: str) -> None:
    """Skip the calling test when ``condition`` is false — or, under ``CI=true``, fail it:
    in CI a missing prerequisite is a broken machine, not a reason for a green run.
    ``why`` says what is missing and how to get it (``scripts/setup.sh`` installs it all)."""
    if condition:
        return
    if in_ci():
        pytest.fail(f"prerequisite missing under CI=true: {why}", pytrace=False)
    pytest.skip(why)


# -- hashing paths ------------------------------------------------------------------------

HASH_PATHS = ("c-chain", "c-encoder", "numpy")
"""How :class:`~common.blockhash.BlockHasher` builds sha256_cbor preimages and hashes them:
all in C (C encoder + libcrypto's SHA-256), C encoder with hashlib per block, or numpy with
hashlib per block (the fallback where the C library is not built)."""


@pytest.fixture(scope="module", params=HASH_PATHS)
def hash_path(request: pytest.FixtureRequest) -> Iterator[str]:
    """Run a module's tests once per hashing path (``pytestmark = pytest.mark.usefixtures(
    "hash_path")``). The C paths need ``common/_cbor_blocks`` built (``pip install -e .``):
    skipped locally without it, failed under ``CI=true``."""
    import copy

    from common import blockhash_native as native

    saved = native.ENCODER
    if request.param != "numpy":
        require(
            saved is not None,
            f"the C block encoder is not built ({native.status()}); run scripts/setup.sh",
        )
    if request.param == "c-chain":
        require(
            saved is not None and saved.sha is not None,
            f"the C chain has no SHA-256 from libcrypto ({native.status()})",
        )
    if request.param == "c-encoder":
        assert saved is not None
        encoder = copy.copy(saved)
        encoder.sha = None
        native.ENCODER = encoder
    elif request.param == "numpy":
        native.ENCODER = None
    try:
        yield request.param
    finally:
        native.ENCODER = saved


# -- ports --------------------------------------------------------------------------------

PORT_RANGE = (10_000, 20_000)
"""Where :func:`reserve_ports` allocates: below Linux's ephemeral range (32768+), so the
kernel never hands one of these to an outgoing connection or a ``bind(port 0)``, and below
the 20000-32000 range older copies of these tests picked from without any reservation."""
_PORT_LOCKS = Path(tempfile.gettempdir()) / "cache-indexer-test-ports.lock"
_ports_lock = threading.Lock()
_ports_fd: int | None = None
_reserved: set[int] = set()


def _lock_port(fd: int, port: int) -> bool:
    try:  # a POSIX record lock on byte ``port`` of one shared file: held until we exit
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, port)
    except OSError:
        return False
    return True


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def reserve_ports(n: int = 1) -> int:
    """A base port such that ``base .. base+n-1`` are this process's until it exits.

    The only port allocator of the tests. A port is handed out once per process and stays
    reserved (a byte-range lock in a file under the temp dir, released by the kernel when
    the process exits) for the whole run, so a child can bind it later, a server can be
    restarted on it, and no other test process using this allocator — in this run or in a
    concurrent one — can take it meanwhile. Ports something else already holds are skipped.
    """
    global _ports_fd
    rng = random.Random()
    with _ports_lock:
        if _ports_fd is None:
            _ports_fd = os.open(_PORT_LOCKS, os.O_RDWR | os.O_CREAT, 0o666)
        for _ in range(1000):
            base = rng.randrange(PORT_RANGE[0], PORT_RANGE[1] - n)
            run = range(base, base + n)
            if _reserved.intersection(run):
                continue
            got: list[int] = []
            for port in run:
                if not _lock_port(_ports_fd, port):
                    break
                got.append(port)
                if not _bindable(port):
                    break
            else:
                _reserved.update(got)
                return base
            for port in got:  # not all of the run: give back what this attempt locked
                fcntl.lockf(_ports_fd, fcntl.LOCK_UN, 1, port)
    raise RuntimeError(f"no run of {n} free ports in {PORT_RANGE}")


def reserve_port() -> int:
    """One reserved port (see :func:`reserve_ports`)."""
    return reserve_ports(1)


def wait_for(
    cond: Callable[[], Any], timeout: float = 10.0, interval: float = 0.02, what: str = "condition"
) -> Any:
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


class Node:
    """One server process; ``args`` are extra command-line config directives."""

    def __init__(
        self,
        exe: str = "redis-server",
        args: list[str] | None = None,
        port: int | None = None,
        workdir: str | None = None,
        ping: dict[str, Any] | None = None,
    ) -> None:
        self.exe = shutil.which(exe) or exe
        self.port = port or reserve_port()
        self.dir = workdir or tempfile.mkdtemp(prefix="ci-node-")
        self.args = args or []
        self.ping_options = ping or {}  # how to reach it for the readiness check
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> Node:
        if not os.path.exists(self.exe):
            raise RuntimeError(f"{self.exe} is not installed (scripts/setup.sh installs it)")
        self.proc = subprocess.Popen(
            [
                self.exe,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                self.dir,
                "--protected-mode",
                "no",
                *self.args,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        options = {"port": self.port, "socket_timeout": 1, **self.ping_options}
        client = redis.Redis(**options)
        wait_for(client.ping, timeout=15, what=f"{self.exe} on {self.port} to answer PING")
        client.close()
        return self

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


class RedisServer(Node):
    """A real redis-server on a free loopback port, in its own temp dir."""

    def __init__(self, port: int | None = None) -> None:
        super().__init__("redis-server", port=port)


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

    from tests.store_oracle import OracleStore

    if request.param == "fakeredis":
        client: redis.Redis = fakeredis.FakeRedis()
    else:
        client = request.getfixturevalue("redis_client")
    yield OracleStore(client)


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


def child_env() -> dict[str, str]:
    """Environment for child processes: the project importable, no inherited config."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("CACHE_INDEXER_CONFIG", None)
    env.pop("CACHE_INDEXER_REDIS_URL", None)
    return env


@pytest.fixture()
def subprocess_env() -> dict[str, str]:
    """:func:`child_env` for one test."""
    return child_env()


def mooncake_missing() -> str | None:
    """Why a real Mooncake side (``mooncake_master`` and store clients in a private network
    namespace) cannot run on this machine, or None when it can."""
    if shutil.which("mooncake_master") is None:
        return "mooncake_master is not on PATH (pip install mooncake-transfer-engine-non-cuda)"
    probe = subprocess.run(
        [sys.executable, "-c", "import mooncake.store"], check=False, capture_output=True, text=True
    )
    if probe.returncode != 0:
        return f"mooncake.store does not import (libibverbs1?): {probe.stderr.strip()[-200:]}"
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return "unshare/ip are not installed (util-linux, iproute2)"
    if os.geteuid() != 0:
        return "network namespaces for the store clients need root"
    netns = subprocess.run(
        ["unshare", "-n", "sh", "-c", "ip link set lo up"],
        check=False,
        capture_output=True,
        text=True,
    )
    if netns.returncode != 0:
        return f"cannot create a network namespace (needs root/CAP_SYS_ADMIN): {netns.stderr}"
    return None
