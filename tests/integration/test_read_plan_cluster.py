"""The hit-rate read plan's suite (tests/services/test_api_read_plan.py) on a real 3-master
Redis Cluster: candidates in different slots and nodes, read in rounds through the cluster
pipeline (one round trip per node per round), every answer equal to the full read's."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from common.config import Redis as RedisConfig
from common.redis_client import connect
from common.store import Store
from tests.redis_nodes import Cluster
from tests.services.test_api_read_plan import *  # noqa: F403 - the same suite, on a cluster
from tests.store_oracle import OracleStore


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    c = Cluster(3).start()
    yield c
    c.cleanup()


@pytest.fixture()
def store(cluster: Cluster) -> Iterator[Store]:  # overrides the suite's fixture
    client = connect(RedisConfig(url=cluster.url, cluster=True), retries=3)
    client.flushall()
    yield OracleStore(client)
    client.close()
