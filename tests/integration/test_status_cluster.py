"""The status view (``GET /kv-cache/instances``, the per-instance metrics and ``inspect``) on
a real 3-master Redis Cluster: the API's suite for it (tests/services/test_api_instances.py)
and inspect's, run here with the cluster client the processes use (issue 19: the reader's
pipelined ``TIME`` was refused in cluster pipelines, a 500 on every cluster)."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from common import keys
from common.config import Redis as RedisConfig
from common.redis_client import connect
from common.status_report import StatusReader
from services.tools import inspect_cmd
from tests.redis_nodes import Cluster
from tests.store_oracle import OracleStore
from tests.services.test_api_instances import (  # noqa: F401 - the same suite, on a cluster
    URL,
    populate,
    test_document_shape,
    test_hybrid_groups_are_described_with_their_exactness,
    test_metrics_show_instance_states_and_master_keys,
    test_owner_that_stopped_heartbeating_means_unassigned,
    test_state_precedence,
)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    c = Cluster(3).start()
    yield c
    c.cleanup()


@pytest.fixture()
def any_store(cluster: Cluster) -> Iterator[OracleStore]:  # overrides the suite's fixture
    client = connect(RedisConfig(url=cluster.url, cluster=True), retries=3)
    for node in client.get_primaries():
        client.get_redis_connection(node).flushall()
    yield OracleStore(client)
    client.close()


def test_reader_reads_a_registry_spread_over_every_node(any_store: OracleStore) -> None:
    """Instances whose keys live on different nodes (their hash tags differ) are all read,
    on the first call and on the next (the registry is known by then)."""
    populate(any_store)
    ips = [f"10.1.0.{i}" for i in range(1, 13)]
    for ip in ips:
        any_store.r.sadd(keys.INSTANCES, ip)
        any_store.r.hset(keys.instance_meta(ip), mapping={"pod": f"pod-{ip}"})
    slots = {any_store.r.keyslot(keys.instance_meta(ip)) for ip in ips}
    nodes = {any_store.r.get_node_from_key(keys.instance_meta(ip)).name for ip in ips}
    assert len(slots) > 1 and len(nodes) > 1
    reader = StatusReader(any_store.r)
    for _ in range(2):
        raw = reader.read()
        assert set(ips) | {"10.0.0.5", "10.0.0.6"} <= set(raw.instances)
        assert {raw.instances[ip]["meta"]["pod"] for ip in ips} == {f"pod-{ip}" for ip in ips}
        assert raw.now_ms > 0 and URL in raw.masters


def test_inspect_on_a_cluster(any_store: OracleStore, cluster: Cluster, tmp_path: Path) -> None:
    populate(any_store)
    config = tmp_path / "config.yaml"
    config.write_text(f"redis:\n  url: {cluster.url}\n  cluster: true\n", encoding="utf-8")
    out = io.StringIO()
    assert inspect_cmd.main(["--config", str(config), "--json"], out) == 0
    doc: dict[str, Any] = orjson.loads(out.getvalue())
    assert [i["server_ip"] for i in doc["instances"]] == ["10.0.0.5", "10.0.0.6"]
    assert doc["instances"][0]["l1"]["hash_check"] == "mismatch"
    assert doc["masters"][0]["keys_unmappable_group"] == 3
    table = io.StringIO()
    assert inspect_cmd.main(["--config", str(config)], table) == 0
    assert any(line.startswith("10.0.0.5") for line in table.getvalue().splitlines())
