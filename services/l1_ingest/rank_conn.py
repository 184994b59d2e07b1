"""One subscribed instance rank's sockets: its SUB socket, the socket's monitor, its stream.

The SUB socket connects to the rank's endpoint; libzmq reconnects with ``RECONNECT_IVL`` =
``backoffInitial`` doubling up to ``min(backoffMax, RECONNECT_MAX)``: the cap, not
``backoffMax``, is what makes a restarted vLLM reconnected to, and its new lifetime
recognised, within a few seconds. The monitor reports the connection's changes, each logged
once as a :class:`~common.status_report.ConnState`; every successful handshake starts the
stream's catch-up replay.

Live messages must be ``[topic, seq (8 bytes, big-endian), payload]``; anything else is
counted and dropped. At most ``DRAIN_MAX`` are read from one socket per poll round, so a busy
instance cannot starve the others. Which sockets are polled, and what a failure does, is the
subscriber's (:mod:`services.l1_ingest.subscriber`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from enum import Enum

import zmq
from zmq.utils.monitor import recv_monitor_message

from common.lifecycle import StateLog
from common.settings import L1IngestSettings
from common.status_report import ConnState
from services.l1_ingest.metrics import IngestMetrics
from services.l1_ingest.stream import RankStream, rank_endpoint

logger = logging.getLogger(__name__)

RECONNECT_MAX = 2.0
"""Cap of the SUB socket's reconnect interval: a restarted publisher is noticed this fast."""
DRAIN_MAX = 500
"""Messages read from one socket per poll round, so a busy instance cannot starve others."""
_MONITORED = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED


def parse_live(frames: list[bytes]) -> tuple[int, bytes] | None:
    """``[topic, seq8, payload]`` → ``(seq, payload)``; ``None`` for any other shape."""
    if len(frames) != 3 or len(frames[1]) != 8:
        return None
    return int.from_bytes(frames[1], "big"), frames[2]


class SocketKind(Enum):
    """What a polled socket of a rank is."""

    SUB = "sub"
    """The live stream."""
    MONITOR = "monitor"
    """The SUB socket's connection events."""
    REPLAY = "replay"
    """The DEALER of a replay in flight."""


@dataclass(eq=False)
class RankConn:
    """A rank's stream with its SUB socket and monitor."""

    stream: RankStream
    sub: zmq.Socket[bytes]
    monitor: zmq.Socket[bytes]
    metrics: IngestMetrics
    state: ConnState = ConnState.CONNECTING
    connected: bool = False
    _log: StateLog = field(init=False)

    def __post_init__(self) -> None:
        self._log = StateLog(logger, f"publisher {self.stream.name}")

    @classmethod
    def open(
        cls,
        stream: RankStream,
        ctx: zmq.Context[zmq.Socket[bytes]],
        cfg: L1IngestSettings,
        metrics: IngestMetrics,
    ) -> RankConn:
        """The rank's SUB socket and monitor, not connected yet (:meth:`connect`)."""
        sub = ctx.socket(zmq.SUB)
        try:
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.RCVHWM, 100_000)
            sub.setsockopt(zmq.RECONNECT_IVL, max(1, int(cfg.backoff_initial * 1000)))
            cap = min(cfg.backoff_max, RECONNECT_MAX)
            sub.setsockopt(zmq.RECONNECT_IVL_MAX, max(1, int(cap * 1000)))
            sub.setsockopt(zmq.SUBSCRIBE, cfg.topic.encode())
            monitor = sub.get_monitor_socket(_MONITORED)
        except zmq.ZMQError:
            sub.close(linger=0)
            raise
        return cls(stream, sub, monitor, metrics)

    def connect(self) -> None:
        endpoint = rank_endpoint(self.stream.inst.zmq_endpoint, self.stream.rank)
        self.sub.connect(endpoint)
        self.set_state(ConnState.CONNECTING, endpoint)

    def set_state(self, state: ConnState, detail: str, level: int = logging.INFO) -> None:
        """The connection's state, logged when it changes."""
        self.state = state
        self._log.set(state, detail, level)

    def close(self) -> None:
        """Close the stream (a replay in flight) and both sockets."""
        if self.connected:
            self.connected = False
            self.metrics.connected.inc(-1)
        self.stream.close()
        self.sub.disable_monitor()
        self.monitor.close(linger=0)
        self.sub.close(linger=0)

    def read_live(self) -> None:
        """Hand up to ``DRAIN_MAX`` queued live batches to the stream (less once it pauses)."""
        for _ in range(DRAIN_MAX):
            if self.stream.paused:
                return
            try:
                frames = self.sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            item = parse_live(frames)
            if item is None:
                self.metrics.malformed_frames.inc(reason="framing")
                logger.error(
                    "%s: dropped a message of %d frames (want topic, seq, payload)",
                    self.stream.name,
                    len(frames),
                )
                continue
            self.stream.on_live(*item)

    def read_monitor(self) -> None:
        """Follow the connection's events: a handshake starts the stream's catch-up."""
        while True:
            try:
                event = recv_monitor_message(self.monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            code = event["event"]
            if code == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                # pyzmq gives the endpoint as bytes: logged as the text connect was given
                self.set_state(ConnState.CONNECTED, event["endpoint"].decode())
                if not self.connected:
                    self.connected = True
                    self.metrics.connected.inc(1)
                self.stream.on_connected()
            elif code == zmq.EVENT_DISCONNECTED:
                self.set_state(ConnState.DISCONNECTED, "libzmq reconnects", logging.WARNING)
                if self.connected:
                    self.connected = False
                    self.metrics.connected.inc(-1)
            elif code == zmq.EVENT_CONNECT_RETRIED:
                self.set_state(ConnState.UNREACHABLE, "retrying", logging.WARNING)
