"""An in-memory Mooncake master admin port (for service tests and scripts/bench_l3_poll.py).

Serves the endpoints the L3 poller uses in the wire formats of three generations, as
captured from real masters (tests/data/mooncake/queries-*.json):

* ``0.3.13``: ``/batch_query_keys`` with null fields, ``/get_segments_detail``, JSON
  ``/query_key``;
* ``0.3.10``: ``/batch_query_keys`` without null fields, no segments detail (404),
  text-line ``/query_key``;
* ``0.3.8``: no ``/batch_query_keys`` either (404).

Like the real masters, query parameters are taken raw (never URL-decoded), so an encoded
key is a miss. ``fault`` makes every data endpoint misbehave: ``503`` (standby),
``garbage`` (an HTML page), ``binary`` (NUL bytes as text), ``truncated`` (body shorter
than its Content-Length), ``slow`` (answers after ``slow_seconds``), ``one_line`` (a
16 MiB ``/get_all_keys`` body without a newline), ``bad_locate`` (``/batch_query_keys`` answers
``{"success":true,"data":null}``, ``/query_key`` ``{"success":true}``).
"""

from __future__ import annotations

import socket
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import orjson


class FakeMaster:
    def __init__(self, version: str = "0.3.13", host: str = "127.0.0.1", port: int = 0) -> None:
        self.version = tuple(int(p) for p in version.split("."))
        self.keys: dict[str, tuple[str, ...]] = {}
        self.segments: dict[str, str] = {}
        self.fault: str | None = None
        self.slow_seconds = 2.0
        self.requests: list[str] = []
        self.calls: Counter[str] = Counter()
        self.record_paths = True
        self.removed = 0
        """Keys removed (or replaced by a put elsewhere): ``/metrics`` reports it."""
        self.metrics = True
        """False: no ``/metrics`` (404), as a master whose metrics cannot be read."""
        self._body: bytes | None = None
        self._lock = threading.Lock()
        self._unblock = threading.Event()
        self._conns: set[socket.socket] = set()
        self._server = ThreadingHTTPServer((host, port), self._handler())
        self._server.daemon_threads = True
        self._server.handle_error = lambda *_: None  # type: ignore[method-assign]  # cut peers
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> FakeMaster:
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop like a dead process: also cut the keep-alive connections being served."""
        self._unblock.set()
        self._server.shutdown()
        self._server.server_close()
        for conn in list(self._conns):
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    # -- contents ------------------------------------------------------------------

    def mount(self, segment: str, te_endpoint: str | None = None) -> str:
        """Add a segment; returns its transport endpoint (P2P style: another port)."""
        self.segments[segment] = te_endpoint or segment
        return self.segments[segment]

    def unmount(self, segment: str) -> None:
        """Like a real unmount: the segment and every key with a replica on it vanish."""
        ep = self.segments.pop(segment)
        self.set_keys({k: r for k, r in self.keys.items() if ep not in r})

    def put(self, key: str, *endpoints: str) -> None:
        """Put ``key`` (a key already there is removed first, as a real master must)."""
        with self._lock:
            if self.keys.get(key, tuple(endpoints)) != tuple(endpoints):
                self.removed += 1
            self.keys[key] = tuple(endpoints)
            self._body = None

    def set_keys(self, keys: dict[str, tuple[str, ...]]) -> None:
        with self._lock:
            self.removed += sum(1 for k, r in self.keys.items() if keys.get(k) != r)
            self.keys = keys
            self._body = None

    def remove(self, key: str) -> None:
        with self._lock:
            self.removed += key in self.keys
            self.keys.pop(key, None)
            self._body = None

    def all_keys_body(self) -> bytes:
        with self._lock:
            if self._body is None:
                self._body = "".join(k + "\n" for k in self.keys).encode()
            return self._body

    # -- responses -----------------------------------------------------------------

    def respond(self, path: str) -> tuple[int, str, bytes]:
        route, _, query = path.partition("?")
        self.calls[route] += 1
        faulty = self._fault(route)
        if faulty is not None:
            return faulty
        if route == "/get_all_keys":
            return 200, "text/plain; version=0.0.4", self.all_keys_body()
        if route == "/metrics" and self.metrics:
            body = f"master_remove_requests_total {self.removed}\nmaster_evicted_key_count 0\n"
            return 200, "text/plain; version=0.0.4", body.encode()
        if route == "/get_all_segments":
            return (
                200,
                "text/plain; version=0.0.4",
                "".join(s + "\n" for s in self.segments).encode(),
            )
        if route == "/get_segments_detail" and self.version >= (0, 3, 12):
            return 200, "application/json; charset=utf-8", self._detail()
        if route == "/batch_query_keys" and self.version >= (0, 3, 9):
            return self._batch(query.removeprefix("keys="))
        if route == "/query_key":
            return self._query_key(query.removeprefix("key="))
        return 404, "", b"404 Not Found"

    def _fault(self, route: str) -> tuple[int, str, bytes] | None:
        """The answer ``fault`` forces on ``route``, if any."""
        if self.fault == "503":
            return (
                503,
                "application/json",
                (
                    b'{"success":false,"error_code":-1011,'
                    b'"error_message":"service plane is not active"}'
                ),
            )
        if self.fault == "garbage":
            return 200, "text/html", b"<html><body>502 Bad Gateway</body></html>"
        if self.fault == "binary" and route == "/get_all_keys":
            return 200, "text/plain; version=0.0.4", b"\x00\x01\x02garbage\n"
        if self.fault == "one_line" and route == "/get_all_keys":
            return 200, "text/plain; version=0.0.4", b"k" * (16 << 20)
        if self.fault == "bad_locate" and route == "/batch_query_keys":
            return 200, "application/json", b'{"success":true,"data":null}'
        if self.fault == "bad_locate" and route == "/query_key":
            return 200, "application/json", b'{"success":true}'
        return None

    def _detail(self) -> bytes:
        segs = [
            {"segment_name": name, "te_endpoint": ep, "status": "OK", "protocol": "tcp"}
            for name, ep in self.segments.items()
        ]
        return orjson.dumps({"total_segments": len(segs), "segments": segs})

    def _replicas(self, key: str) -> list[dict[str, Any]] | None:
        eps = self.keys.get(key)
        if eps is None:
            return None
        return [
            {
                "size_": 4096,
                "buffer_address_": 140000000000000 + i,
                "protocol_": "tcp",
                "transport_endpoint_": ep,
            }
            for i, ep in enumerate(eps)
        ]

    def _batch(self, raw: str) -> tuple[int, str, bytes]:
        if not raw:
            return 400, "application/json", b'{"success":false,"error":"No keys provided."}'
        new = self.version >= (0, 3, 12)
        nulls = {"disk_values": None, "local_disk_values": None, "nof_values": None}
        data: dict[str, Any] = {}
        for key in raw.split(","):
            reps = self._replicas(key)
            entry: dict[str, Any] = (
                {"ok": True, "values": reps}
                if reps is not None
                else {"ok": False, "error": "OBJECT_NOT_FOUND"}
            )
            if new:
                entry = {"error": None, "values": None, **entry, **nulls}
            data[key] = entry
        return 200, "application/json; charset=utf-8", orjson.dumps({"success": True, "data": data})

    def _query_key(self, key: str) -> tuple[int, str, bytes]:
        reps = self._replicas(key)
        if self.version >= (0, 3, 12):
            if reps is None:
                return (
                    404,
                    "application/json; charset=utf-8",
                    (b'{"success":false,"error_code":-704,"error_message":"OBJECT_NOT_FOUND"}'),
                )
            return (
                200,
                "application/json; charset=utf-8",
                orjson.dumps({"success": True, "data": reps}),
            )
        if reps is None:
            return 404, "text/plain; version=0.0.4", b"OBJECT_NOT_FOUND"
        return 200, "text/plain; version=0.0.4", b"".join(orjson.dumps(r) + b"\n" for r in reps)

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        master = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def setup(self) -> None:
                super().setup()
                # headers and body are two writes: without this, Nagle + delayed ACK
                # add 40 ms to every keep-alive response
                self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                master._conns.add(self.connection)

            def finish(self) -> None:
                master._conns.discard(self.connection)
                super().finish()

            def do_GET(self) -> None:
                if master.record_paths:
                    master.requests.append(self.path)
                if master.fault == "slow" and master._unblock.wait(master.slow_seconds):
                    return
                status, ctype, body = master.respond(self.path)
                self.send_response(status)
                if ctype:
                    self.send_header("Content-Type", ctype)
                cut = master.fault == "truncated" and len(body) > 2
                self.send_header("Content-Length", str(len(body) + (100 if cut else 0)))
                if cut:
                    self.send_header("Connection", "close")
                self.end_headers()
                self.wfile.write(body)
                if cut:
                    self.close_connection = True

            def log_message(self, *_args: Any) -> None:
                pass

        return Handler
