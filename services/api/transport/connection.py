"""One client connection of the API worker: its state, and a socket whose blocking reads and
writes end by a deadline (Go's ``SetDeadline``).

gunicorn's request parser, body reader and response writer call ``recv``/``send``/
``sendall`` on the socket they were given and set it blocking first. Handing them a
:class:`DeadlineSocket` instead bounds every such call by the connection's current read or
write deadline (the earlier of that and any timeout the caller set itself), so a pool
thread can never wait on a slow client past ``http.readTimeout`` / ``http.writeTimeout``.
A call that starts past its deadline raises :class:`TimeoutError` at once.
"""

from __future__ import annotations

import math
import socket
import time
from typing import Any

from gunicorn.workers.gthread import TConn

from services.api.transport.request_frame import RequestFrame

READING, HANDLING, IDLE, LINGERING, CLOSED = range(5)  # Conn.state


class DeadlineSocket:
    """Wraps one accepted socket; everything but the I/O calls is passed through."""

    def __init__(self, sock: socket.socket) -> None:
        self.raw = sock
        self.read_deadline = math.inf
        self.write_deadline = math.inf
        self._timeout: float | None = None  # what the caller asked for: None = blocking

    def __getattr__(self, name: str) -> Any:
        return getattr(self.raw, name)

    def fileno(self) -> int:
        return self.raw.fileno()

    def setblocking(self, flag: bool) -> None:
        self._timeout = None if flag else 0.0

    def settimeout(self, value: float | None) -> None:
        self._timeout = value

    def gettimeout(self) -> float | None:
        return self._timeout

    def _bound(self, deadline: float) -> None:
        timeout = self._timeout
        if timeout != 0.0 and deadline != math.inf:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("the connection's deadline has passed")
            timeout = remaining if timeout is None else min(timeout, remaining)
        self.raw.settimeout(timeout)

    def recv(self, size: int, flags: int = 0) -> bytes:
        self._bound(self.read_deadline)
        return self.raw.recv(size, flags)

    def send(self, data: bytes, flags: int = 0) -> int:
        self._bound(self.write_deadline)
        return self.raw.send(data, flags)

    def sendall(self, data: bytes, flags: int = 0) -> None:
        self._bound(self.write_deadline)  # Python bounds the whole sendall by the timeout
        self.raw.sendall(data, flags)


class Conn(TConn):  # type: ignore[misc]
    """gunicorn's connection plus what the worker tracks while it reads, answers, closes."""

    def __init__(self, cfg: Any, sock: socket.socket, client: Any, server: Any) -> None:
        self.raw = sock
        super().__init__(cfg, DeadlineSocket(sock), client, server)
        sock.setblocking(False)
        self.state = READING
        self.token = 0  # the deadline-heap entry that is current for this connection
        self.registered = False
        self.buf = bytearray()
        self.frame: RequestFrame | None = None
        self.headers_handled = False  # write deadline armed, 100 Continue sent (once)
        self.idle_timeout = math.inf
        self.body_buffered = True
        self.drained = 0

    def set_timeout(self) -> None:  # keep-alive: gunicorn's own idle check reads .timeout
        self.timeout = time.monotonic() + self.idle_timeout
