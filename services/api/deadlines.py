"""The API worker's per-connection limits (the original's Go ``http.Server`` keys) and the
answers it sends on its own when a limit is hit (408, 503), in the API's JSON error shape."""

from __future__ import annotations

import math
from dataclasses import dataclass

from services.api import hit_rate

BUDGET_BODIES = 16
"""A worker buffers at most this many maximum-size bodies' worth of unfinished requests."""


@dataclass(frozen=True)
class Limits:
    """Seconds (``math.inf`` = none) and byte caps of the API worker."""

    header_timeout: float = 10.0
    read_timeout: float = 30.0
    write_timeout: float = 30.0
    idle_timeout: float = 120.0
    body_cap: int = 4194304

    @property
    def buffer_budget(self) -> int:
        """Bytes of unfinished requests one worker holds before it sheds the largest."""
        return BUDGET_BODIES * self.body_cap

    @classmethod
    def from_go(
        cls, read_header: float, read: float, write: float, idle: float, body_cap: int
    ) -> Limits:
        """Go's rules for zero: no read timeout; header and idle fall back to ``read``."""

        def none_if_zero(value: float) -> float:
            return value if value > 0 else math.inf

        return cls(
            none_if_zero(read_header or read),
            none_if_zero(read),
            none_if_zero(write),
            none_if_zero(idle or read),
            body_cap,
        )


def timeout_response(path: str, headers_done: bool) -> bytes:
    """The 408 for a request that did not arrive in time."""
    message = (
        "the request was not received within http.readTimeout"
        if headers_done
        else "the request headers were not received within http.readHeaderTimeout"
    )
    return _response(path, 408, "Request Timeout", message)


def busy_response(path: str) -> bytes:
    """The 503 for a request dropped because too many unfinished requests are buffered."""
    return _response(
        path, 503, "Service Unavailable", "too many unfinished requests are being received; retry"
    )


def _response(path: str, status: int, reason: str, message: str) -> bytes:
    body = hit_rate.error_body(path, status, message)
    head = (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body
