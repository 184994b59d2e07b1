"""The hit-rate read plan's suite (tests/services/test_api_read_plan.py) through Redis
Sentinel's master (1 master, 1 replica, 3 sentinels on loopback), as a Sentinel deployment
reads: the client :func:`common.redis_client.connect` builds from ``redis.sentinel``."""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest

from common.redis_client import connect
from common.store import Store
from tests.conftest import require
from tests.integration.test_sentinel_client import _config
from tests.redis_nodes import SentinelSet
from tests.services.test_api_read_plan import *  # noqa: F403 - the same suite, via Sentinel
from tests.store_oracle import OracleStore


@pytest.fixture(scope="module")
def sentinels() -> Iterator[SentinelSet]:
    require(shutil.which("redis-sentinel"), "redis-sentinel (scripts/setup.sh installs it)")
    s = SentinelSet().start()
    yield s
    s.cleanup()


@pytest.fixture()
def store(sentinels: SentinelSet) -> Iterator[Store]:  # overrides the suite's fixture
    client = connect(_config(sentinels), retries=3)
    client.flushall()
    yield OracleStore(client)
    client.close()
