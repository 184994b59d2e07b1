"""A KV-event publisher that behaves on the wire like vLLM's ``ZmqEventPublisher``.

Spec vllm-kv-events.md §1: every batch is ``[topic, seq (8 bytes, big-endian), payload]`` on
a PUB socket, with the sequence starting at 0. The PUB socket binds only when the endpoint
contains ``*`` or ``::`` or is ``ipc://``/``inproc://``; any other endpoint makes it
*connect* (the subscriber binds there). The optional replay ROUTER always binds and keeps
the last ``buffer_steps`` batches: a request ``[identity, b"", start_seq]`` is answered with
``[identity, b"", topic, seq, payload]`` per buffered batch >= start_seq, then the end
marker ``[identity, b"", b"", ff*8, b""]`` — or, emulating vLLM < 0.26, the same without the
topic frame. Any other request shape gets no reply (logged, like vLLM). For DP rank r, tcp
ports are offset by r and inproc names get ``_dp<r>``.

Like vLLM, one thread owns the sockets and serves replay between publishes; callers hand it
batches through a queue. Payloads are encoded by :func:`common.events.encode_batch` in the
emulated version's array (<= 0.23) or map (>= 0.24) form.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

import zmq

from common.events import Event, encode_batch

logger = logging.getLogger(__name__)

END_SEQ = b"\xff" * 8
REPLAY_TOPIC_SINCE = (0, 26, 0)


def binds(endpoint: str) -> bool:
    """vLLM's rule: bind for wildcards and ipc/inproc, otherwise connect."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def bind_on(endpoint: str, bind_host: str) -> str:
    """Where a wildcard endpoint actually binds: ``*`` replaced by ``bind_host``.

    vLLM binds every interface for ``tcp://*:port``; the simulator binds only ``bind_host``
    (loopback by default) unless it is given ``*``, so tests and the local stack never listen
    beyond the machine.
    """
    return endpoint.replace("*", bind_host, 1) if bind_host != "*" else endpoint


def offset_endpoint(endpoint: str, rank: int) -> str:
    """The DP rank's endpoint: tcp port + rank, inproc ``_dp<rank>``; rank 0 unchanged."""
    if not endpoint or rank == 0:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{rank}"
    base, _, port = endpoint.rpartition(":")
    return f"{base}:{int(port) + rank}" if port.isdigit() else endpoint


class Publisher:
    """One DP rank's publisher; :meth:`publish` is thread-safe and returns the sequence."""

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str = "",
        topic: str = "",
        *,
        dp_rank: int = 0,
        vllm_version: tuple[int, int, int] = (0, 28, 0),
        buffer_steps: int = 10_000,
        ctx: zmq.Context[zmq.Socket[bytes]] | None = None,
        bind_host: str = "127.0.0.1",
    ) -> None:
        self.endpoint = offset_endpoint(endpoint, dp_rank)
        self.replay_endpoint = offset_endpoint(replay_endpoint, dp_rank)
        self.topic = topic.encode()
        self.bind_host = bind_host
        self.dp_rank, self.vllm_version = dp_rank, vllm_version
        self.ctx = ctx or zmq.Context.instance()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._queue: queue.Queue[tuple[int, bytes, bool] | None] = queue.Queue()
        self._lock = threading.Lock()
        self._next_seq = 0
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"publisher-r{dp_rank}", daemon=True)
        self._thread.start()
        self._ready.wait(10)
        if self._error is not None:
            raise self._error

    @property
    def last_seq(self) -> int:
        """The sequence of the last batch handed to :meth:`publish` (-1 before the first)."""
        return self._next_seq - 1

    def publish(
        self, events: Sequence[Event], *, ts: float | None = None, drop: bool = False
    ) -> int:
        """Queue one batch; ``drop`` keeps it for replay but never sends it live (a gap)."""
        payload = encode_batch(
            events,
            ts=time.time() if ts is None else ts,
            data_parallel_rank=self.dp_rank,
            vllm_version=self.vllm_version,
        )
        return self.publish_payload(payload, drop=drop)

    def publish_payload(self, payload: bytes, *, drop: bool = False) -> int:
        """Queue an encoded batch (or captured frames, or malformed input in tests)."""
        with self._lock:
            seq = self._next_seq
            self._next_seq += 1
            self._queue.put((seq, payload, drop))
        return seq

    def flush(self) -> None:
        """Wait until every queued batch has been sent (or dropped) and buffered."""
        self._queue.join()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(10)

    # -- the publisher thread ------------------------------------------------------------------

    def _open(self) -> tuple[zmq.Socket[bytes], zmq.Socket[bytes] | None]:
        pub = self.ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.setsockopt(zmq.SNDHWM, 100_000)
        try:
            if binds(self.endpoint):
                pub.bind(bind_on(self.endpoint, self.bind_host))
            else:
                pub.connect(self.endpoint)
        except zmq.ZMQError:
            pub.close(linger=0)
            raise
        if not self.replay_endpoint:
            return pub, None
        router = self.ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.setsockopt(zmq.SNDHWM, 2 * (self._buffer.maxlen or 0) + 2)
        try:
            router.bind(bind_on(self.replay_endpoint, self.bind_host))
        except zmq.ZMQError:
            router.close(linger=0)
            pub.close(linger=0)
            raise
        return pub, router

    def _run(self) -> None:
        try:
            pub, router = _retry_bind(self._open)
        except zmq.ZMQError as exc:
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        poller = zmq.Poller()
        if router is not None:
            poller.register(router, zmq.POLLIN)
        try:
            while True:
                if router is not None and poller.poll(0):
                    self._serve_replay(router)
                try:
                    item = self._queue.get(timeout=0.02)
                except queue.Empty:
                    continue
                if item is None:
                    self._queue.task_done()
                    return
                seq, payload, drop = item
                if not drop:
                    pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
                self._buffer.append((seq, payload))
                self._queue.task_done()
        finally:
            pub.close(linger=0)
            if router is not None:
                router.close(linger=0)

    def _serve_replay(self, router: zmq.Socket[bytes]) -> None:
        while True:
            try:
                frames = router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3:
                logger.warning("Invalid replay request: %d frames", len(frames))
                continue
            identity, start = frames[0], int.from_bytes(frames[2], "big")
            head = [identity, b""] + ([self.topic] if self._replay_topic else [])
            for seq, payload in list(self._buffer):
                if seq >= start:
                    router.send_multipart([*head, seq.to_bytes(8, "big"), payload])
            router.send_multipart(
                [identity, b""] + ([b""] if self._replay_topic else []) + [END_SEQ, b""]
            )

    @property
    def _replay_topic(self) -> bool:
        return self.vllm_version >= REPLAY_TOPIC_SINCE


def _retry_bind(
    open_sockets: Callable[[], tuple[zmq.Socket[bytes], zmq.Socket[bytes] | None]],
    deadline_s: float = 3.0,
) -> tuple[zmq.Socket[bytes], zmq.Socket[bytes] | None]:
    """Open the sockets; a just-closed predecessor (a simulated restart) may still hold the
    port for a few milliseconds, so EADDRINUSE is retried until a deadline."""
    deadline = time.monotonic() + deadline_s
    pause = threading.Event()
    while True:
        try:
            return open_sockets()
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                raise
            pause.wait(0.02)
