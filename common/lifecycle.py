"""Process lifecycle shared by the workers: stop events, signal handling, capped backoff.

Signal handlers only set a :class:`threading.Event` (warm shutdown); a second signal
exits at once (cold shutdown). Waiting is always ``stop.wait(delay)`` so that a stop
request is noticed immediately.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import threading
from types import FrameType

logger = logging.getLogger(__name__)


def install_signal_handlers(stop: threading.Event) -> None:
    """SIGTERM/SIGINT: first one sets ``stop``; the second one exits immediately."""

    def _handle(signum: int, _frame: FrameType | None) -> None:
        if stop.is_set():
            logger.warning("second signal %s: exiting now", signum)
            os._exit(1)
        logger.info("signal %s: stopping", signum)
        stop.set()

    signal.signal(signal.SIGTERM, _handle)
    signal.signal(signal.SIGINT, _handle)


class Backoff:
    """Capped exponential backoff with *equal* jitter: the n-th delay is drawn from
    ``[cap/2, cap]`` where ``cap = min(maximum, initial·2ⁿ)``.

    Not full jitter (``[0, cap]``) on purpose: a full-jitter draw can come out near zero
    again and again, so a fleet of ingesters whose vLLM pod or Redis is down would keep
    hammering it; equal jitter still spreads reconnects over half the window (no
    thundering herd after a Redis restart) while guaranteeing at least ``cap/2`` of rest.
    """

    def __init__(self, initial: float, maximum: float, rng: random.Random | None = None) -> None:
        self.initial = max(initial, 0.001)
        self.maximum = max(maximum, self.initial)
        self._attempt = 0
        self._rng = rng or random.Random()

    def next_delay(self) -> float:
        cap = min(self.maximum, self.initial * (2 ** min(self._attempt, 32)))
        self._attempt += 1
        return self._rng.uniform(cap / 2, cap)

    def reset(self) -> None:
        self._attempt = 0


class StateLog:
    """Logs a component's state only when it changes (e.g. 'connected' → 'down')."""

    def __init__(self, log: logging.Logger, what: str) -> None:
        self._log = log
        self._what = what
        self.state: str | None = None

    def set(self, state: str, detail: str = "", level: int = logging.INFO) -> bool:
        if state == self.state:
            return False
        self._log.log(level, "%s: %s%s", self._what, state, f" ({detail})" if detail else "")
        self.state = state
        return True
