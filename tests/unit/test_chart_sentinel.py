"""The chart pointing at an external Redis Sentinel (issue 19): the config's redis.sentinel,
the sentinels' password Secret and TLS Secret, and no bundled Redis."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.unit.test_chart import _deployment, _render, _rendered_config, load_helm

SENTINEL = {
    "addresses": ["redis-sentinel-0.redis-sentinel:26379", "redis-sentinel:26379"],
    "masterName": "mymaster",
}
COMPONENTS = ("api", "discovery", "l1-ingest", "l3-poll")


@pytest.fixture(scope="module")
def helm() -> Any:
    return load_helm()


def _spec(docs: dict[str, list[Any]], component: str) -> dict[str, Any]:
    spec: dict[str, Any] = _deployment(docs, component)["spec"]["template"]["spec"]
    return spec


def test_sentinel_values_reach_the_config_and_every_component(helm: Any, tmp_path: Path) -> None:
    report = helm.lint(
        str(Path(__file__).resolve().parents[2] / "charts" / "cache-indexer"),
        {"redis": {"sentinel": SENTINEL}},
        strict=True,
        namespace="infer",
    )
    assert report["errors"] == [], report
    docs = _render(
        helm,
        {
            "redis": {
                "sentinel": {**SENTINEL, "existingSecret": "sentinel-auth"},
                "passwordSecret": "redis-auth",
            }
        },
    )
    cfg = _rendered_config(docs, tmp_path).redis
    assert (cfg.sentinel.addresses, cfg.sentinel.master_name) == (
        SENTINEL["addresses"],
        "mymaster",
    )
    assert cfg.url == "redis://127.0.0.1:6379/0", "no URL: the sentinels say where the master is"
    for component in COMPONENTS:
        env = {e["name"]: e for e in _spec(docs, component)["containers"][0]["env"]}
        ref = env["CACHE_INDEXER_REDIS_SENTINEL_PASSWORD"]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": "sentinel-auth", "key": "sentinel-password"}
        assert env["CACHE_INDEXER_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == (
            "redis-auth"
        ), "the data nodes' password stays separate"
    labels = {d["metadata"]["labels"]["app.kubernetes.io/component"] for d in docs["Deployment"]}
    assert "redis" not in labels, "an external Sentinel: no bundled Redis"


def test_sentinel_tls_secret_is_mounted_and_named_in_the_config(helm: Any) -> None:
    tls = {"enabled": True, "secret": "sentinel-tls", "certKey": "tls.crt", "keyKey": "tls.key"}
    docs = _render(helm, {"redis": {"sentinel": {**SENTINEL, "tls": tls}}})
    spec = _spec(docs, "l1-ingest")
    assert {"name": "redis-sentinel-tls", "secret": {"secretName": "sentinel-tls"}} in spec[
        "volumes"
    ]
    mount = next(
        m for m in spec["containers"][0]["volumeMounts"] if m["name"] == "redis-sentinel-tls"
    )
    assert mount["mountPath"] == "/etc/redis-sentinel-tls" and mount["readOnly"]
    (cm,) = docs["ConfigMap"]
    sentinel = yaml.safe_load(cm["data"]["config.yaml"])["redis"]["sentinel"]
    assert sentinel["tls"] == {
        "enabled": True,
        "insecureSkipVerify": False,
        "caFile": "/etc/redis-sentinel-tls/ca.crt",
        "certFile": "/etc/redis-sentinel-tls/tls.crt",
        "keyFile": "/etc/redis-sentinel-tls/tls.key",
    }


def test_network_policies_let_every_component_reach_the_sentinels(helm: Any) -> None:
    docs = _render(
        helm,
        {
            "networkPolicy": {"enabled": True},
            "redis": {"sentinel": {**SENTINEL, "addresses": ["s-0:26379", "s-1:26380"]}},
        },
    )
    policies = [p for p in docs["NetworkPolicy"] if "redis" not in p["metadata"]["name"]]
    assert len(policies) == len(COMPONENTS)
    for policy in policies:
        (to_redis,) = [
            e for e in policy["spec"]["egress"] if {"port": 6379, "protocol": "TCP"} in e["ports"]
        ]
        assert to_redis["ports"] == [
            {"port": p, "protocol": "TCP"} for p in (6379, 26379, 26380)
        ], "the data nodes (redis.port) and each sentinel port"
        assert "to" not in to_redis, "external: anywhere"
