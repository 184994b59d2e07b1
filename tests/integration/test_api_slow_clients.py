"""Slow, stalled and vanishing clients against the real ``cache-indexer api`` (gunicorn).

Stalled connections must hold no thread (normal requests are still answered), and every
read, write and idle deadline of the original's ``http.*`` keys must close them: a 408 when
part of a request arrived, a plain close otherwise. Nothing here measures time; each test
polls for the outcome with a generous deadline.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest

from tests.conftest import RedisServer, wait_for
from tests.integration.test_api_gunicorn import LIMIT, MAX_CANDIDATES, PATH, Api

BODY = orjson.dumps(
    {
        "server_ip": ["10.3.0.1", "10.3.0.2"],
        "body": {"token_ids": list(range(300)), "block_size": 128},
    }
)
HEAD = (
    f"POST {PATH} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
    f"Content-Length: {len(BODY)}\r\n\r\n"
).encode()
FAST = "  readHeaderTimeout: 1s\n  readTimeout: 2s\n  writeTimeout: 2s\n  idleTimeout: 1s\n"


@pytest.fixture(scope="module")
def fast_api(redis_srv: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Api]:
    """Short deadlines; debug logs so a test can see the write deadline fire."""
    server = Api(tmp_path_factory.mktemp("fast"), redis_srv.url, FAST, log_level="debug")
    yield server
    server.stop()


def _connect(api: Api, first: bytes = b"") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", api.port), timeout=30)
    if first:
        sock.sendall(first)
    return sock


def _read_until_closed(sock: socket.socket, timeout: float = 30) -> bytes:
    """Everything the server sends until it closes; fails if it never does."""
    sock.settimeout(timeout)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data


def _normal_request(client: httpx.Client, api: Api) -> None:
    resp = client.post(
        f"{api.url}{PATH}", content=BODY, headers={"Content-Type": "application/json"}
    )
    assert resp.status_code == 200 and resp.json()["status"] == 0


def test_hundreds_of_stalled_connections_hold_no_thread(
    redis_srv: RedisServer, tmp_path: Path
) -> None:
    # Deadlines far longer than the test: the stalled connections stay open throughout.
    api = Api(tmp_path, redis_srv.url, "  readHeaderTimeout: 5m\n  readTimeout: 5m\n")
    stalled = []
    try:
        for i in range(150):  # 2 workers x 4 threads: 8 stalled connections sufficed before
            stalled.append(_connect(api, HEAD[: 20 + i % 30]))  # mid-headers
            stalled.append(_connect(api, HEAD + BODY[: 1 + i]))  # mid-body
            stalled.append(_connect(api))  # nothing at all
        with httpx.Client(timeout=10) as keep_alive:
            for _ in range(40):
                _normal_request(keep_alive, api)
                with httpx.Client(timeout=10) as fresh:  # a new connection each time
                    _normal_request(fresh, api)
        for sock in stalled[:30]:  # still waiting for their requests, not answered
            sock.setblocking(False)
            with pytest.raises(BlockingIOError):
                sock.recv(1)
    finally:
        for sock in stalled:
            sock.close()
        api.stop()


def test_stalled_headers_get_408_and_are_closed(fast_api: Api) -> None:
    data = _read_until_closed(_connect(fast_api, HEAD[:45]))  # the request line and a bit
    assert data.startswith(b"HTTP/1.1 408 ")
    assert orjson.loads(data.split(b"\r\n\r\n", 1)[1]) == {
        "server_score_list": [],
        "status": 408,
        "message": "the request headers were not received within http.readHeaderTimeout",
    }


def test_stalled_body_gets_408_and_is_closed(fast_api: Api) -> None:
    data = _read_until_closed(_connect(fast_api, HEAD + BODY[:10]))
    assert data.startswith(b"HTTP/1.1 408 ")
    assert orjson.loads(data.split(b"\r\n\r\n", 1)[1])["message"] == (
        "the request was not received within http.readTimeout"
    )


def test_trickling_headers_still_hit_the_header_deadline(fast_api: Api) -> None:
    """A deadline for the whole header block, not a timeout per read: a byte every 100 ms
    keeps the connection busy but never completes the headers in time."""
    sock = _connect(fast_api)
    sock.settimeout(0.1)
    request = b"GET /healthz HTTP/1.1\r\nX-Slow: " + b"a" * 4000
    answer = b""
    deadline = time.monotonic() + 30
    for byte in request:
        assert time.monotonic() < deadline, "the trickling connection was never cut off"
        try:
            sock.sendall(bytes([byte]))
            answer = sock.recv(65536)
        except TimeoutError:
            continue
        except (BrokenPipeError, ConnectionResetError):
            break
        if answer:
            break
    assert answer.startswith(b"HTTP/1.1 408 "), "the headers never completed, yet no 408"


def test_a_connection_that_sends_nothing_is_closed_silently(fast_api: Api) -> None:
    assert _read_until_closed(_connect(fast_api)) == b""


def test_idle_keep_alive_connection_is_closed(fast_api: Api) -> None:
    sock = _connect(fast_api, b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n")
    data = _read_until_closed(sock)
    assert data.startswith(b"HTTP/1.1 200 ") and data.count(b"HTTP/1.1") == 1


def test_slow_but_timely_request_and_pipelining_are_served(fast_api: Api) -> None:
    sock = _connect(fast_api, HEAD)
    sock.settimeout(0.2)
    with pytest.raises(TimeoutError):  # nothing is answered before the body is complete
        sock.recv(1)
    sock.sendall(BODY + b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n" + HEAD + BODY)
    data = _read_until_closed(sock)  # three answers, then the idle deadline closes it
    assert data.count(b"HTTP/1.1 200 OK") == 3


def test_a_client_that_does_not_read_is_cut_off_by_the_write_deadline(fast_api: Api) -> None:
    big = orjson.dumps(
        {
            "server_ip": [f"10.4.0.{i}" for i in range(MAX_CANDIDATES)] * 400,
            "body": {"token_ids": [], "block_size": 128},
        }
    )
    request = (
        f"POST {PATH} HTTP/1.1\r\nHost: t\r\nContent-Length: {len(big)}\r\n\r\n".encode() + big
    )
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", fast_api.port))
    stop = threading.Event()

    def send_forever() -> None:  # pipelined requests whose answers are never read
        sock.settimeout(1)
        while not stop.is_set():
            try:
                sock.sendall(request)
            except TimeoutError:
                continue
            except OSError:
                return

    sender = threading.Thread(target=send_forever, daemon=True)
    sender.start()
    try:
        wait_for(
            lambda: b"its deadline passed" in fast_api.log_path.read_bytes(),
            timeout=60,
            what="the write deadline to cut off the connection",
        )
        with httpx.Client(timeout=10) as client:  # the thread it held is free again
            _normal_request(client, fast_api)
    finally:
        stop.set()
        sender.join(10)
        sock.close()


def test_clients_that_vanish_leave_no_error_in_the_log(
    redis_srv: RedisServer, tmp_path: Path
) -> None:
    api = Api(tmp_path, redis_srv.url)
    try:
        big = orjson.dumps(
            {"server_ip": ["10.5.0.1"] * 20000, "body": {"token_ids": [], "block_size": 128}}
        )
        for reset in (False, True):
            for first in (
                HEAD[:25],
                HEAD + BODY[:7],
                f"POST {PATH} HTTP/1.1\r\nContent-Length: {len(big)}\r\n\r\n".encode() + big,
            ):
                sock = _connect(api, first)
                if reset:  # an RST instead of a FIN
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\0\0\0\0\0\0\0")
                sock.close()
        with httpx.Client(timeout=10) as client:
            _normal_request(client, api)
            assert client.get(f"{api.url}/healthz").status_code == 200
    finally:
        api.stop()
    log = api.log_path.read_text()
    for marker in ("Traceback", "ERROR", "WARNING", "Error", "exception"):
        assert marker not in log, log


def test_unfinished_bodies_past_the_buffer_budget_are_shed(fast_api: Api) -> None:
    """Each worker buffers at most 16 maximum-size bodies of unfinished requests (1 MiB
    here); past that the largest are answered 503 and closed, the rest time out (408)."""
    head = f"POST {PATH} HTTP/1.1\r\nHost: t\r\nContent-Length: {LIMIT}\r\n\r\n".encode()
    socks = [_connect(fast_api, head + b" " * (LIMIT - 100)) for _ in range(60)]
    try:
        with httpx.Client(timeout=10) as client:
            _normal_request(client, fast_api)
        statuses = [_read_until_closed(sock)[:12] for sock in socks]
    finally:
        for sock in socks:
            sock.close()
    assert set(statuses) <= {b"HTTP/1.1 503", b"HTTP/1.1 408"}, set(statuses)
    assert b"HTTP/1.1 503" in statuses


def test_chunked_body_after_100_continue_is_served(fast_api: Api) -> None:
    sock = _connect(
        fast_api,
        (
            f"POST {PATH} HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked"
            "\r\nExpect: 100-continue\r\n\r\n"
        ).encode(),
    )
    sock.settimeout(30)
    assert sock.recv(1024) == b"HTTP/1.1 100 Continue\r\n\r\n"
    half = len(BODY) // 2
    for part in (BODY[:half], BODY[half:]):
        sock.sendall(b"%x\r\n%b\r\n" % (len(part), part))
    sock.sendall(b"0\r\n\r\n")
    data = _read_until_closed(sock)  # the answer, then the idle deadline closes it
    assert data.startswith(b"HTTP/1.1 200 ") and data.count(b"HTTP/1.1 100") == 0
    assert orjson.loads(data.split(b"\r\n\r\n", 1)[1])["status"] == 0


def test_no_write_deadline_still_sends_one_100_continue(
    redis_srv: RedisServer, tmp_path: Path
) -> None:
    """``writeTimeout: 0`` (none): the headers are still handled once, however many reads
    the body takes — one ``100 Continue``, not one per read."""
    api = Api(tmp_path, redis_srv.url, "  writeTimeout: 0s\n  idleTimeout: 1s\n")
    try:
        sock = _connect(
            api,
            (
                f"POST {PATH} HTTP/1.1\r\nHost: t\r\nContent-Type: "
                f"application/json\r\nContent-Length: {len(BODY)}\r\n"
                "Expect: 100-continue\r\n\r\n"
            ).encode(),
        )
        sock.settimeout(30)
        assert sock.recv(1024) == b"HTTP/1.1 100 Continue\r\n\r\n"
        third = len(BODY) // 3
        for part in (BODY[:third], BODY[third : 2 * third]):
            sock.sendall(part)
            time.sleep(0.2)  # separate reads on the server (pacing, not a measurement)
        sock.sendall(BODY[2 * third :])
        data = _read_until_closed(sock)  # the answer, then the idle deadline closes it
        assert data.startswith(b"HTTP/1.1 200 ") and data.count(b"HTTP/1.1 100") == 0
    finally:
        api.stop()
