"""The ``redis`` config section (cluster, AUTH, TLS) and the client options built from it."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from common.config import load_config
from common.errors import ConfigError
from common.redis_client import client_options, describe


def _load(tmp_path: Path, redis: dict[str, object], env: dict[str, str] | None = None):  # type: ignore[no-untyped-def]
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"redis": redis}))
    return load_config(path, env=env or {})


def test_keys_parse_and_secrets_come_from_the_environment(tmp_path: Path) -> None:
    ca = tmp_path / "ca.crt"
    ca.write_text("x")
    cfg = _load(
        tmp_path,
        {
            "url": "redis://r:6379/0",
            "cluster": True,
            "username": "u",
            "healthCheckInterval": "5s",
            "tls": {"enabled": True, "caFile": str(ca)},
        },
        env={"CACHE_INDEXER_REDIS_PASSWORD": "pw", "CACHE_INDEXER_REDIS_USERNAME": "acl"},
    )
    r = cfg.redis
    assert (r.cluster, r.username, r.password, r.health_check_interval) == (True, "acl", "pw", 5)
    url, options = client_options(r)
    assert url == "rediss://r:6379/0", "tls.enabled switches the scheme"
    assert options["ssl_ca_certs"] == str(ca) and options["password"] == "pw"
    assert options["username"] == "acl" and options["health_check_interval"] == 5
    assert "pw" not in describe(r) and "cluster r:6379/0 (tls on, auth acl user)" == describe(r)


def test_password_file_is_read_at_connect_time(tmp_path: Path) -> None:
    secret = tmp_path / "pw"
    secret.write_text("from-secret\n")
    cfg = _load(tmp_path, {"passwordFile": str(secret)})
    assert client_options(cfg.redis)[1]["password"] == "from-secret"


def test_plain_url_gets_no_tls_options(tmp_path: Path) -> None:
    url, options = client_options(_load(tmp_path, {}).redis)
    assert url.startswith("redis://") and not any(k.startswith("ssl") for k in options)


def test_bad_redis_settings_are_all_reported(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        _load(
            tmp_path,
            {
                "url": "http://x",
                "cluster": "yes",
                "passwordFile": "/nope",
                "tls": {"caFile": "/nope/ca", "certFile": str(tmp_path / "c.yaml"), "bogus": 1},
            },
        )
    text = str(err.value)
    for part in (
        "redis.url",
        "redis.cluster",
        "redis.passwordFile",
        "redis.tls.caFile",
        "redis.tls.bogus: unknown key",
        "certFile and keyFile go together",
    ):
        assert part in text
