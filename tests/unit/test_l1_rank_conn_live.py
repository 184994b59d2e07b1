"""services.l1_ingest.rank_conn's live reads, in-process (found open by mutation testing,
issue 33): a live message that is not ``[topic, seq, payload]`` is dropped, counted under
``reason="framing"``, and the messages queued behind it are still read in the same round."""

from __future__ import annotations

from typing import Any

import zmq

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
