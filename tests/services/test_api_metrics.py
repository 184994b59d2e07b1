"""The API's metrics: one process's own registry, and the import order that multiprocess
mode needs (the real cross-worker sum is tested under gunicorn in
tests/integration/test_api_metrics_gunicorn.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from services.api.api_metrics import ApiMetrics
from tests.conftest import ROOT
from tests.metrics_oracle import value_of

PATH = "/kv-cache/hit-rate"


def test_without_a_shared_dir_a_worker_renders_its_own_registry() -> None:
    metrics = ApiMetrics()
    metrics.hashed_blocks.inc(5)
    metrics.requests.inc(path=PATH, status="200")
    metrics.latency.observe(0.003, path=PATH)
    text = metrics.render().decode()
    assert "cache_indexer_api_hashed_blocks_total 5.0" in text
    assert f'cache_indexer_api_requests_total{{path="{PATH}",status="200"}} 1.0' in text
    assert (
        f'cache_indexer_api_request_duration_seconds_bucket{{le="0.005",path="{PATH}"}} 1.0' in text
    )
    assert "_created" not in text
    assert value_of(metrics.requests, path=PATH, status="200") == 1


def test_the_gunicorn_master_does_not_import_prometheus_client() -> None:
    """prometheus_client picks its multiprocess values at import: the master, which sets
    PROMETHEUS_MULTIPROC_DIR in on_starting, must not have imported it before."""
    code = (
        "import sys, services.cli, services.api.main, services.api.gunicorn_conf; "
        "print(sorted(m for m in sys.modules if m.startswith('prometheus_client')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    assert out.stdout.strip() == "[]"


def test_a_worker_refuses_multiprocess_mode_when_imported_too_early(tmp_path: Path) -> None:
    # This test process imported prometheus_client without PROMETHEUS_MULTIPROC_DIR.
    with pytest.raises(RuntimeError, match="imported before PROMETHEUS_MULTIPROC_DIR"):
        ApiMetrics(tmp_path)
