"""The ``redis.sentinel`` config section: the file, the environment, validation, and the
client :func:`common.redis_client.connect` builds from it (no server needed to build one)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from redis.sentinel import SentinelConnectionPool

from common.config import Config, load_config
from common.errors import ConfigError
from common.redis_client import connect, describe


def _load(tmp_path: Path, redis: dict[str, Any], env: dict[str, str] | None = None) -> Config:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"redis": redis}))
    return load_config(path, env=env or {})


def test_sentinel_from_the_file_and_the_environment(tmp_path: Path) -> None:
    secret = tmp_path / "sentinel-pw"
    secret.write_text("s3cret\n")
    cfg = _load(
        tmp_path,
        {
            "url": "redis://:data-pw@ignored:1/2",
            "sentinel": {
                "addresses": ["s1:26379", "s2:26379"],
                "masterName": "mymaster",
                "passwordFile": str(secret),
                "tls": {"enabled": True},
            },
        },
    )
    s = cfg.redis.sentinel
    assert (s.addresses, s.master_name, s.tls.enabled) == (
        ["s1:26379", "s2:26379"],
        "mymaster",
        True,
    )
    client = connect(cfg.redis)
    pool = client.connection_pool
    assert isinstance(pool, SentinelConnectionPool) and pool.service_name == "mymaster"
    assert (pool.connection_kwargs["db"], pool.connection_kwargs["password"]) == (2, "data-pw")
    sentinels = pool.sentinel_manager.sentinels
    opts = [x.connection_pool.connection_kwargs for x in sentinels]
    assert [(o["host"], o["port"], o["password"]) for o in opts] == [
        ("s1", 26379, "s3cret"),
        ("s2", 26379, "s3cret"),
    ], "the sentinels have their own password, not the data node's"
    assert "s3cret" not in describe(cfg.redis) and "data-pw" not in describe(cfg.redis)
    assert describe(cfg.redis).startswith("sentinel mymaster via s1:26379,s2:26379")

    env = {
        "CACHE_INDEXER_REDIS_SENTINEL_ADDRESSES": "a:1, b:2",
        "CACHE_INDEXER_REDIS_SENTINEL_MASTER_NAME": "other",
        "CACHE_INDEXER_REDIS_SENTINEL_PASSWORD": "from-env",
    }
    s = load_config(None, env=env).redis.sentinel
    assert (s.addresses, s.master_name, s.password) == (["a:1", "b:2"], "other", "from-env")


def test_bad_sentinel_settings_are_all_reported(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        _load(
            tmp_path,
            {
                "url": "redis+sentinel://s1:26379/mymaster",
                "cluster": True,
                "sentinel": {"addresses": ["s1", "s2:x"], "passwordFile": "/nope"},
            },
        )
    text = str(err.value)
    for part in (
        "redis.url: 'redis+sentinel://s1:26379/mymaster' is not a redis://, rediss:// or unix:// "
        "URL (for Sentinel set redis.sentinel)",
        "redis.sentinel.masterName",
        "redis.sentinel: a Redis Cluster fails over by itself",
        "redis.sentinel.addresses[0]: 's1' is not host:port",
        "redis.sentinel.addresses[1]",
        "redis.sentinel.passwordFile: cannot read /nope",
    ):
        assert part in text
    with pytest.raises(ConfigError, match="redis.sentinel.addresses: name the sentinels"):
        _load(tmp_path, {"sentinel": {"masterName": "m"}})
