"""The API worker's per-connection limits, one at a time, on the real worker loop in-process.

:class:`services.api.transport.worker.DeadlineWorker` runs here as gunicorn runs it in a
worker process (its ``run`` loop, selector, thread pool), on a loopback listener, configured
by the API's own ``gunicorn_settings`` from :class:`~common.settings.ApiSettings`, serving a
small WSGI app that echoes the body length. The integration tests
(``tests/integration/test_api_slow_clients.py``)
check outcomes with limits close together over a real gunicorn; here each test makes the limit
under test orders of magnitude apart from the others and polls, so a deadline armed from the
wrong limit, or the wrong connection shed, fails instead of passing on the outcome alone.
"""

from __future__ import annotations

import json
import os
import selectors
import socket
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import pytest
from gunicorn.config import Config

from common.settings import ApiSettings
from services.api.transport.deadlines import BUDGET_BODIES
from services.api.gunicorn_conf import gunicorn_settings
from tests.conftest import reserve_port, wait_for

PATH = "/kv-cache/hit-rate"
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
LONG = 300.0
"""Every limit a test is not about: far beyond any test's deadline."""


def _echo(environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
    body = environ["wsgi.input"].read()
    out = json.dumps({"received": len(body)}).encode()
    start_response(
        "200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(out)))]
    )
    return [out]


class InProcessWorker:
    """One API worker (the class and settings ``cache-indexer api`` gives gunicorn) running
    its loop in a thread of the test process; :meth:`stop` ends it as SIGTERM would."""

    def __init__(self, http: ApiSettings) -> None:
        self.port = reserve_port()
        cfg = Config()
        for name, value in gunicorn_settings(
            http, workers=1, bind=f"127.0.0.1:{self.port}"
        ).items():
            if name not in ("on_starting", "child_exit", "worker_exit", "on_exit"):
                cfg.set(name, value)  # the arbiter's hooks: no arbiter here
        cfg.set("graceful_timeout", 1)
        listener = socket.create_server(("127.0.0.1", self.port))
        self.worker = cfg.worker_class(
            1, os.getppid(), [listener], None, 30, cfg, cfg.logger_class(cfg)
        )
        self.worker.wsgi = _echo
        self.worker.tpool = self.worker.get_thread_pool()
        self.worker.poller = selectors.DefaultSelector()
        self.worker.method_queue.init()
        self.thread = threading.Thread(target=self.worker.run, daemon=True)
        self.thread.start()

    def connect(self, first: bytes = b"") -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=30)
        if first:
            sock.sendall(first)
        return sock

    def stop(self) -> None:
        self.worker.handle_exit(None, None)
        self.thread.join(15)
        self.worker.tmp.close()
        assert not self.thread.is_alive(), "the worker loop did not stop"


@pytest.fixture()
def make_worker() -> Iterator[Callable[..., InProcessWorker]]:
    made: list[InProcessWorker] = []

    def make(**http: Any) -> InProcessWorker:
        made.append(InProcessWorker(ApiSettings(**http)))
        return made[-1]

    yield make
    for w in made:
        w.stop()


def _head(content_length: int) -> bytes:
    return (
        f"POST {PATH} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
        f"Content-Length: {content_length}\r\nExpect: 100-continue\r\n\r\n"
    ).encode()


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        assert chunk, f"closed after {data!r}"
        data += chunk
    return data


def _headers_were_read(sock: socket.socket) -> None:
    """``Expect: 100-continue`` is answered once the worker has read the header block: the
    proof that the connection is past its header deadline's reach."""
    assert _recv_exactly(sock, len(CONTINUE)) == CONTINUE


def _answered(sock: socket.socket) -> bytes | None:
    """What the server sent, if anything yet (``b""`` = closed without a word)."""
    sock.setblocking(False)
    try:
        data = sock.recv(65536)
    except BlockingIOError:
        return None
    finally:
        sock.setblocking(True)
    return data


def _read_until_closed(sock: socket.socket) -> bytes:
    sock.settimeout(30)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def _message(response: bytes) -> str:
    return str(json.loads(response.split(b"\r\n\r\n", 1)[1])["message"])


def test_the_header_deadline_closes_a_stalled_header_long_before_the_read_deadline(
    make_worker: Callable[..., InProcessWorker],
) -> None:
    """Issue 21, behaviour 2: ``readHeaderTimeout`` 1 s, ``readTimeout`` 5 min. A client
    stalled in its headers gets the 408 of the header deadline; a client that finished its
    headers earlier and stalls in its body is still open then (its deadline is the read
    timeout), and is served when its body completes."""
    worker = make_worker(
        read_header_timeout=1.0, read_timeout=LONG, write_timeout=LONG, idle_timeout=LONG
    )
    body = b'{"server_ip": ["10.0.0.1"], "body": {"token_ids": [], "block_size": 16}}'
    in_body = worker.connect(_head(len(body)) + body[:10])
    _headers_were_read(in_body)
    in_headers = worker.connect(_head(len(body))[:40])  # the request line and a bit

    got = wait_for(
        lambda: _answered(in_headers),
        timeout=30,
        what="the header deadline to answer the stalled headers",
    )
    assert got.startswith(b"HTTP/1.1 408 ")
    answer = got + _read_until_closed(in_headers)  # and then it is closed
    assert _message(answer) == (
        "the request headers were not received within http.readHeaderTimeout"
    )
    assert _answered(in_body) is None  # its header deadline did not apply after the headers
    in_body.sendall(body[10:])
    served = _recv_response(in_body)
    assert served.startswith(b"HTTP/1.1 200 ") and b'"received": %d' % len(body) in served
    in_body.close()


def test_over_the_buffer_budget_the_largest_unfinished_request_is_shed(
    make_worker: Callable[..., InProcessWorker],
) -> None:
    """Issue 21, behaviour 3: unfinished bodies fill the worker's budget (16 maximum-size
    bodies) to just under it; a small request then pushes it over. One of the largest is
    answered 503 and closed; the small one and a medium one are left alone and are served
    when their bodies complete."""
    cap = 8192
    worker = make_worker(
        max_hit_rate_body_bytes=cap,
        read_header_timeout=LONG,
        read_timeout=LONG,
        write_timeout=LONG,
        idle_timeout=LONG,
    )
    budget = BUDGET_BODIES * cap
    large_sent = len(_head(cap)) + cap - 1  # one byte short of complete
    n_large = 15
    medium_sent = budget - n_large * large_sent - 40  # 40 bytes under the budget in all
    small_body = b" " * 10
    assert len(_head(cap)) < medium_sent < large_sent
    assert len(_head(cap)) + len(small_body) > 40  # the small one tips it over

    large = []
    for _ in range(n_large):
        sock = worker.connect(_head(cap) + b" " * (cap - 1))
        _headers_were_read(sock)
        large.append(sock)
    medium = worker.connect(_head(cap) + b" " * (medium_sent - len(_head(cap))))
    _headers_were_read(medium)
    assert all(_answered(s) is None for s in [*large, medium])  # under the budget: no shed
    small = worker.connect(_head(cap) + small_body)
    _headers_were_read(small)  # read: the budget is crossed now

    def shed() -> list[socket.socket]:
        return [s for s in large if _answered_peek(s)]

    (dropped,) = wait_for(shed, timeout=30, what="a large unfinished request to be shed")
    answer = _read_until_closed(dropped)
    assert answer.startswith(b"HTTP/1.1 503 ")
    assert _message(answer) == "too many unfinished requests are being received; retry"
    assert _answered(medium) is None and _answered(small) is None
    assert len([s for s in large if _answered_peek(s)]) == 1  # only as many as needed
    small.sendall(b" " * (cap - len(small_body)))
    served = _recv_response(small)
    assert served.startswith(b"HTTP/1.1 200 ") and b'"received": %d' % cap in served
    medium.sendall(b" " * (cap - (medium_sent - len(_head(cap)))))
    served = _recv_response(medium)
    assert served.startswith(b"HTTP/1.1 200 ") and b'"received": %d' % cap in served
    for s in [*large, medium, small]:
        s.close()


def _answered_peek(sock: socket.socket) -> bool:
    """True once the server sent something (left unread) or closed the connection."""
    sock.setblocking(False)
    try:
        return sock.recv(1, socket.MSG_PEEK) is not None
    except BlockingIOError:
        return False
    finally:
        sock.setblocking(True)


def _recv_response(sock: socket.socket) -> bytes:
    """One whole response (headers and its Content-Length of body)."""
    sock.settimeout(30)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"closed after {data!r}"
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    while len(rest) < length:
        rest += sock.recv(65536)
    return head + b"\r\n\r\n" + rest
