"""Run a driver script in a private network namespace and read the JSON lines it prints.

The real vLLM engine and Mooncake's store clients listen on every interface (``tcp://*``,
``0.0.0.0``), so the drivers that start them run under ``unshare -n`` with only ``lo`` up:
nothing they open is reachable from outside the test. Each driver prints one JSON object per
line on stdout (progress lines are not JSON); the caller gets them in order.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def run_driver(driver: Path, timeout: float, *args: str) -> list[dict[str, Any]]:
    """Run ``driver`` with ``args`` and this Python in a fresh network namespace (cwd: the
    repository); return the JSON objects it printed. Fails the test if the driver exited
    non-zero or printed none."""
    proc = subprocess.run(
        [
            "unshare",
            "-n",
            "sh",
            "-c",
            f'ip link set lo up && exec "{sys.executable}" "{driver}" {shlex.join(args)}',
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and lines, f"driver failed: {proc.stderr[-3000:]}"
    return lines


def last_result(driver: Path, timeout: float) -> dict[str, Any]:
    """The driver's last JSON object, which must not report an ``error``."""
    out = run_driver(driver, timeout)[-1]
    assert "error" not in out, json.dumps(out, indent=1)[-8000:]
    return dict(out)
