"""Reads over several instances on a real 3-master Redis Cluster: each instance's keys hash to
their own slot, so a read of several must not be one MULTI/EXEC (a cluster refuses a
transaction across slots).

Issue 33 (mutation testing of ``common/store.py``): ``list_instances`` as a transactional
pipeline passed every test, which registered one instance on the cluster at most.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from common.config import Redis as RedisConfig
from common.redis_client import _Cluster, client_options
from common.store import Instance, Store, StoredCursor, TierOps
from tests.redis_nodes import Cluster

IPS = [f"10.0.{i}.{i + 1}" for i in range(6)]


@pytest.fixture(scope="module")
def store() -> Iterator[Store]:
    cluster = Cluster(3).start()
    url, options = client_options(RedisConfig(url=cluster.url, cluster=True), retries=3)
    client = _Cluster.from_url(url, **options)
    try:
        yield Store(client)
    finally:
        client.close()
        cluster.cleanup()


def test_every_registered_instance_is_listed_and_its_cursors_read(store: Store) -> None:
    gens = {}
    for n, ip in enumerate(IPS):
        _, gens[ip] = store.upsert_instance(Instance(ip=ip, uid=f"u{n}", pod=f"vllm-{n}"))
    listed = store.list_instances()
    assert [i.ip for i in listed] == sorted(IPS)
    assert {i.ip: i.pod for i in listed} == {ip: f"vllm-{n}" for n, ip in enumerate(IPS)}
    for ip in IPS[:3]:
        ops = TierOps()
        ops.store("l1", [7])
        assert store.apply_batch(ip, gens[ip], 0, 4, ops, digest="d4").status == "applied"
    assert (
        store.cursors([(ip, 0) for ip in IPS])
        == [StoredCursor(4, "d4")] * 3 + [StoredCursor(None, "")] * 3
    )
