"""Every default of the config file is written once, in ``common.config``; everything else
that states one follows it: the per-service settings (derived), the API worker's limits and
the hit-rate candidate cap (derived), the pure modules' own defaults (``HashSettings``, the
instances report's ``Limits``: checked here), the chart's ``values.yaml`` and the table of
``docs/deploy.md`` (checked here), and the chart's ``values.schema.json`` choices (generated
from the config's ``Literal`` types, tests/unit/test_chart_operations.py)."""

from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path
from typing import Any

import pytest
import yaml

from common import config
from common.config import HTTP, Config, Duration, choice_keys, load_config, parse_duration
from common.settings import ApiSettings, L1IngestSettings, L3PollerSettings
from services.api import hit_rate
from services.api.transport.deadlines import Limits as WorkerLimits

ROOT = Path(__file__).resolve().parents[2]
VALUES = yaml.safe_load((ROOT / "charts" / "cache-indexer" / "values.yaml").read_text())
CONFIG_SECTIONS = ("http", "log", "blockKey", "discovery", "ingest", "audit")
# Where the chart means another value than the file's default, and why.
CHART_DIFFERS = {
    "http.addr": "",  # filled in from service.targetPort by the ConfigMap template
    "log.format": "json",  # JSON lines when deployed
}


def _defaults(cls: Any = Config, prefix: str = "") -> dict[str, tuple[Any, Any]]:
    """Dotted YAML path → (type, default) of every leaf key of the config file."""
    leaves: dict[str, tuple[Any, Any]] = {}
    hints = typing.get_type_hints(cls)
    instance = cls()
    for f in dataclasses.fields(cls):
        path, tp = prefix + config._yaml_name(f), hints[f.name]
        if dataclasses.is_dataclass(tp):
            leaves.update(_defaults(tp, path + "."))
        else:
            leaves[path] = (tp, getattr(instance, f.name))
    return leaves


def _same(tp: Any, default: Any, written: Any) -> bool:
    if tp is Duration:
        return isinstance(written, str) and parse_duration(written) == default
    return bool(written == default and type(written) is type(default))


def test_the_settings_defaults_are_the_config_files() -> None:
    """Settings built without a file (tests, tools) are the ones an empty file gives; this
    also holds ``HashSettings()`` and the instances report's ``Limits()`` to ``blockKey``
    and ``ingest.l1``."""
    cfg = Config()
    assert L1IngestSettings() == L1IngestSettings.from_config(cfg)
    assert L3PollerSettings() == L3PollerSettings.from_config(cfg)
    assert ApiSettings() == ApiSettings.from_config(cfg)


def test_the_api_workers_limits_default_to_the_config_files() -> None:
    h = HTTP()
    assert WorkerLimits() == WorkerLimits.from_go(
        h.read_header_timeout, h.read_timeout, h.write_timeout, h.idle_timeout,
        h.max_hit_rate_body_bytes,
    )  # fmt: skip
    assert hit_rate.DEFAULT_MAX_CANDIDATES == h.max_candidates


def _deploy_table() -> dict[str, str]:
    guide = (ROOT / "docs" / "deploy.md").read_text()
    section = guide.split("\n## Config file\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([A-Za-z0-9.]+)` \| `([^`]*)` \|", section, flags=re.MULTILINE)
    return dict(rows)


def test_the_deploy_guide_shows_each_keys_default() -> None:
    table = _deploy_table()
    wrong = {
        key: (table.get(key), default)
        for key, (tp, default) in _defaults().items()
        if key not in table or not _same(tp, default, yaml.safe_load(table[key] or '""'))
    }
    assert wrong == {}, "docs/deploy.md (written, default)"


def _leaves(node: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(node, dict):
        return {prefix[:-1]: node}
    found: dict[str, Any] = {}
    for key, value in node.items():
        found.update(_leaves(value, f"{prefix}{key}."))
    return found


def test_the_charts_values_are_the_config_files_defaults() -> None:
    written = _leaves({s: VALUES[s] for s in CONFIG_SECTIONS})
    defaults = _defaults()
    assert set(written) == {k for k in defaults if k.split(".")[0] in CONFIG_SECTIONS} - {
        "discovery.kubeconfig",  # in a cluster: the pod's service account
        "discovery.static.vllm",  # the chart runs discovery in kubernetes mode
        "discovery.static.mooncakeMasters",
    }
    wrong = {
        key: (value, defaults[key][1])
        for key, value in written.items()
        if key not in CHART_DIFFERS and not _same(*defaults[key], value)
    }
    assert wrong == {}, "values.yaml (written, default)"
    assert {k: written[k] for k in CHART_DIFFERS} == CHART_DIFFERS


def test_the_charts_values_are_a_valid_config_file(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    http = dict(VALUES["http"], addr=":28080")
    path.write_text(
        yaml.safe_dump({**{s: VALUES[s] for s in CONFIG_SECTIONS}, "http": http}),
        encoding="utf-8",
    )
    load_config(path, env={})


def test_every_choice_is_a_literal_the_loader_enforces(tmp_path: Path) -> None:
    """The allowed words live in the dataclasses' ``Literal`` types only: the loader refuses
    anything else, for every choice key (the same words the chart's schema lists)."""
    keys = choice_keys()
    assert {"log.level", "discovery.mode", "ingest.l1.onUnrecoverableGap", "ingest.l3.scope"} <= (
        set(keys)
    )
    for dotted, allowed in keys.items():
        *parents, leaf = dotted.split(".")
        doc: dict[str, Any] = {}
        node = doc
        for part in parents:
            node = node.setdefault(part, {})
        for value, ok in [(allowed[-1], True), ("nonsense", False)]:
            node[leaf] = value
            path = tmp_path / "c.yaml"
            path.write_text(yaml.safe_dump(doc), encoding="utf-8")
            if ok:
                load_config(path, env={})
            else:
                with pytest.raises(config.ConfigError, match=re.escape(f"{dotted}: 'nonsense'")):
                    load_config(path, env={})
