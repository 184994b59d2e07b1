"""services.l1_ingest.rank_conn in-process, with real ZMQ sockets where they matter (found open
by mutation testing, issue 33): a live message that is not ``[topic, seq, payload]`` is
dropped, counted under ``reason="framing"``, and the messages queued behind it are still read;
the SUB socket's options, topic and monitor as configured; each connection change logged once
and followed by the connected gauge."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from common.settings import L1IngestSettings
from common.status_report import ConnState
from services.l1_ingest.metrics import IngestMetrics
from services.l1_ingest.rank_conn import RankConn
from tests.metrics_oracle import value_of


class _Sub:
    def __init__(self, messages: list[list[bytes]]) -> None:
        self.messages = messages

    def recv_multipart(self, flags: int = 0) -> list[bytes]:
        if not self.messages:
            raise zmq.Again()
        return self.messages.pop(0)


class _Stream:
    name, paused = "10.0.0.1 r0", False

    def __init__(self) -> None:
        self.live: list[tuple[int, bytes]] = []

    def on_live(self, seq: int, payload: bytes) -> None:
        self.live.append((seq, payload))


def test_a_badly_framed_message_is_counted_and_the_rest_read() -> None:
    """Kills the ``framing`` label replaced (3) and ``break`` for ``continue``."""
    stream, metrics = _Stream(), IngestMetrics()
    good = [b"kv", (7).to_bytes(8, "big"), b"payload"]
    sub = _Sub([[b"kv", b"x"], good, [b"kv", b"short", b"p"]])
    conn: Any = RankConn(stream, sub, None, metrics)  # type: ignore[arg-type]
    conn.read_live()
    assert stream.live == [(7, b"payload")]
    assert value_of(metrics.malformed_frames, reason="framing") == 2
    assert sub.messages == []


@pytest.fixture(name="ctx")
def ctx_fixture() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)  # a failed test's sockets too


class _ClosingStream(_Stream):
    closed = 0

    def close(self) -> None:
        self.closed += 1


@pytest.mark.parametrize(
    ("initial", "cap", "ivl", "ivl_max"),
    [
        (0.25, 30.0, 250, 2000),  # backoffMax above RECONNECT_MAX: the cap is 2 s
        (0.0004, 1.5, 1, 1500),  # under a millisecond: 1 ms, not 0 (libzmq's "never")
        (3.0, 0.0001, 3000, 1),
    ],
)
def test_the_sub_socket_is_opened_with_the_configured_reconnect_backoff(
    ctx: zmq.Context[zmq.Socket[bytes]], initial: float, cap: float, ivl: int, ivl_max: int
) -> None:
    """Kills ``open``'s options (mutation testing, issue 33): the reconnect interval in
    milliseconds (``/ 1000`` for ``* 1000`` made it 1 ms: a dead publisher hammered), its
    floor, the cap, no linger, the high-water mark, and both sockets closed by ``close``."""
    cfg = L1IngestSettings(backoff_initial=initial, backoff_max=cap)
    metrics, stream = IngestMetrics(), _ClosingStream()
    conn = RankConn.open(stream, ctx, cfg, metrics)  # type: ignore[arg-type]
    sub = conn.sub
    assert sub.getsockopt(zmq.RECONNECT_IVL) == ivl
    assert sub.getsockopt(zmq.RECONNECT_IVL_MAX) == ivl_max
    assert sub.getsockopt(zmq.LINGER) == 0
    assert sub.getsockopt(zmq.RCVHWM) == 100_000
    assert sub.type == zmq.SUB and conn.monitor.type == zmq.PAIR
    conn.connected = True
    metrics.connected.inc(1)
    conn.close()
    assert sub.closed and conn.monitor.closed and stream.closed == 1
    assert value_of(metrics.connected) == 0 and not conn.connected


def test_the_sub_socket_subscribes_to_the_configured_topic_only(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """A publisher's other topics are not read (``SUBSCRIBE`` with the configured topic), and
    the monitor is asked for the connection changes it follows only (``None``: every event)."""
    pub = ctx.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    conn = RankConn.open(_ClosingStream(), ctx, L1IngestSettings(topic="kv@"), IngestMetrics())  # type: ignore[arg-type]
    conn.sub.connect(f"tcp://127.0.0.1:{port}")
    seq = (1).to_bytes(8, "big")
    got: list[list[bytes]] = []
    deadline = time.monotonic() + 10
    while not got and time.monotonic() < deadline:  # a SUB joins late: send until heard
        pub.send_multipart([b"other", seq, b"no"])
        pub.send_multipart([b"kv@", seq, b"yes"])
        if conn.sub.poll(100):
            got.append(conn.sub.recv_multipart())
    assert got == [[b"kv@", seq, b"yes"]]
    while conn.sub.poll(200):
        assert conn.sub.recv_multipart()[0] == b"kv@"
    # the monitor reports only the three changes read_monitor follows (not every event)
    codes = []
    while conn.monitor.poll(200):
        codes.append(recv_monitor_message(conn.monitor)["event"])
    assert codes == [zmq.EVENT_HANDSHAKE_SUCCEEDED]
    conn.close()


class _Inst:
    def __init__(self, endpoint: str) -> None:
        self.zmq_endpoint = endpoint


class _ConnectingStream(_ClosingStream):
    rank = 0

    def __init__(self, endpoint: str) -> None:
        super().__init__()
        self.inst = _Inst(endpoint)
        self.connects = 0

    def on_connected(self) -> None:
        self.connects += 1


def test_each_connection_change_is_logged_once_with_its_endpoint(
    ctx: zmq.Context[zmq.Socket[bytes]], caplog: pytest.LogCaptureFixture
) -> None:
    """Connecting, connected (the endpoint the handshake was with), disconnected and
    unreachable (warnings), connected again: each change logged once as the monitor reports
    it, and the gauge follows (back to 1 on the reconnect). Kills the state log's arguments in
    ``set_state``, ``connect`` and ``read_monitor`` (the state itself ``None`` logged nothing
    at all), the event tests inverted (a refused retry taken for a disconnect), and
    ``connected = True`` on a disconnect (the gauge left at 0 once reconnected)."""
    pub = ctx.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    endpoint = f"tcp://127.0.0.1:{port}"
    stream, metrics = _ConnectingStream(endpoint), IngestMetrics()
    conn = RankConn.open(stream, ctx, L1IngestSettings(), metrics)  # type: ignore[arg-type]
    caplog.set_level(logging.INFO, logger="services.l1_ingest.rank_conn")

    def follow(*until: ConnState) -> None:
        deadline = time.monotonic() + 10
        while conn.state not in until:
            assert time.monotonic() < deadline, f"never {until}"
            conn.monitor.poll(100)
            conn.read_monitor()

    conn.connect()
    follow(ConnState.CONNECTED)
    assert stream.connects == 1 and value_of(metrics.connected) == 1
    pub.close(linger=0)
    follow(ConnState.UNREACHABLE)  # disconnected, then libzmq's retries are refused
    assert value_of(metrics.connected) == 0
    pub = ctx.socket(zmq.PUB)
    pub.bind(endpoint)  # the publisher is back: a retry succeeds
    follow(ConnState.CONNECTED)
    assert stream.connects == 2 and value_of(metrics.connected) == 1
    conn.close()
    lines = [(r.levelno, r.getMessage()) for r in caplog.records]
    name = "publisher 10.0.0.1 r0"
    assert lines == [
        (logging.INFO, f"{name}: connecting ({endpoint})"),
        (logging.INFO, f"{name}: connected ({endpoint})"),
        (logging.WARNING, f"{name}: disconnected (libzmq reconnects)"),
        (logging.WARNING, f"{name}: unreachable (retrying)"),
        (logging.INFO, f"{name}: connected ({endpoint})"),
    ]
