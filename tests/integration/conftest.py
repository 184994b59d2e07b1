"""Fixtures shared by integration modules (the repository-wide ones: tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import redis

from common.blockhash import HashSettings
from tests.conftest import RedisServer
from tests.integration.l1_support import InProcessIngester


@pytest.fixture(scope="module")
def redis_srv() -> Iterator[RedisServer]:
    """A redis-server of this module's own (the API tests stop and restart theirs)."""
    server = RedisServer().start()
    yield server
    server.cleanup()


@pytest.fixture()
def ingester(redis_client: redis.Redis) -> Iterator[Callable[..., InProcessIngester]]:
    """In-process L1 ingesters on the test's Redis (hash settings and config overrides
    optional), all closed afterwards."""
    made: list[InProcessIngester] = []

    def make(settings: HashSettings | None = None, **overrides: str) -> InProcessIngester:
        made.append(InProcessIngester(redis_client, settings, **overrides))
        return made[-1]

    yield make
    for ing in made:
        ing.close()
