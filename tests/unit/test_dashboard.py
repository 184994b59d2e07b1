"""The Grafana dashboard: the committed JSON (docs/ and the chart's copy) is exactly what
scripts/make_dashboard.py generates with grafana-foundation-sdk, it covers what the issue
asks an operator to see, and its queries use only names and labels the code exports
(a real Prometheus runs them in tests/integration/test_prometheus_stack.py).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from types import ModuleType

import redis

from tests.conftest import ROOT, require
from tests.metric_catalog import exported, unknown_names
from tests.services.test_api_instances import populate


def load_generator() -> ModuleType:
    require(
        importlib.util.find_spec("grafana_foundation_sdk"),
        "grafana-foundation-sdk is not installed (pip install -e '.[chart]'; scripts/setup.sh)",
    )
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import make_dashboard
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    return make_dashboard


def test_committed_json_is_the_generators_output() -> None:
    gen = load_generator()
    assert len(gen.OUTPUTS) == 2
    for path in gen.OUTPUTS:
        assert path.read_text(encoding="utf-8") == gen.render(), (
            f"{path}: run python scripts/make_dashboard.py"
        )
    assert gen.main(["--check"]) == 0


def test_dashboard_shows_what_operators_need() -> None:
    doc = json.loads(load_generator().render())
    assert doc["uid"] == "cache-indexer" and doc["templating"]["list"][0]["query"] == "prometheus"
    text = " ".join(t["expr"] for p in doc["panels"] for t in p.get("targets", []))
    for needed in (
        "cache_indexer_api_requests_total",  # request rate and errors per endpoint
        "cache_indexer_api_request_duration_seconds_bucket",  # latency
        "cache_indexer_api_best_hit_ratio_bucket",  # hit ratio distribution
        "cache_indexer_instance_l1_state",  # instances by state
        "cache_indexer_l1_events_total",  # events applied
        "cache_indexer_l1_gaps_total",  # gaps
        "cache_indexer_master_poll_age_seconds",  # L3 poll age
        "cache_indexer_master_keys",  # L3 keys
        "cache_indexer_redis_used_memory_bytes",  # Redis memory
        "cache_indexer_worker_live",  # worker liveness
    ):
        assert needed in text, needed
    panels = [p for p in doc["panels"] if p["type"] != "row"]
    assert all(p["datasource"]["uid"] == "${datasource}" for p in panels)
    assert len({p["id"] for p in doc["panels"]}) == len(doc["panels"])
    assert all(t["refId"] for p in panels for t in p["targets"])


def test_queries_use_only_exported_names(redis_client: redis.Redis) -> None:
    catalog = exported(redis_client, populate)
    for title, expr in load_generator().queries():
        assert unknown_names(expr, catalog) == [], title
