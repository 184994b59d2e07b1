"""The store's contract suite (tests/unit/test_store.py, test_store_copies.py) on a real
3-master Redis Cluster through :func:`common.redis_client.connect` with ``cluster: true``."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from redis.cluster import RedisCluster

from common.config import Redis as RedisConfig
from common.redis_client import _Cluster, client_options
from common.store import Store
from tests.redis_nodes import Cluster
from tests.unit.test_store import *  # noqa: F403 - the same suite, run here on a cluster
from tests.unit.test_store_copies import *  # noqa: F403
from tests.store_oracle import OracleStore


class _AllNodesKeys(_Cluster):
    """KEYS over every primary (redis-py sends it to one node), for the suite's checks."""

    def keys(self, pattern: str = "*", **kwargs: object) -> list[bytes]:  # type: ignore[override]
        return super().keys(pattern, target_nodes=RedisCluster.PRIMARIES)  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    c = Cluster(3).start()
    yield c
    c.cleanup()


@pytest.fixture()
def store(cluster: Cluster) -> Iterator[Store]:  # overrides the suites' fixture
    url, options = client_options(RedisConfig(url=cluster.url, cluster=True), retries=3)
    client = _AllNodesKeys.from_url(url, **options)
    client.flushall()
    yield OracleStore(client)
    client.close()
