"""The compose stack's optional monitoring (``docker compose --profile monitoring up``):
Prometheus's config is valid for ``promtool`` with the chart's rules file, it scrapes every
cache-indexer service on the port that service serves metrics on, and Prometheus and Grafana
get the very files the chart ships (rules, dashboard) — no copies that could drift.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml

from common.config import load_config
from tests.conftest import ROOT, require
from tests.unit.test_alert_rules import RULES

COMPOSE_DIR = ROOT / "compose"
COMPOSE = yaml.safe_load((COMPOSE_DIR / "docker-compose.yaml").read_text(encoding="utf-8"))
SERVICES: dict[str, Any] = COMPOSE["services"]
PROM = yaml.safe_load((COMPOSE_DIR / "prometheus.yml").read_text(encoding="utf-8"))


def _mounts(service: str) -> dict[str, Path]:
    """Container path → host path (resolved from compose/) of a service's bind mounts."""
    out = {}
    for volume in SERVICES[service]["volumes"]:
        host, container = volume.split(":")[:2]
        out[container] = (COMPOSE_DIR / host).resolve()
    return out


def test_monitoring_runs_only_with_its_profile() -> None:
    for name in ("prometheus", "grafana"):
        assert SERVICES[name]["profiles"] == ["monitoring"]
    optional = ("prometheus", "grafana", "audit-probe")  # audit-probe: profile "audit"
    assert all("profiles" not in s for n, s in SERVICES.items() if n not in optional)


def test_prometheus_config_is_valid_with_the_charts_rules(tmp_path: Path) -> None:
    require(shutil.which("promtool"), "promtool is not installed (apt-get install prometheus)")
    (rule_file,) = PROM["rule_files"]
    assert _mounts("prometheus")[rule_file] == RULES.resolve()
    config = dict(PROM, rule_files=[str(RULES)])
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    proc = subprocess.run(
        ["promtool", "check", "config", str(path)], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout


def test_prometheus_scrapes_every_cache_indexer_service_on_its_metrics_port() -> None:
    cfg = load_config(COMPOSE_DIR / "config.yaml", env={})
    expected = {
        name: (
            int(cfg.http.addr.rsplit(":", 1)[1]) if svc["command"][0] == "api" else cfg.metrics.port
        )
        for name, svc in SERVICES.items()
        if svc.get("image") == "cache-indexer:dev" and svc["command"][0] != "simulate-vllm"
    }
    scraped = {}
    for job in PROM["scrape_configs"]:
        (sd,) = job["dns_sd_configs"]
        (name,) = sd["names"]
        scraped[name] = sd["port"]
        assert job["job_name"] == SERVICES[name]["command"][0]  # the job is the role
    assert scraped == expected


def test_grafana_gets_the_dashboard_and_the_prometheus_datasource() -> None:
    mounts = _mounts("grafana")
    provisioning = mounts["/etc/grafana/provisioning"]
    (provider,) = yaml.safe_load(
        (provisioning / "dashboards" / "cache-indexer.yaml").read_text(encoding="utf-8")
    )["providers"]
    board = Path(provider["options"]["path"]) / "cache-indexer.json"
    assert mounts[str(board)] == (ROOT / "docs" / "grafana-dashboard.json").resolve()
    (source,) = yaml.safe_load(
        (provisioning / "datasources" / "prometheus.yaml").read_text(encoding="utf-8")
    )["datasources"]
    assert (source["type"], source["url"], source["isDefault"]) == (
        "prometheus",
        "http://prometheus:9090",
        True,
    )
