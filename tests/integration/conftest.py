"""Fixtures shared by integration modules (the repository-wide ones: tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.conftest import RedisServer


@pytest.fixture(scope="module")
def redis_srv() -> Iterator[RedisServer]:
    """A redis-server of this module's own (the API tests stop and restart theirs)."""
    server = RedisServer().start()
    yield server
    server.cleanup()
