"""An in-process stand-in for one vLLM publisher's sockets, for tests of the L1 ingester.

:class:`FakePublisher` owns what vLLM's ``ZmqEventPublisher`` owns (spec vllm-kv-events.md
§1.2-§1.3): a sequence counter that starts at 0 and is not persisted (:meth:`restart` begins
a new lifetime), a replay buffer of the ``buffer_steps`` newest batches, a ROUTER replay
socket and, optionally, a PUB socket. It is served from the test's own thread
(:meth:`serve`), so nothing races: a replay is answered exactly when the test says.

Replay, as vLLM answers it: a request must reach the ROUTER as exactly ``[identity, b"",
start_seq]`` (any other shape is logged by vLLM and gets no reply); every buffered batch
whose sequence is >= start_seq is sent in order as ``[identity, b"", topic, seq8, payload]``
(``framing="pre-0.26"``: no topic frame), then the end marker ``[identity, b"", b"",
ff*8, b""]`` (pre-0.26: ``[identity, b"", ff*8, b""]``). A start older than the buffer is
answered from the oldest batch still held, silently.
"""

from __future__ import annotations

from collections import deque

import zmq

from common.events import BlockStored, encode_batch

END_SEQ8 = b"\xff" * 8


def payload(hashes: list[int], *, ts: float, rank: int = 0) -> bytes:
    """A real 0.28 EventBatch storing ``hashes`` (one GPU block each, chained from none)."""
    events = [
        BlockStored([h], None, list(range(h % 1000, h % 1000 + 4)), 4, medium="GPU") for h in hashes
    ]
    return encode_batch(events, ts=ts, data_parallel_rank=rank, vllm_version=(0, 28, 0))


class FakePublisher:
    """One vLLM publisher (one DP rank): sequence, replay buffer, ROUTER, optional PUB."""

    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        replay_port: int,
        *,
        pub_port: int | None = None,
        topic: bytes = b"kv",
        buffer_steps: int = 10_000,
        framing: str = "0.26",
        rank: int = 0,
    ) -> None:
        self.topic, self.framing, self.rank = topic, framing, rank
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.lifetime = 1
        self.next_seq = 0
        self.requests: list[int] = []
        """The start sequence of every well-formed replay request, in arrival order."""
        self.invalid = 0
        self.garbled: list[list[bytes]] = []
        """Replies (the frames after the empty delimiter) sent ahead of the next answer, then
        forgotten: what no vLLM sends, for tests of the ingester's replay client."""
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind(f"tcp://127.0.0.1:{replay_port}")
        self.replay_endpoint = f"tcp://127.0.0.1:{replay_port}"
        self.pub: zmq.Socket[bytes] | None = None
        if pub_port is not None:
            self.pub = ctx.socket(zmq.PUB)
            self.pub.setsockopt(zmq.LINGER, 0)
            self.pub.bind(f"tcp://127.0.0.1:{pub_port}")

    def hash_of(self, seq: int, lifetime: int | None = None) -> int:
        """The block hash batch ``seq`` of a lifetime stores (distinct across lifetimes)."""
        return (lifetime or self.lifetime) * 1_000_000 + seq

    def publish(self, *, send: bool = True) -> tuple[int, bytes]:
        """One new batch: buffered for replay, sent on the PUB socket if there is one and
        ``send`` (False = the live message is lost, as a slow joiner or a full HWM loses it).
        Every lifetime's payloads differ (their timestamps do, as vLLM's ``time.time()``)."""
        seq = self.next_seq
        self.next_seq += 1
        data = payload([self.hash_of(seq)], ts=self.lifetime * 1000.0 + seq, rank=self.rank)
        self.buffer.append((seq, data))
        if send and self.pub is not None:
            self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), data])
        return seq, data

    def publish_payload(self, data: bytes, *, send: bool = True) -> int:
        """One new batch with the given payload (e.g. removals); returns its sequence."""
        seq = self.next_seq
        self.next_seq += 1
        self.buffer.append((seq, data))
        if send and self.pub is not None:
            self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), data])
        return seq

    def restart(self) -> None:
        """vLLM restarted: a new publisher, sequence 0 again, an empty replay buffer."""
        self.lifetime += 1
        self.next_seq = 0
        self.buffer.clear()

    def serve(self) -> int:
        """Answer every replay request that has arrived; returns how many were answered."""
        answered = 0
        while True:
            try:
                frames = self.router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return answered
            if len(frames) != 3:  # vLLM: "Invalid replay request", no reply
                self.invalid += 1
                continue
            identity, _, start = frames
            start_seq = int.from_bytes(start, "big")
            self.requests.append(start_seq)
            for garbled in self.garbled:
                self.router.send_multipart([identity, b"", *garbled])
            self.garbled = []
            for seq, data in list(self.buffer):
                if seq >= start_seq:
                    self.router.send_multipart(
                        [identity, b"", *self._topic(), seq.to_bytes(8, "big"), data]
                    )
            self.router.send_multipart([identity, b"", *self._topic(b""), END_SEQ8, b""])
            answered += 1

    def _topic(self, topic: bytes | None = None) -> list[bytes]:
        if self.framing == "pre-0.26":
            return []
        return [self.topic if topic is None else topic]

    def close(self) -> None:
        self.router.close(linger=0)
        if self.pub is not None:
            self.pub.close(linger=0)
