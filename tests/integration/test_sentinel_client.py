"""The Redis client on real Sentinel servers (Debian's redis-sentinel; 1 master, 1 replica, 3
sentinels on loopback): it follows a promotion under pooled connections (never an error to
the caller, never a write to the demoted master), and readiness names the role it talks
to — 503 on a replica or a sentinel, for the API and for the workers."""

from __future__ import annotations

import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import falcon.testing
import pytest
import redis
import yaml

from common.blockhash import BlockHasher, HashSettings
from common.config import Duration, RedisSentinel, RedisTLS, load_config
from common.config import Redis as RedisConfig
from common.health import Health
from common.redis_client import connect, role, watch_role
from common.settings import ApiSettings
from common.store import Instance, Store
from services.api.api_metrics import ApiMetrics
from services.api.app import create_app
from tests.conftest import Node, require, wait_for
from tests.integration.test_redis_auth_tls import _make_certs
from tests.redis_nodes import SENTINEL_MASTER, SentinelSet


@pytest.fixture(scope="module")
def sentinels() -> Iterator[SentinelSet]:
    require(shutil.which("redis-sentinel"), "redis-sentinel (scripts/setup.sh installs it)")
    s = SentinelSet().start()
    yield s
    s.cleanup()


def _config(s: SentinelSet) -> RedisConfig:
    return RedisConfig(
        sentinel=RedisSentinel(addresses=s.addresses, master_name=SENTINEL_MASTER),
        socket_timeout=Duration(1),
        connect_timeout=Duration(1),
    )


def _api(store: Store) -> falcon.testing.TestClient:
    hasher = BlockHasher(HashSettings())
    return falcon.testing.TestClient(create_app(ApiSettings(), store, hasher, ApiMetrics()))


def test_a_failover_under_pooled_connections_moves_the_next_write_to_the_new_master(
    sentinels: SentinelSet,
) -> None:
    """A graceful failover (SENTINEL FAILOVER) demotes the master under a pooled connection
    (Sentinel also closes the demoted master's clients; one that is still open gets READONLY,
    which redis-py turns into a reconnect): the next write lands on the new master, without
    an error reaching the caller."""
    client = connect(_config(sentinels), retries=3)
    store = Store(client)
    old = sentinels.master_port()
    assert old is not None
    store.upsert_instance(Instance(ip="10.0.0.1", uid="a"))  # a pooled connection to `old`
    assert role(client) == f"master at 127.0.0.1:{old}"
    redis.Redis(port=sentinels.sentinels[0].port).execute_command(
        "SENTINEL", "FAILOVER", SENTINEL_MASTER
    )
    new = sentinels.wait_failover(old)
    wait_for(
        lambda: redis.Redis(port=old).role()[0] == b"slave",
        timeout=30,
        what="the old master to be a replica",
    )
    store.upsert_instance(Instance(ip="10.0.0.2", uid="b"))  # reconnect → the sentinels → new
    assert store.instance_ips() == {"10.0.0.1", "10.0.0.2"}
    assert role(client) == f"master at 127.0.0.1:{new}"
    assert _api(store).simulate_get("/readyz").json == {
        "status": "ok",
        "redis": f"master at 127.0.0.1:{new}",
    }
    sentinels.wait_stable(new)
    client.close()


def test_readiness_on_a_replica_is_503_and_names_it(sentinels: SentinelSet) -> None:
    """A plain ``redis.url`` that points at a replica (e.g. a master that was demoted), or at
    a sentinel: the API's /readyz is 503 and a worker is not ready; both name the role."""
    replica = next(n for n in sentinels.nodes if n.port != sentinels.master_port())
    client = connect(RedisConfig(url=replica.url), retries=1)
    result = _api(Store(client)).simulate_get("/readyz")
    assert result.status_code == 503
    assert result.json["redis"] == f"slave at 127.0.0.1:{replica.port}"
    health, stop = Health(), threading.Event()
    thread = watch_role(client, health, stop)
    try:
        wait_for(
            lambda: (
                health.readiness()
                == (
                    False,
                    f"not ready: redis role: slave at 127.0.0.1:{replica.port} (the state "
                    "store is a replica: it refuses writes, its copy is not kept up to date)",
                )
            ),
            timeout=10,
            what="the worker's readiness to name the replica",
        )
    finally:
        stop.set()
        thread.join(10)
    sentinel = connect(RedisConfig(url=sentinels.sentinels[0].url), retries=1)
    result = _api(Store(sentinel)).simulate_get("/readyz")
    assert result.status_code == 503, "redis.url naming a sentinel is not a store"
    assert result.json["reason"].startswith("redis.url names a Sentinel: set redis.sentinel")
    sentinel.close()
    master = connect(_config(sentinels), retries=1)
    health, stop = Health(), threading.Event()
    thread = watch_role(master, health, stop)
    try:
        wait_for(
            lambda: (
                health.readiness()
                == (True, f"ok (redis role: master at 127.0.0.1:{sentinels.master_port()})")
            ),
            timeout=10,
            what="the worker's readiness to name the master",
        )
    finally:
        stop.set()
        thread.join(10)
    client.close()
    master.close()


def test_the_sentinels_password_is_apart_from_the_data_nodes(tmp_path: Path) -> None:
    """Sentinels with a password of their own (``requirepass`` in sentinel.conf) in front of
    data nodes with another: both from the environment, as the chart's Secrets give them;
    each used where it belongs, and either missing is an error, not a hang."""
    s = SentinelSet(password="data-pw", sentinel_password="sentinel-pw").start()
    try:
        config = tmp_path / "config.yaml"
        config.write_text(
            yaml.safe_dump(
                {
                    "redis": {
                        "socketTimeout": "1s",
                        "sentinel": {"addresses": s.addresses, "masterName": SENTINEL_MASTER},
                    }
                }
            )
        )
        env = {
            "CACHE_INDEXER_REDIS_PASSWORD": "data-pw",
            "CACHE_INDEXER_REDIS_SENTINEL_PASSWORD": "sentinel-pw",
        }
        cfg = load_config(config, env=env).redis
        client = connect(cfg, retries=1)
        Store(client).upsert_instance(Instance(ip="10.0.0.1", uid="a"))
        assert role(client) == f"master at 127.0.0.1:{s.nodes[0].port}"
        client.close()
        for missing in ("CACHE_INDEXER_REDIS_PASSWORD", "CACHE_INDEXER_REDIS_SENTINEL_PASSWORD"):
            partial = {k: v for k, v in env.items() if k != missing}
            other = connect(load_config(config, env=partial).redis, retries=0)
            with pytest.raises(redis.ConnectionError):
                other.ping()
            other.close()
    finally:
        s.cleanup()


def test_an_acl_without_role_still_names_the_role() -> None:
    """ROLE is in @dangerous, which ACLs often deny: the role then comes from INFO (a user
    allowed ``+info``, as docs/deploy.md's example), so readiness keeps working."""
    acl = ["--user", "default", "off", "--user", "indexer", "on", ">pw", "~ci:*", "+@all"]
    node = Node(args=[*acl, "-role"], ping={"username": "indexer", "password": "pw"}).start()
    try:
        client = connect(RedisConfig(url=node.url, username="indexer", password="pw"))
        with pytest.raises(redis.exceptions.NoPermissionError):
            client.role()
        assert role(client) == f"master at 127.0.0.1:{node.port}"
        client.close()
    finally:
        node.cleanup()


def test_sentinels_and_data_nodes_over_tls(tmp_path: Path) -> None:
    """Everything TLS-only (no plain port): the data nodes trusted through ``redis.tls``, the
    sentinels through their own ``redis.sentinel.tls``; a failover followed over TLS."""
    certs = _make_certs(tmp_path)
    s = SentinelSet(certs=certs).start()
    try:
        cfg = RedisConfig(
            url="rediss://sentinel-managed/0",  # the host is the sentinels' business
            tls=RedisTLS(enabled=True, ca_file=certs["ca.crt"]),
            sentinel=RedisSentinel(
                addresses=s.addresses,
                master_name=SENTINEL_MASTER,
                tls=RedisTLS(enabled=True, ca_file=certs["ca.crt"]),
            ),
            socket_timeout=Duration(1),
            connect_timeout=Duration(1),
        )
        client = connect(cfg, retries=3)
        store = Store(client)
        store.upsert_instance(Instance(ip="10.0.0.1", uid="a"))
        old = s.nodes[0].port
        assert role(client) == f"master at 127.0.0.1:{old}"
        s.kill(old)
        new = s.wait_failover(old)
        wait_for(
            lambda: store.upsert_instance(Instance(ip="10.0.0.2", uid="b")),
            timeout=30,
            what="a write on the new master, over TLS",
        )
        assert role(client) == f"master at 127.0.0.1:{new}"
        assert "10.0.0.2" in store.instance_ips()
        plain = RedisConfig(sentinel=cfg.sentinel, socket_timeout=Duration(1))
        with pytest.raises(redis.ConnectionError):  # the data nodes speak TLS only
            connect(plain, retries=0).ping()
        client.close()
    finally:
        s.cleanup()
