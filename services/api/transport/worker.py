"""The API's gunicorn worker: gthread, but a request reaches a thread only once it is whole.

Stock ``gthread`` hands a connection to a pool thread as soon as its first bytes arrive; the
thread then blocks reading the rest, with no deadline. A few clients that stall mid-headers
or mid-body therefore hold every thread, and nothing ever closes them. Here the selector
thread (the worker's main loop) reads each request itself, non-blocking, until
:class:`~services.api.transport.request_frame.RequestFrame` says it is complete, and only then
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

A connection past a read deadline with part of a request gets a 408 (its JSON body from
:attr:`DeadlineWorker.error_body`, which the API sets to its own error shape) and is closed;
one that sent nothing, or sat idle, is just closed. Closing after a response lingers in the
selector (half-close, drain at most 64 KiB for 2 s) instead of blocking the loop as stock
gthread does. Bodies larger than ``http.maxHitRateBodyBytes`` are not buffered: the request
is dispatched after its headers (so the app answers 413 without reading it) and the
connection is closed afterwards; and when a worker's unfinished requests hold more than
:attr:`Limits.buffer_budget` bytes, the largest are answered 503 and closed.
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
from typing import Any, ClassVar

from gunicorn import http
from gunicorn.workers.gthread import ThreadWorker

from services.api.transport.connection import CLOSED, HANDLING, IDLE, LINGERING, READING, Conn
from services.api.transport.deadlines import (
    ErrorBody,
    Limits,
    busy_response,
    plain_error_body,
    timeout_response,
)
from services.api.transport.request_frame import RequestFrame

logger = logging.getLogger(__name__)

_RECV = 256 * 1024
_LINGER_SECONDS = 2.0
_LINGER_BYTES = 64 * 1024
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


class DeadlineWorker(ThreadWorker):  # type: ignore[misc]
    """gthread with whole-request reads in the selector thread (see the module docstring)."""

    limits: ClassVar[Limits] = Limits()
    error_body: ClassVar[ErrorBody] = staticmethod(plain_error_body)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        cfg = self.cfg
        self.header_cap = (
            cfg.limit_request_line
            + 4
            + cfg.limit_request_fields * (cfg.limit_request_field_size + 2)
        )
        self._heap: list[tuple[float, int, Conn]] = []
        self._tokens = itertools.count(1)
        self._reading: set[Conn] = set()
        self._buffered = 0  # bytes held by the connections in _reading

    # --- selector thread: reading requests -------------------------------------------

    def accept(self, listener: socket.socket) -> None:
        try:
            sock, addr = listener.accept()
        except OSError as exc:
            if exc.errno not in (errno.EAGAIN, errno.ECONNABORTED, errno.EWOULDBLOCK):
                raise
            return
        self.nr_conns += 1
        conn = Conn(self.cfg, sock, addr, listener.getsockname())
        conn.idle_timeout = self.limits.idle_timeout
        self._start_reading(conn, b"")

    def on_client_socket_readable(self, conn: Conn, client: Any) -> None:
        self._unregister(conn)
        self.keepalived_conns.remove(conn)
        self._start_reading(conn, b"")

    def _start_reading(self, conn: Conn, leftover: bytes) -> None:
        now, limits = time.monotonic(), self.limits
        conn.raw.setblocking(False)  # a pool thread left it blocking with a timeout
        conn.state, conn.buf = READING, bytearray(leftover)
        conn.frame, conn.headers_handled = RequestFrame(self.header_cap, limits.body_cap), False
        conn.sock.read_deadline = now + limits.read_timeout
        conn.sock.write_deadline = math.inf
        self._reading.add(conn)
        self._buffered += len(conn.buf)
        self._arm(conn, min(now + limits.header_timeout, conn.sock.read_deadline))
        self._read(conn)

    def _read(self, conn: Conn) -> None:
        try:  # one read per event: a fast sender must not keep the loop to itself
            data = conn.raw.recv(_RECV)
            if not data:
                self._drop(conn, "closed by the client" if conn.buf else "")
                return
            conn.buf += data
            self._buffered += len(data)
        except (BlockingIOError, InterruptedError):
            pass
        except OSError as exc:
            self._drop(conn, f"read failed: {exc}")
            return
        frame = conn.frame
        assert frame is not None
        complete = frame.feed(conn.buf)
        if (frame.headers_done or complete) and not conn.headers_handled:
            self._headers_read(conn, frame, complete)
        if complete:
            self._dispatch(conn)
        elif not conn.registered:
            self._register(conn, self._read)
        if self._buffered > self.limits.buffer_budget:
            self._shed()

    def _headers_read(self, conn: Conn, frame: RequestFrame, complete: bool) -> None:
        conn.headers_handled = True
        conn.sock.write_deadline = time.monotonic() + self.limits.write_timeout
        self._arm(conn, conn.sock.read_deadline)
        if frame.expect_continue and not complete:
            try:
                conn.raw.send(_CONTINUE)
            except OSError:
                pass  # the read that follows sees the broken connection

    def _dispatch(self, conn: Conn) -> None:
        self._unregister(conn)
        self._stop_reading(conn)
        conn.state, conn.token = HANDLING, next(self._tokens)
        conn.body_buffered = conn.frame.body_buffered if conn.frame else True
        self.enqueue_req(conn)

    def _timed_out(self, conn: Conn) -> None:
        if not conn.buf:
            self._drop(conn, "")
            return
        frame = conn.frame
        done = bool(frame and frame.headers_done)
        logger.debug("closing %s: the request did not arrive in time", conn.client)
        self._answer_and_close(
            conn, timeout_response(frame.path if frame else "", done, type(self).error_body)
        )

    def _shed(self) -> None:
        """Over the buffer budget: drop the unfinished requests holding the most bytes."""
        while self._buffered > self.limits.buffer_budget and self._reading:
            conn = max(self._reading, key=lambda c: len(c.buf))
            logger.info(
                "dropping an unfinished request of %d bytes from %s: %d bytes of "
                "unfinished requests are buffered",
                len(conn.buf),
                conn.client,
                self._buffered,
            )
            self._answer_and_close(
                conn, busy_response(conn.frame.path if conn.frame else "", type(self).error_body)
            )

    def _answer_and_close(self, conn: Conn, response: bytes) -> None:
        try:
            conn.raw.send(response)
        except OSError:
            pass
        self._linger(conn)

    def _stop_reading(self, conn: Conn) -> None:
        if conn in self._reading:
            self._reading.discard(conn)
            self._buffered -= len(conn.buf)

    # --- selector thread: after the response, closing, deadlines --------------------

    def finish_request(self, conn: Conn, fs: Future[Any]) -> None:
        try:
            keep = bool(fs.result()) if not fs.cancelled() else False
        except Exception:  # handle() catches everything; this is gunicorn's own guard
            keep = False
        if not keep or conn.state != HANDLING:
            self._linger(conn)
            return
        leftover = conn.parser.unreader.take_buffered()
        if leftover:  # the client pipelined its next request
            self._start_reading(conn, leftover)
            return
        conn.raw.setblocking(False)
        conn.state = IDLE
        conn.set_timeout()
        if not self.alive:
            conn.timeout = min(conn.timeout, time.monotonic() + _LINGER_SECONDS)
        self.keepalived_conns.append(conn)
        self._register(conn, lambda c: self.on_client_socket_readable(c, c.sock))

    def _linger(self, conn: Conn) -> None:
        """Half-close and drain a little, so the kernel does not reset the last response."""
        self._stop_reading(conn)
        try:
            conn.raw.setblocking(False)
            conn.raw.shutdown(socket.SHUT_WR)
        except OSError:
            self._close(conn)
            return
        conn.state, conn.buf, conn.drained = LINGERING, bytearray(), 0
        self._arm(conn, time.monotonic() + _LINGER_SECONDS)
        self._register(conn, self._drain)

    def _drain(self, conn: Conn) -> None:
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

    def _drop(self, conn: Conn, why: str) -> None:
        if why:
            logger.debug("closing %s: %s", conn.client, why)
        self._stop_reading(conn)
        self._close(conn)

    def _close(self, conn: Conn) -> None:
        if conn.state == CLOSED:
            return
        self._unregister(conn)
        conn.state, conn.token = CLOSED, next(self._tokens)
        conn.buf = bytearray()
        self.nr_conns -= 1
        try:
            conn.raw.close()
        except OSError:
            pass

    def _arm(self, conn: Conn, deadline: float) -> None:
        """Make ``deadline`` the connection's only live one (older heap entries go stale)."""
        conn.token = next(self._tokens)
        if deadline != math.inf:
            heapq.heappush(self._heap, (deadline, conn.token, conn))
        if len(self._heap) > 4 * self.nr_conns + 1024:  # stale entries keep closed conns alive
            self._heap = [entry for entry in self._heap if entry[1] == entry[2].token]
            heapq.heapify(self._heap)

    def _register(self, conn: Conn, callback: Callable[[Conn], None]) -> None:
        def on_event(_fileobj: Any) -> None:
            callback(conn)

        if conn.registered:
            self.poller.modify(conn.sock, selectors.EVENT_READ, on_event)
        else:
            self.poller.register(conn.sock, selectors.EVENT_READ, on_event)
            conn.registered = True

    def _unregister(self, conn: Conn) -> None:
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
            if conn.state == READING:
                self._timed_out(conn)
            elif conn.state == LINGERING:
                self._close(conn)
        if not self.alive:  # stopping: nobody is waiting for an answer on these
            for conn in [c for c in self._reading if not c.buf]:
                self._drop(conn, "")

    def murder_keepalived(self, force: bool = False) -> None:
        now = time.monotonic()
        while self.keepalived_conns and (force or self.keepalived_conns[0].timeout <= now):
            self._close(self.keepalived_conns.popleft())

    # --- pool threads --------------------------------------------------------------

    def handle(self, conn: Conn) -> bool:
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

    def _keepalive_after(self, conn: Conn, keepalive: bool) -> bool:
        if not conn.body_buffered:  # an unread oversized body: no reuse, no draining
            return False
        return bool(super()._keepalive_after(conn, keepalive))
