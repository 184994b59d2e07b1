"""The simulator's publisher on the wire: vLLM's bind/connect rule, DP ports, replay framing."""

from __future__ import annotations

import pytest
import zmq

from common.events import AllBlocksCleared, decode_batch
from services.l1_ingest.replay import fetch_replay
from services.simulator.publisher import Publisher, binds, offset_endpoint
from tests.conftest import wait_for
from tests.conftest import reserve_ports


def test_bind_rule_and_offsets() -> None:
    assert binds("tcp://*:5557") and binds("tcp://[::]:5557") and binds("ipc:///tmp/x")
    assert binds("inproc://kv") and not binds("tcp://127.0.0.1:5557")
    assert offset_endpoint("tcp://*:5557", 1) == "tcp://*:5558"
    assert offset_endpoint("inproc://kv", 1) == "inproc://kv_dp1"


def test_non_wildcard_endpoint_connects_to_a_binding_subscriber() -> None:
    ctx = zmq.Context.instance()
    port = reserve_ports(2)
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.bind(f"tcp://127.0.0.1:{port + 1}")  # DP rank 1 → configured port + 1
    pub = Publisher(f"tcp://127.0.0.1:{port}", dp_rank=1)
    try:
        frames: list[bytes] = []

        def received() -> bool:
            pub.publish([AllBlocksCleared()])  # the first ones may be lost (slow joiner)
            if sub.poll(100):
                frames[:] = sub.recv_multipart()
            return bool(frames)

        wait_for(received, what="a frame from the connecting PUB")
        assert frames[0] == b"" and len(frames[1]) == 8
        assert decode_batch(frames[2]).data_parallel_rank == 1
    finally:
        pub.close()
        sub.close(linger=0)


@pytest.mark.parametrize(("version", "width"), [((0, 25, 0), 3), ((0, 26, 0), 4)])
def test_replay_framing_by_version(version: tuple[int, int, int], width: int) -> None:
    rport = reserve_ports()
    pub = Publisher(f"tcp://*:{reserve_ports()}", f"tcp://*:{rport}", "kv-events",
                    vllm_version=version, buffer_steps=3)
    try:
        for _ in range(5):
            pub.publish([AllBlocksCleared()])
        pub.flush()
        ctx = zmq.Context.instance()
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{rport}")
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        replies = []
        while True:
            assert dealer.poll(5000)
            replies.append(dealer.recv_multipart())
            if replies[-1][-2] == b"\xff" * 8:
                break
        dealer.close(linger=0)
        assert [len(r) for r in replies] == [width] * 4  # 3 buffered + end marker
        assert [int.from_bytes(r[-2], "big") for r in replies[:-1]] == [2, 3, 4]
        assert replies[-1][-1] == b""
        # The ingester's replay client reads both framings and reports the late start.
        got = fetch_replay(ctx, f"tcp://127.0.0.1:{rport}", 0, timeout=5)
        assert got.complete and [s for s, _ in got.batches] == [2, 3, 4]
    finally:
        pub.close()
