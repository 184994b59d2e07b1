"""The chart's operations objects, rendered by Helm's own engine: ``values.schema.json``
(generated from values.yaml; a typo or a wrong type fails lint and template, the original's
values and a ``redis.sentinel`` block pass), ServiceMonitor, PrometheusRule and the Grafana
dashboard ConfigMap (off by default; the rules and dashboard are the files as they are), the
API's PodDisruptionBudget, HorizontalPodAutoscaler and topology spread, and the optional
NetworkPolicies. Every object uses only fields the Kubernetes API models know (the operator's
CRDs aside).
"""

from __future__ import annotations

import json
import sys
from typing import Any

import pytest
import yaml

from tests.unit.test_alert_rules import RULES
from tests.unit.test_chart import (
    CHART,
    ORIGINAL,
    ROOT,
    _deployment,
    _render,
    _unknown_fields,
    load_helm,
)

MONITORING_ON = {
    "metrics": {
        "serviceMonitor": {"enabled": True, "labels": {"release": "kps"}},
        "prometheusRule": {"enabled": True, "labels": {"release": "kps"}},
        "grafanaDashboard": {"enabled": True, "annotations": {"grafana_folder": "infer"}},
    }
}
SENTINEL = {
    "redis": {
        "enabled": False,
        "sentinel": {
            "enabled": True,
            "addresses": ["sentinel-0:26379", "sentinel-1:26379"],
            "masterName": "mymaster",
            "existingSecret": "redis-pass",
            "tls": True,
        },
    }
}


@pytest.fixture(scope="module")
def helm() -> Any:
    return load_helm()


def _lint_errors(helm: Any, values: dict[str, Any] | None) -> list[str]:
    report = helm.lint(str(CHART), values, strict=True, namespace="infer")
    return list(report["errors"]) + [m["error"] for m in report["messages"] if m["severity"] >= 2]


def _selected(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


# ---- values.schema.json ------------------------------------------------------------------


def test_schema_is_generated_from_values_yaml() -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import make_values_schema
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    committed = (CHART / "values.schema.json").read_text(encoding="utf-8")
    assert committed == make_values_schema.render(), "run python scripts/make_values_schema.py"
    schema = json.loads(committed)
    assert schema["additionalProperties"] is False
    assert schema["properties"]["api"]["properties"]["replicas"] == {"type": "integer"}


@pytest.mark.parametrize(
    ("values", "complaint"),
    [
        ({"replicaCount": 3}, "additional properties 'replicaCount' not allowed"),
        ({"api": {"replica": 3}}, "additional properties 'replica' not allowed"),
        ({"api": {"replicas": "3"}}, "/api/replicas': got string, want integer"),
        ({"metrics": {"serviceMonitor": {"enable": True}}}, "'enable' not allowed"),
        ({"log": {"level": "verbose"}}, "/log/level"),
        ({"blockKey": {"prefixCachingHashAlgo": "xxhash"}}, "/blockKey/prefixCachingHashAlgo"),
        ({"ingest": {"l1": {"hashCheckRate": "fast"}}}, "/ingest/l1/hashCheckRate"),
        ({"discovery": {"labels": {"engineKey": ["a"]}}}, "/discovery/labels/engineKey"),
        ({"redis": {"sentinel": {"addresses": "s:26379"}}}, "/redis/sentinel/addresses"),
        ({"networkPolicy": {"enabled": "yes"}}, "/networkPolicy/enabled"),
    ],
)
def test_a_typo_or_a_wrong_type_fails_lint_and_template(
    helm: Any, values: dict[str, Any], complaint: str
) -> None:
    errors = _lint_errors(helm, values)
    assert any(complaint in e for e in errors), errors
    with pytest.raises(helm.HelmError, match="schema"):
        _render(helm, values)


@pytest.mark.parametrize(
    "values",
    [
        None,
        ORIGINAL,
        SENTINEL,
        MONITORING_ON,
        {
            **MONITORING_ON,
            "networkPolicy": {"enabled": True},
            "api": {"autoscaling": {"enabled": True}},
        },
        {"blockKey": {"pythonHashSeed": 42}},
    ],
    ids=["defaults", "original-values", "redis-sentinel", "monitoring", "all-on", "numeric-seed"],
)
def test_good_values_pass_the_schema(helm: Any, values: dict[str, Any] | None) -> None:
    assert _lint_errors(helm, values) == []


# ---- monitoring --------------------------------------------------------------------------


def test_monitoring_objects_are_off_by_default(helm: Any) -> None:
    docs = _render(helm)
    for kind in ("ServiceMonitor", "PrometheusRule", "NetworkPolicy", "HorizontalPodAutoscaler"):
        assert kind not in docs, kind
    assert [c["metadata"]["name"] for c in docs["ConfigMap"]] == ["rel-cache-indexer-config"]


def test_service_monitor_scrapes_the_api_and_every_worker(helm: Any) -> None:
    docs = _render(helm, MONITORING_ON)
    (sm,) = docs["ServiceMonitor"]
    assert sm["metadata"]["labels"]["release"] == "kps"
    ports = {e["port"] for e in sm["spec"]["endpoints"]}
    assert all(e["path"] == "/metrics" for e in sm["spec"]["endpoints"])
    scraped = {}
    for svc in docs["Service"]:
        named = {p["name"] for p in svc["spec"]["ports"]} & ports
        if _selected(sm["spec"]["selector"]["matchLabels"], svc["metadata"]["labels"]) and named:
            scraped[svc["metadata"]["labels"]["app.kubernetes.io/component"]] = svc
    assert set(scraped) == {"api", "discovery", "l1-ingest", "l3-poll"}
    for component, svc in scraped.items():  # each Service selects that component's pods
        pod_labels = _deployment(docs, component)["spec"]["template"]["metadata"]["labels"]
        assert _selected(svc["spec"]["selector"], pod_labels), component
    off = _render(helm, {**MONITORING_ON, "l3Poller": {"enabled": False}})
    assert "rel-cache-indexer-l3-poll-metrics" not in {
        s["metadata"]["name"] for s in off["Service"]
    }


def test_prometheus_rule_and_dashboard_are_the_files_as_they_are(helm: Any) -> None:
    docs = _render(helm, MONITORING_ON)
    (rule,) = docs["PrometheusRule"]
    assert rule["spec"] == yaml.safe_load(RULES.read_text(encoding="utf-8"))
    assert rule["metadata"]["labels"]["release"] == "kps"
    (board,) = [c for c in docs["ConfigMap"] if "cache-indexer.json" in c.get("data", {})]
    assert board["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert board["metadata"]["annotations"] == {"grafana_folder": "infer"}
    shipped = (CHART / "files" / "grafana-dashboard.json").read_text(encoding="utf-8")
    assert json.loads(board["data"]["cache-indexer.json"]) == json.loads(shipped)


# ---- the API's availability ------------------------------------------------------------


def test_api_pdb_and_topology_spread_select_the_api_pods(helm: Any) -> None:
    docs = _render(helm)
    api = _deployment(docs, "api")
    pod_labels = api["spec"]["template"]["metadata"]["labels"]
    (pdb,) = docs["PodDisruptionBudget"]
    assert pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"] == api["spec"]["selector"]["matchLabels"]
    spread = api["spec"]["template"]["spec"]["topologySpreadConstraints"]
    assert [(c["topologyKey"], c["whenUnsatisfiable"]) for c in spread] == [
        ("topology.kubernetes.io/zone", "ScheduleAnyway"),
        ("kubernetes.io/hostname", "ScheduleAnyway"),
    ]
    assert all(_selected(c["labelSelector"]["matchLabels"], pod_labels) for c in spread)
    for worker in ("discovery", "l1-ingest", "l3-poll"):  # only the API replicas spread
        assert (
            "topologySpreadConstraints" not in _deployment(docs, worker)["spec"]["template"]["spec"]
        )
    docs = _render(
        helm,
        {"api": {"podDisruptionBudget": {"enabled": False}, "topologySpread": {"enabled": False}}},
    )
    assert "PodDisruptionBudget" not in docs
    assert "topologySpreadConstraints" not in _deployment(docs, "api")["spec"]["template"]["spec"]


def test_autoscaling_owns_the_api_replica_count(helm: Any) -> None:
    docs = _render(helm, {"api": {"autoscaling": {"enabled": True, "maxReplicas": 6}}})
    (hpa,) = docs["HorizontalPodAutoscaler"]
    api = _deployment(docs, "api")
    assert "replicas" not in api["spec"]  # the HPA sets it; helm upgrade must not reset it
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": api["metadata"]["name"],
    }
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 6)
    (metric,) = hpa["spec"]["metrics"]
    assert metric["resource"]["name"] == "cpu"
    assert metric["resource"]["target"] == {"type": "Utilization", "averageUtilization": 70}
    with pytest.raises(helm.HelmError, match="minReplicas"):
        _render(
            helm, {"api": {"autoscaling": {"enabled": True, "minReplicas": 5, "maxReplicas": 3}}}
        )


# ---- network policies --------------------------------------------------------------------


def _policies(docs: dict[str, list[Any]]) -> dict[str, dict[str, Any]]:
    return {
        p["metadata"]["labels"]["app.kubernetes.io/component"]: p["spec"]
        for p in docs["NetworkPolicy"]
    }


def _egress_ports(spec: dict[str, Any]) -> set[Any]:
    return {(p["port"], p.get("endPort")) for rule in spec["egress"] for p in rule["ports"]}


def test_network_policies_allow_what_each_component_needs(helm: Any) -> None:
    values = {
        "networkPolicy": {
            "enabled": True,
            "apiFrom": [{"namespaceSelector": {"matchLabels": {"role": "router"}}}],
        },
        "discovery": {"vllm": {"dataParallelSize": 4, "replayPort": 5600}},
    }
    docs = _render(helm, values)
    policies = _policies(docs)
    assert set(policies) == {"api", "discovery", "l1-ingest", "l3-poll", "redis"}
    for component, spec in policies.items():  # each selects exactly its own pods
        pods = _deployment(docs, component)["spec"]["template"]["metadata"]["labels"]
        assert _selected(spec["podSelector"]["matchLabels"], pods), component
    common = {(53, None), (6379, None)}
    assert policies["api"]["ingress"] == [
        {
            "ports": [{"port": "http", "protocol": "TCP"}],
            "from": [{"namespaceSelector": {"matchLabels": {"role": "router"}}}],
        }
    ]
    assert _egress_ports(policies["api"]) == common
    assert _egress_ports(policies["discovery"]) == common | {
        (443, None),
        (6443, None),
        (9003, None),
        ("http", None),
    }
    assert _egress_ports(policies["l3-poll"]) == common | {(9003, None), ("http", None)}
    assert _egress_ports(policies["l1-ingest"]) == common | {
        (5557, 5560),  # one publisher port per DP rank
        ("zmq-pub", None),
        (5600, None),
    }
    for worker in ("discovery", "l1-ingest", "l3-poll"):
        assert policies[worker]["ingress"] == [{"ports": [{"port": "metrics", "protocol": "TCP"}]}]
    (redis_in,) = policies["redis"]["ingress"]
    release = {"app.kubernetes.io/name": "cache-indexer", "app.kubernetes.io/instance": "rel"}
    assert redis_in["from"] == [{"podSelector": {"matchLabels": release}}]
    assert policies["redis"]["policyTypes"] == ["Ingress"]


def test_network_policies_follow_an_external_redis_and_extra_egress(helm: Any) -> None:
    sentinels = {"ports": [{"port": 26379, "protocol": "TCP"}]}
    docs = _render(
        helm,
        {
            "networkPolicy": {"enabled": True, "extraEgress": [sentinels]},
            "redis": {"url": "rediss://ext.example:6380/0"},
        },
    )
    policies = _policies(docs)
    assert "redis" not in policies
    for spec in policies.values():
        assert (6380, None) in _egress_ports(spec) and (6379, None) not in _egress_ports(spec)
        assert spec["egress"][-1] == sentinels


@pytest.mark.parametrize("values", [MONITORING_ON, {"networkPolicy": {"enabled": True}}])
def test_new_objects_use_only_known_kubernetes_fields(helm: Any, values: dict[str, Any]) -> None:
    from tests.unit.test_chart import _MODELS

    checked = 0
    for kind_docs in _render(helm, {**values, "api": {"autoscaling": {"enabled": True}}}).values():
        for doc in kind_docs:
            if doc["kind"] in ("ServiceMonitor", "PrometheusRule"):  # the operator's CRDs
                assert doc["apiVersion"] == "monitoring.coreos.com/v1"
                continue
            assert (
                _unknown_fields(doc, _MODELS[(doc["apiVersion"], doc["kind"])], doc["kind"]) == []
            )
            checked += 1
    assert checked >= 13
