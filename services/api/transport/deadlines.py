"""The worker's per-connection limits (the original's Go ``http.Server`` keys) and the
answers it sends on its own when a limit is hit (408, 503). Their JSON body comes from the
application (:data:`ErrorBody`, set on the worker class), so a 408 on the hit-rate path has
the same shape as the app's own errors there (see the package docstring)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeAlias

from common.config import HTTP

ErrorBody: TypeAlias = Callable[[str, int, str], bytes]
"""``(path, status, message) -> JSON body`` of an error answer."""

BUDGET_BODIES = 16
"""A worker buffers at most this many maximum-size bodies' worth of unfinished requests."""


@dataclass(frozen=True)
class Limits:
    """Seconds (``math.inf`` = none) and byte caps of the API worker."""

    header_timeout: float = float(HTTP().read_header_timeout)
    read_timeout: float = float(HTTP().read_timeout)
    write_timeout: float = float(HTTP().write_timeout)
    idle_timeout: float = float(HTTP().idle_timeout)
    body_cap: int = HTTP().max_hit_rate_body_bytes

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


def plain_error_body(path: str, status: int, message: str) -> bytes:
    """``{"message", "status"}``: the body when the application sets none."""
    return json.dumps({"message": message, "status": status}).encode()


def timeout_response(path: str, headers_done: bool, error_body: ErrorBody) -> bytes:
    """The 408 for a request that did not arrive in time."""
    message = (
        "the request was not received within http.readTimeout"
        if headers_done
        else "the request headers were not received within http.readHeaderTimeout"
    )
    return _response(error_body(path, 408, message), 408, "Request Timeout")


def busy_response(path: str, error_body: ErrorBody) -> bytes:
    """The 503 for a request dropped because too many unfinished requests are buffered."""
    message = "too many unfinished requests are being received; retry"
    return _response(error_body(path, 503, message), 503, "Service Unavailable")


def _response(body: bytes, status: int, reason: str) -> bytes:
    head = (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body
