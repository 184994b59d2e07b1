"""Fixtures shared by the L3 poller modules (tests/services/test_l3_*poller.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import redis

from tests.fake_master import FakeMaster
from tests.services.test_l3_poller import Harness, l3cfg


@pytest.fixture()
def harness_factory(redis_client: redis.Redis) -> Iterator[Callable[..., Harness]]:
    """Pollers on the test's Redis with ``l3cfg(**kw)`` settings, all stopped afterwards."""
    made: list[Harness] = []

    def make(**kw: object) -> Harness:
        made.append(Harness(redis_client, l3cfg(**kw)))
        return made[-1]

    yield make
    for h in made:
        h.close()


@pytest.fixture()
def master() -> Iterator[FakeMaster]:
    m = FakeMaster("0.3.13").start()
    yield m
    m.stop()
