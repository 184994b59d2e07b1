"""The API's gunicorn worker: gthread, but a request reaches a thread only once it is whole.

Stock ``gthread`` hands a connection to a pool thread as soon as its first bytes arrive; the
thread then blocks reading the rest, with no deadline. A few clients that stall mid-headers
or mid-body therefore hold every thread, and nothing ever closes them. Here the selector
thread (the worker's main loop) reads each request itself, non-blocking, until
:class:`~services.api.request_frame.RequestFrame` says it is complete, and only then
submits it to the pool, where gunicorn's parser reads it from memory. A stalled connection
costs a socket and its buffered bytes, never a thread.

Deadlines, as Go's ``http.Server`` applies the original's keys (:class:`Limits`):

- ``readHeaderTimeout`` — from accept (or from the first byte of a kept-alive
  connection's next request) to the end of the header block;
- ``readTimeout`` — from the same start to the end of the body;
- ``writeTimeout`` — from the end of the headers to the end of the response: every
  blocking write of the pool thread is bounded by it (:class:`DeadlineSocket`); past it the
  connection is closed;
- ``idleTimeout`` — a kept-alive connection waiting for its next request.

A connection past a read deadline with part of a request gets a 408 (JSON, in the
contract's shape on the hit-rate path) and is closed; one that sent nothing, or sat idle,
is just closed. Closing after a response lingers in the selector (half-close, drain at
most 64 KiB for 2 s) instead of blocking the loop as stock gthread does. Bodies larger than
``http.maxHitRateBodyBytes`` are not buffered: the request is dispatched after its headers
(so the app answers 413 without reading it) and the connection is closed afterwards.
"""

from __future__ import annotations

import errno
import heapq
import itertools
import logging
import math
import selectors
import socket
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, ClassVar

import orjson
from gunicorn import http
from gunicorn.workers.gthread import ThreadWorker, TConn

from services.api import hit_rate
from services.api.deadline_socket import DeadlineSocket
from services.api.request_frame import RequestFrame

logger = logging.getLogger(__name__)

_RECV = 256 * 1024
_LINGER_SECONDS = 2.0
_LINGER_BYTES = 64 * 1024
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_READING, _HANDLING, _IDLE, _LINGERING, _CLOSED = range(5)


@dataclass(frozen=True)
class Limits:
    """Per-connection limits in seconds (``math.inf`` = none) and the body buffer cap."""

    header_timeout: float = 10.0
    read_timeout: float = 30.0
    write_timeout: float = 30.0
    idle_timeout: float = 120.0
    body_cap: int = 4194304

    @classmethod
    def from_go(cls, read_header: float, read: float, write: float, idle: float,
                body_cap: int) -> Limits:
        """Go's rules for zero: no read timeout; header and idle fall back to ``read``."""
        def none_if_zero(value: float) -> float:
            return value if value > 0 else math.inf
        return cls(none_if_zero(read_header or read), none_if_zero(read),
                   none_if_zero(write), none_if_zero(idle or read), body_cap)


class _Conn(TConn):  # type: ignore[misc]
    def __init__(self, cfg: Any, sock: socket.socket, client: Any, server: Any) -> None:
        self.raw = sock
        super().__init__(cfg, DeadlineSocket(sock), client, server)
        sock.setblocking(False)
        self.state = _READING
        self.token = 0  # the deadline-heap entry that is current for this connection
        self.registered = False
        self.buf = bytearray()
        self.frame: RequestFrame | None = None
        self.header_deadline = math.inf
        self.idle_timeout = math.inf
        self.body_buffered = True
        self.drained = 0

    def set_timeout(self) -> None:  # keep-alive: gunicorn's own idle check reads .timeout
        self.timeout = time.monotonic() + self.idle_timeout


class DeadlineWorker(ThreadWorker):  # type: ignore[misc]
    """gthread with whole-request reads in the selector thread (see the module docstring)."""

    limits: ClassVar[Limits] = Limits()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        cfg = self.cfg
        self.header_cap = (cfg.limit_request_line + 4
                           + cfg.limit_request_fields * (cfg.limit_request_field_size + 2))
        self._heap: list[tuple[float, int, _Conn]] = []
        self._tokens = itertools.count(1)
        self._reading: set[_Conn] = set()

    # --- selector thread: reading requests -------------------------------------------

    def accept(self, listener: socket.socket) -> None:
        try:
            sock, addr = listener.accept()
        except OSError as exc:
            if exc.errno not in (errno.EAGAIN, errno.ECONNABORTED, errno.EWOULDBLOCK):
                raise
            return
        self.nr_conns += 1
        conn = _Conn(self.cfg, sock, addr, listener.getsockname())
        conn.idle_timeout = self.limits.idle_timeout
        self._start_reading(conn, b"")

    def on_client_socket_readable(self, conn: _Conn, client: Any) -> None:
        self._unregister(conn)
        self.keepalived_conns.remove(conn)
        self._start_reading(conn, b"")

    def _start_reading(self, conn: _Conn, leftover: bytes) -> None:
        now, limits = time.monotonic(), self.limits
        conn.raw.setblocking(False)  # a pool thread left it blocking with a timeout
        conn.state, conn.buf = _READING, bytearray(leftover)
        conn.frame = RequestFrame(self.header_cap, limits.body_cap)
        conn.header_deadline = now + limits.header_timeout
        conn.sock.read_deadline = now + limits.read_timeout
        conn.sock.write_deadline = math.inf
        self._reading.add(conn)
        self._arm(conn, min(conn.header_deadline, conn.sock.read_deadline))
        self._read(conn)

    def _read(self, conn: _Conn) -> None:
        try:  # one read per event: a fast sender must not keep the loop to itself
            data = conn.raw.recv(_RECV)
            if not data:
                self._drop(conn, "closed by the client" if conn.buf else "")
                return
            conn.buf += data
        except (BlockingIOError, InterruptedError):
            pass
        except OSError as exc:
            self._drop(conn, f"read failed: {exc}")
            return
        frame = conn.frame
        assert frame is not None
        complete = frame.feed(conn.buf)
        if (frame.headers_done or complete) and conn.sock.write_deadline == math.inf:
            self._headers_read(conn, frame, complete)
        if complete:
            self._dispatch(conn)
        elif not conn.registered:
            self._register(conn, self._read)

    def _headers_read(self, conn: _Conn, frame: RequestFrame, complete: bool) -> None:
        conn.sock.write_deadline = time.monotonic() + self.limits.write_timeout
        conn.header_deadline = math.inf
        self._arm(conn, conn.sock.read_deadline)
        if frame.expect_continue and not complete:
            try:
                conn.raw.send(_CONTINUE)
            except OSError:
                pass  # the read that follows sees the broken connection

    def _dispatch(self, conn: _Conn) -> None:
        self._unregister(conn)
        self._reading.discard(conn)
        conn.state, conn.token = _HANDLING, next(self._tokens)
        conn.body_buffered = conn.frame.body_buffered if conn.frame else True
        self.enqueue_req(conn)

    def _timed_out(self, conn: _Conn) -> None:
        which = "headers" if conn.header_deadline <= time.monotonic() else "request"
        if not conn.buf:
            self._drop(conn, "")
            return
        logger.debug("closing %s: the %s did not arrive in time", conn.client, which)
        frame = conn.frame
        path = frame.path if frame else ""
        try:
            conn.raw.send(_timeout_response(path, which))
        except OSError:
            pass
        self._linger(conn)

    # --- selector thread: after the response, closing, deadlines --------------------

    def finish_request(self, conn: _Conn, fs: Future[Any]) -> None:
        try:
            keep = bool(fs.result()) if not fs.cancelled() else False
        except Exception:  # handle() catches everything; this is gunicorn's own guard
            keep = False
        if not keep or conn.state != _HANDLING:
            self._linger(conn)
            return
        leftover = conn.parser.unreader.take_buffered()
        if leftover:  # the client pipelined its next request
            self._start_reading(conn, leftover)
            return
        conn.raw.setblocking(False)
        conn.state = _IDLE
        conn.set_timeout()
        if not self.alive:
            conn.timeout = min(conn.timeout, time.monotonic() + _LINGER_SECONDS)
        self.keepalived_conns.append(conn)
        self._register(conn, lambda c: self.on_client_socket_readable(c, c.sock))

    def _linger(self, conn: _Conn) -> None:
        """Half-close and drain a little, so the kernel does not reset the last response."""
        self._reading.discard(conn)
        try:
            conn.raw.setblocking(False)
            conn.raw.shutdown(socket.SHUT_WR)
        except OSError:
            self._close(conn)
            return
        conn.state, conn.buf, conn.drained = _LINGERING, bytearray(), 0
        self._arm(conn, time.monotonic() + _LINGER_SECONDS)
        self._register(conn, self._drain)

    def _drain(self, conn: _Conn) -> None:
        try:
            while conn.drained < _LINGER_BYTES:
                data = conn.raw.recv(_RECV)
                if not data:
                    break
                conn.drained += len(data)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            pass
        self._close(conn)

    def _drop(self, conn: _Conn, why: str) -> None:
        if why:
            logger.debug("closing %s: %s", conn.client, why)
        self._reading.discard(conn)
        self._close(conn)

    def _close(self, conn: _Conn) -> None:
        if conn.state == _CLOSED:
            return
        self._unregister(conn)
        conn.state, conn.token = _CLOSED, next(self._tokens)
        conn.buf = bytearray()
        self.nr_conns -= 1
        try:
            conn.raw.close()
        except OSError:
            pass

    def _arm(self, conn: _Conn, deadline: float) -> None:
        conn.token = next(self._tokens)
        if deadline != math.inf:
            heapq.heappush(self._heap, (deadline, conn.token, conn))

    def _register(self, conn: _Conn, callback: Callable[[_Conn], None]) -> None:
        def on_event(_fileobj: Any) -> None:
            callback(conn)
        if conn.registered:
            self.poller.modify(conn.sock, selectors.EVENT_READ, on_event)
        else:
            self.poller.register(conn.sock, selectors.EVENT_READ, on_event)
            conn.registered = True

    def _unregister(self, conn: _Conn) -> None:
        if conn.registered:
            conn.registered = False
            try:
                self.poller.unregister(conn.sock)
            except (KeyError, ValueError, OSError):
                pass

    def wait_for_and_dispatch_events(self, timeout: float) -> None:
        if self._heap:
            timeout = min(timeout, max(0.0, self._heap[0][0] - time.monotonic()))
        super().wait_for_and_dispatch_events(timeout)

    def murder_pending(self) -> None:
        """Called by gunicorn's loop after every wait: expire our deadlines."""
        now = time.monotonic()
        while self._heap and self._heap[0][0] <= now:
            _, token, conn = heapq.heappop(self._heap)
            if token != conn.token:
                continue
            if conn.state == _READING:
                self._timed_out(conn)
            elif conn.state == _LINGERING:
                self._close(conn)
        if not self.alive:  # stopping: nobody is waiting for an answer on these
            for conn in [c for c in self._reading if not c.buf]:
                self._drop(conn, "")

    def murder_keepalived(self, force: bool = False) -> None:
        now = time.monotonic()
        while self.keepalived_conns and (force or self.keepalived_conns[0].timeout <= now):
            self._close(self.keepalived_conns.popleft())

    # --- pool threads --------------------------------------------------------------

    def handle(self, conn: _Conn) -> bool:
        """Serve one request that is already in memory; every socket wait is bounded."""
        req = None
        try:
            conn.sock.setblocking(True)
            conn.init()
            conn.parser.unreader.unread(bytes(conn.buf))
            conn.buf = bytearray()
            req = next(conn.parser)
            if not req:
                return False
            req._expected_100_continue = False  # sent already, or the body will be refused
            return bool(self._keepalive_after(conn, self.handle_request(req, conn)))
        except (http.errors.NoMoreData, StopIteration) as exc:
            self.log.debug("closing connection: %s", exc)
        except TimeoutError:
            self.log.debug("closing %s: its deadline passed", conn.client)
        except OSError as exc:
            if exc.errno in (errno.EPIPE, errno.ECONNRESET, errno.ENOTCONN):
                self.log.debug("client %s went away: %s", conn.client, exc)
            else:
                self.log.exception("socket error serving a request")
        except Exception as exc:
            self.handle_error(req, conn.sock, conn.client, exc)
        return False

    def _keepalive_after(self, conn: _Conn, keepalive: bool) -> bool:
        if not conn.body_buffered:  # an unread oversized body: no reuse, no draining
            return False
        return bool(super()._keepalive_after(conn, keepalive))


def _timeout_response(path: str, which: str) -> bytes:
    message = ("the request headers were not received within http.readHeaderTimeout"
               if which == "headers" else "the request was not received within http.readTimeout")
    body = (hit_rate.error_document(408, message) if path == hit_rate.PATH
            else orjson.dumps({"message": message, "status": 408}))
    head = (f"HTTP/1.1 408 Request Timeout\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n")
    return head.encode() + body
