"""The alerting rules (charts/cache-indexer/files/prometheus-rules.yaml, the one source the
chart's PrometheusRule and compose's Prometheus load): valid for Prometheus, unit-tested with
``promtool test rules`` (tests/data/promtool/rules_test.yaml: every alert quiet and firing),
spelt with names and labels the code exports, and each with a runbook in docs/operations.md.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import redis
import yaml

from tests.conftest import DATA, ROOT, require
from tests.metric_catalog import exported, unknown_names
from tests.services.test_api_instances import populate

RULES = ROOT / "charts" / "cache-indexer" / "files" / "prometheus-rules.yaml"
RULE_TESTS = DATA / "promtool" / "rules_test.yaml"
OPERATIONS = ROOT / "docs" / "operations.md"


def load_rules(path: Path = RULES) -> list[dict[str, Any]]:
    doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    return [rule for group in doc["groups"] for rule in group["rules"]]


def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    require(shutil.which("promtool"), "promtool is not installed (apt-get install prometheus)")
    return subprocess.run(
        ["promtool", *args], capture_output=True, text=True, check=False, timeout=120
    )


def test_rules_file_is_valid_for_prometheus() -> None:
    proc = _promtool("check", "rules", str(RULES))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(load_rules())} rules found" in proc.stdout


def test_promtool_unit_tests_pass() -> None:
    proc = _promtool("test", "rules", str(RULE_TESTS))
    assert proc.returncode == 0 and "SUCCESS" in proc.stdout, proc.stdout + proc.stderr


def test_every_alert_is_tested_quiet_and_firing() -> None:
    doc = yaml.safe_load(RULE_TESTS.read_text(encoding="utf-8"))
    cases: dict[str, set[bool]] = {}
    for group in doc["tests"]:
        for case in group["alert_rule_test"]:
            cases.setdefault(case["alertname"], set()).add(bool(case["exp_alerts"]))
    alerts = {r["alert"] for r in load_rules()}
    assert len(alerts) >= 11
    assert {a: cases.get(a, set()) for a in alerts} == {a: {False, True} for a in alerts}


def test_every_alert_has_a_runbook_section() -> None:
    text = OPERATIONS.read_text(encoding="utf-8")
    headings = {
        re.sub(r"[^a-z0-9 -]", "", h.lower()).replace(" ", "-")
        for h in re.findall(r"^#+ (.+)$", text, re.M)
    }
    for rule in load_rules():
        runbook = rule["annotations"]["runbook"]
        assert runbook == f"docs/operations.md#{rule['alert'].lower()}", rule["alert"]
        assert runbook.split("#")[1] in headings, f"no section {rule['alert']} in operations.md"
        assert rule["labels"]["severity"] in ("info", "warning", "critical")


def test_rule_expressions_use_only_exported_names(redis_client: redis.Redis) -> None:
    catalog = exported(redis_client, populate)
    assert "cache_indexer_worker_live" in catalog and "cache_indexer_instance_exact" in catalog
    for rule in load_rules():
        assert unknown_names(rule["expr"], catalog) == [], rule["alert"]
    assert unknown_names('cache_indexer_master_stale{master="x"}', catalog) == [
        "label cache_indexer_master_stale{master}"
    ]
