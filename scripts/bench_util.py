"""Process helpers shared by the benchmark and vector scripts: a free loopback port, waiting
for a condition, stopping a process this script started. Standard library only, because
``make_vllm_event_vectors.py`` imports it from vLLM's interpreter."""

from __future__ import annotations

import signal
import socket
import subprocess
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(
    cond: Callable[[], T],
    what: str,
    timeout: float,
    interval: float = 0.05,
    tolerate: tuple[type[BaseException], ...] = (),
) -> T:
    """Poll ``cond`` until it returns something true and return that; an exception in
    ``tolerate`` counts as not yet (a server still starting). SystemExit naming ``what``
    after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = cond()
            if value:
                return value
        except tolerate:
            pass
        time.sleep(interval)
    raise SystemExit(f"bench: timed out waiting for {what}")


def stop(proc: subprocess.Popen[bytes], grace: float = 15.0) -> None:
    """SIGTERM, then SIGKILL if it is still running after ``grace`` seconds."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
