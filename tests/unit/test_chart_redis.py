"""The chart's Redis settings: append-only persistence, password Secret, TLS Secret, cluster."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest


from tests.unit.test_chart import _deployment, _render, _rendered_config
from tests.unit.test_chart import load_helm


@pytest.fixture(scope="module")
def helm() -> Any:
    return load_helm()


def _container(docs: dict[str, list[Any]], component: str) -> dict[str, Any]:
    spec = _deployment(docs, component)["spec"]["template"]["spec"]
    return {"container": spec["containers"][0], "volumes": spec["volumes"]}


def test_bundled_redis_appends_and_fsyncs_every_second_by_default(helm: Any) -> None:
    redis = _container(_render(helm), "redis")["container"]
    assert "--appendonly yes --appendfsync everysec" in redis["args"][0]
    assert "requirepass" not in redis["args"][0]
    off = _render(
        helm, {"redis": {"persistence": {"appendonly": False, "existingClaim": "redis-pvc"}}}
    )
    assert "--appendonly no" in _container(off, "redis")["container"]["args"][0]
    volumes = _container(off, "redis")["volumes"]
    assert volumes == [{"name": "data", "persistentVolumeClaim": {"claimName": "redis-pvc"}}]


def test_password_secret_reaches_every_component_and_the_bundled_redis(
    helm: Any, tmp_path: Path
) -> None:
    docs = _render(
        helm, {"redis": {"passwordSecret": "redis-auth", "username": "indexer", "cluster": True}}
    )
    for component in ("api", "discovery", "l1-ingest", "l3-poll"):
        env = {e["name"]: e for e in _container(docs, component)["container"]["env"]}
        ref = env["CACHE_INDEXER_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": "redis-auth", "key": "password"}
    redis = _container(docs, "redis")["container"]
    assert '--requirepass "$REDIS_PASSWORD"' in redis["args"][0]
    assert {e["name"] for e in redis["env"]} == {"REDIS_PASSWORD", "REDISCLI_AUTH"}
    cfg = _rendered_config(docs, tmp_path)
    assert (cfg.redis.cluster, cfg.redis.username, cfg.redis.password) == (True, "indexer", "")


def test_tls_secret_is_mounted_and_named_in_the_config(helm: Any, tmp_path: Path) -> None:
    docs = _render(
        helm,
        {
            "redis": {
                "url": "rediss://ext:6380/0",
                "tls": {"secret": "redis-tls", "certKey": "tls.crt", "keyKey": "tls.key"},
            }
        },
    )
    api = _container(docs, "api")
    assert {"name": "redis-tls", "secret": {"secretName": "redis-tls"}} in api["volumes"]
    mount = next(m for m in api["container"]["volumeMounts"] if m["name"] == "redis-tls")
    assert mount["mountPath"] == "/etc/redis-tls" and mount["readOnly"]
    (cm,) = docs["ConfigMap"]
    text = cm["data"]["config.yaml"]
    for line in (
        "caFile: /etc/redis-tls/ca.crt",
        "certFile: /etc/redis-tls/tls.crt",
        "keyFile: /etc/redis-tls/tls.key",
    ):
        assert line in text
    assert "Deployment" not in docs or all(
        d["metadata"]["labels"]["app.kubernetes.io/component"] != "redis"
        for d in docs["Deployment"]
    ), "an external Redis: no bundled one"
