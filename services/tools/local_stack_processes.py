"""Child processes of ``cache-indexer local-stack``, each logging to its own file and
stopped by PID; the command lines of the project's own commands; waiting for an HTTP 200."""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

logger = logging.getLogger(__name__)


class Processes:
    """Children started by this stack; stopped in reverse order, by PID, on exit."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.procs: list[tuple[str, subprocess.Popen[bytes]]] = []

    def spawn(
        self,
        name: str,
        argv: list[str],
        env: dict[str, str] | None = None,
        stdout: int | None = None,
    ) -> subprocess.Popen[bytes]:
        log = open(self.workdir / f"{name}.log", "ab")
        proc = subprocess.Popen(
            argv,
            stdout=stdout or log,
            stderr=log,
            env=env,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        self.procs.append((name, proc))
        logger.info("started %s (pid %d): logs in %s", name, proc.pid, log.name)
        return proc

    def dead(self) -> list[str]:
        return [name for name, p in self.procs if p.poll() is not None]

    def stop_all(self, timeout: float = 10.0) -> None:
        for _, proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for name, proc in reversed(self.procs):
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("%s (pid %d) did not stop: killing it", name, proc.pid)
                proc.kill()
                proc.wait()


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "services.cli", *args]


def wait_http(url: str, timeout: float, stop: threading.Event) -> httpx.Response:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not stop.is_set():
        try:
            resp = httpx.get(url, timeout=1.0)
            if resp.status_code == 200:
                return resp
        except httpx.HTTPError:
            pass
        stop.wait(0.2)
    raise RuntimeError(f"{url} did not answer 200 within {timeout:.0f}s")
