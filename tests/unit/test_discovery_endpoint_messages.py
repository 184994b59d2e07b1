"""``services.discovery.endpoints.endpoint_problem``: the exact answer for each edge (port 0,
1, 65535, 65536; no ``://``, nothing after it, a trailing colon, a source before ``;``,
brackets, a wildcard), found unpinned by mutation testing (issue 33): the older test
checked only that a problem was found, not which."""

from __future__ import annotations

import pytest

from services.discovery.endpoints import endpoint_problem


@pytest.mark.parametrize(
    ("endpoint", "problem"),
    [
        ("tcp://10.0.0.1:1", None),
        ("tcp://10.0.0.1:65535", None),
        ("tcp://10.0.0.1:0", "has an invalid port '0'"),
        ("tcp://10.0.0.1:65536", "has an invalid port '65536'"),
        ("tcp://10.0.0.1:", "has no port"),
        ("tcp://10.0.0.1", "has no port"),
        ("tcp://", "is not like tcp://host:port"),
        ("10.0.0.1:5557", "is not like tcp://host:port"),
        ("udp://tcp://10.0.0.1:5557", "uses transport 'udp'; an ingester connects over tcp or ipc"),
        ("ipc:///tmp/kv", None),
        (
            "tcp://10.0.0.9;*:5557",
            "has the wildcard host '*': a bind address, not one to connect to",
        ),
        ("tcp://10.0.0.9;10.0.0.1:5557", None),
        ("tcp://[::]:5557", "has the wildcard host '::': a bind address, not one to connect to"),
        ("tcp://[::1]:5557", None),
        ("tcp://[:5557", None),  # an odd host, but libzmq's to refuse, not ours
        ("tcp://:5557", "has no host"),
        ("tcp://[]:5557", "has no host"),
    ],
)
def test_the_problem_named_for_each_edge(endpoint: str, problem: str | None) -> None:
    assert endpoint_problem(endpoint) == problem
