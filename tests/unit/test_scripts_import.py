"""Every script in ``scripts/`` that runs on the project's interpreter imports cleanly.

No test runs the benchmarks (they print numbers, they assert nothing), and ruff and mypy do
not check what one script imports from another; a helper moved or renamed would otherwise
break a benchmark unnoticed. The two ``make_vllm_*`` scripts run inside vLLM's interpreter.
"""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import ROOT

VLLM_ONLY = {"make_vllm_event_vectors", "make_vllm_hash_vectors"}


def test_every_script_imports() -> None:
    names = sorted(p.stem for p in (ROOT / "scripts").glob("*.py") if p.stem not in VLLM_ONLY)
    assert "bench_api_stalls" in names and "bench_util" in names
    code = (
        "import importlib, sys\nsys.path.insert(0, 'scripts')\n"
        f"for name in {names!r}:\n    importlib.import_module(name)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
