"""Connectable ZMQ endpoints: the validator and static discovery skipping bad entries."""

from __future__ import annotations

import logging

import pytest
import zmq

from common.config import Static, StaticVLLM
from services.discovery.endpoints import endpoint_problem
from services.discovery.static import desired_from

GOOD = [
    "tcp://127.0.0.1:5557",
    "tcp://vllm-0.vllm:5557",
    "tcp://[fd00::5]:5557",
    "tcp://eth0;10.0.0.1:5557",
    "ipc:///tmp/kv-events",
]
BAD = [
    "tcp://*:5558",
    "tcp://127.0.0.1",
    "tcp://127.0.0.1:",
    "tcp://0.0.0.0:5557",
    "tcp://[::]:5557",
    "tcp://:5557",
    "tcp://127.0.0.1:http",
    "tcp://127.0.0.1:70000",
    "inproc://kv",
    "127.0.0.1:5557",
    "tcp://",
]


@pytest.mark.parametrize("endpoint", GOOD)
def test_connectable_endpoints_pass(endpoint: str) -> None:
    assert endpoint_problem(endpoint) is None


@pytest.mark.parametrize("endpoint", BAD)
def test_unconnectable_endpoints_are_named(endpoint: str) -> None:
    assert endpoint_problem(endpoint)


@pytest.mark.parametrize("endpoint", ["tcp://*:5558", "tcp://127.0.0.1", "tcp://127.0.0.1:"])
def test_what_libzmq_refuses_is_rejected(endpoint: str) -> None:
    """The validator agrees with libzmq on the endpoints the ingester saw fail."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    try:
        with pytest.raises(zmq.ZMQError):
            sock.connect(endpoint)
    finally:
        sock.close(linger=0)
    assert endpoint_problem(endpoint)


def test_static_entries_with_unconnectable_endpoints_are_skipped(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.ERROR, logger="services.discovery.static")
    static = Static(
        vllm=[
            StaticVLLM(
                ip="127.0.0.1", zmq_endpoint="tcp://127.0.0.1:5557", replay_endpoint="tcp://*:5558"
            ),
            StaticVLLM(ip="127.0.0.2", zmq_endpoint="tcp://127.0.0.2"),
            StaticVLLM(
                ip="127.0.0.3",
                zmq_endpoint="tcp://127.0.0.3:5557",
                replay_endpoint="tcp://127.0.0.3:5558",
            ),
        ]
    )
    desired = desired_from(static)
    assert desired.instances is not None and set(desired.instances) == {"127.0.0.3"}
    text = caplog.text
    assert "vllm[0].replayEndpoint 'tcp://*:5558'" in text and "vllm[1].zmqEndpoint" in text
