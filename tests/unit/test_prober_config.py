"""``audit.probe.*``: loaded into :class:`ProberSettings`, bad values all reported at once."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.config import load_config
from common.errors import ConfigError
from common.settings import ProberSettings

FULL = """
audit:
  probe:
    enabled: true
    apiUrl: http://cache-indexer:8080/
    interval: 2m
    concurrency: 8
    timeout: 45s
    indexDeadline: 5s
    model: Qwen/Qwen3-8B
    promptBlocks: 2
    blockSize: 128
    cacheSalt: probe-salt
"""


def test_every_probe_key_reaches_the_prober(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(FULL, encoding="utf-8")
    assert ProberSettings.from_config(load_config(path, env={})) == ProberSettings(
        enabled=True,
        api_url="http://cache-indexer:8080",
        interval=120.0,
        concurrency=8,
        timeout=45.0,
        index_deadline=5.0,
        model="Qwen/Qwen3-8B",
        prompt_blocks=2,
        block_size=128,
        cache_salt="probe-salt",
    )


def test_unusable_probe_values_are_all_reported(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(
        "audit:\n  probe:\n    interval: 0s\n    concurrency: 0\n    promptBlocks: -1\n"
        "    blockSize: 0\n    apiUrl: redis://x\n    cacheSalt: ''\n",
        encoding="utf-8",
    )
    with pytest.raises(ConfigError) as err:
        load_config(path, env={})
    for key in ("interval", "concurrency", "promptBlocks", "blockSize", "apiUrl", "cacheSalt"):
        assert f"audit.probe.{key}" in str(err.value)
