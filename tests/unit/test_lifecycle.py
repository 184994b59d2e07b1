"""``Backoff``: the delays its docstring promises (equal jitter, capped, reset)."""

from __future__ import annotations

import random

from common.lifecycle import Backoff


def test_equal_jitter_doubles_up_to_the_cap_and_never_drops_below_half() -> None:
    backoff = Backoff(1.0, 8.0, rng=random.Random(7))
    caps = [1.0, 2.0, 4.0, 8.0, 8.0, 8.0]
    for _ in range(200):
        backoff.reset()
        for cap in caps:
            delay = backoff.next_delay()
            assert cap / 2 <= delay <= cap


def test_draws_spread_over_the_window() -> None:
    """Jitter at all: delays of one attempt are not one fixed value."""
    rng = random.Random(3)
    delays = []
    for _ in range(100):
        backoff = Backoff(2.0, 2.0, rng=rng)
        delays.append(backoff.next_delay())
    assert min(delays) < 1.2 and max(delays) > 1.8


def test_reset_starts_again_from_the_initial_delay() -> None:
    backoff = Backoff(0.5, 30.0, rng=random.Random(1))
    for _ in range(10):
        backoff.next_delay()
    backoff.reset()
    assert 0.25 <= backoff.next_delay() <= 0.5
