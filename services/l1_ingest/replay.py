"""The replay client: asks a vLLM publisher's ROUTER for the batches since a sequence number.

vLLM's replay socket (spec vllm-kv-events.md §1.3) answers a request ``[b"", seq8]`` from a
DEALER with every buffered batch whose sequence is >= seq, then an end marker. What the DEALER
receives after the empty delimiter:

* vLLM >= 0.26: ``[topic, seq8, payload]``, end marker ``[b"", ff*8, b""]``;
* vLLM <  0.26: ``[seq8, payload]``, end marker ``[ff*8, b""]``.

Both are accepted; the end is a sequence of ``ff…ff`` or an empty payload. REQ is not used
because libzmq lets a REQ socket receive only the first reply (§1.3). Replay is silent about
what it no longer holds: the caller compares the first sequence with what it asked for.

A :class:`ReplayRequest` is non-blocking: the subscriber's poller watches :attr:`socket` and
calls :meth:`read`; the request ends at the end marker or at its deadline.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from enum import StrEnum

import zmq

from common.errors import DecodeError

logger = logging.getLogger(__name__)

END_SEQ = (1 << 64) - 1
"""-1 as 8 bytes: the sequence of the end-of-replay marker."""


class ReplayEndpoint(StrEnum):
    """Whether a rank's replay endpoint could be connected to (logged when it changes)."""

    AVAILABLE = "available"
    UNAVAILABLE = "unavailable"
    """ZMQ refused the endpoint: every gap goes to the gap policy for the session."""


def parse_reply(frames: list[bytes]) -> tuple[int, bytes] | None:
    """One DEALER reply → ``(seq, payload)``, or ``None`` for the end marker."""
    if len(frames) not in (3, 4) or frames[0] != b"":
        raise DecodeError(f"replay reply has {len(frames)} frames", "replay_framing")
    seq_frame, payload = frames[-2], frames[-1]
    if len(seq_frame) != 8:
        raise DecodeError(f"replay sequence frame has {len(seq_frame)} bytes", "replay_framing")
    seq = int.from_bytes(seq_frame, "big")
    if seq == END_SEQ or not payload:
        return None
    return seq, payload


class ReplayRequest:
    """One in-flight replay over a fresh DEALER socket (closed when the request ends).

    Raises ``zmq.ZMQError`` (and leaks no socket) when ZMQ cannot connect to ``endpoint``.
    """

    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        endpoint: str,
        start_seq: int,
        timeout: float,
        on_malformed: Callable[[str], None] = lambda reason: None,
    ) -> None:
        self.endpoint = endpoint
        self.start_seq = start_seq
        self.deadline = time.monotonic() + timeout
        self.batches: list[tuple[int, bytes]] = []
        self.on_malformed = on_malformed
        self.done = False
        self.complete = False
        self.socket: zmq.Socket[bytes] = ctx.socket(zmq.DEALER)
        try:
            self.socket.setsockopt(zmq.LINGER, 0)
            self.socket.setsockopt(zmq.RCVHWM, 0)
            self.socket.connect(endpoint)  # EINVAL for tcp://*:port or a missing port
            self.socket.send_multipart([b"", start_seq.to_bytes(8, "big")])
        except zmq.ZMQError:
            self.socket.close(linger=0)
            raise
        logger.debug("replay from %d requested at %s", start_seq, endpoint)

    def read(self) -> bool:
        """Drain every reply that has arrived; True once the request is over."""
        while not self.done:
            try:
                frames = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            try:
                item = parse_reply(frames)
            except DecodeError as exc:
                self.on_malformed(exc.reason)
                logger.error("replay from %s: dropped a reply: %s", self.endpoint, exc)
                continue
            if item is None:
                self.complete = True
                self.close()
            else:
                self.batches.append(item)
        return self.done

    def expired(self, now: float | None = None) -> bool:
        """True (and the request closed) once the deadline has passed without an end marker."""
        if not self.done and (now if now is not None else time.monotonic()) >= self.deadline:
            logger.warning(
                "replay from %s timed out after %d batches", self.endpoint, len(self.batches)
            )
            self.close()
            return True
        return False

    def close(self) -> None:
        if not self.done:
            self.done = True
            self.socket.close(linger=0)
