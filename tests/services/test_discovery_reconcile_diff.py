"""The reconciler's diff against a real redis-server (issue 33, mutation testing of
``services/discovery/reconcile.py``): an unchanged instance is not written again, and a
registered IP whose instance data was lost is written again at the next pass."""

from __future__ import annotations

import threading

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from common import keys
from common.health import Health
from common.lifecycle import Backoff
from common.metrics import Registry
from common.store import Instance, RegistryChange
from services.discovery.metrics import DiscoveryMetrics
from services.discovery.reconcile import Desired, Reconciler, run
from tests.conftest import reserve_port, wait_for
from tests.metrics_oracle import value_of
from tests.store_oracle import OracleStore


class RecordingStore(OracleStore):
    """The real store, remembering which instances it was asked to write."""

    def __init__(self, client: redis.Redis) -> None:
        super().__init__(client)
        self.upserts: list[str] = []

    def upsert_instance(self, inst: Instance) -> tuple[RegistryChange, int]:
        self.upserts.append(inst.ip)
        return super().upsert_instance(inst)


def _inst(ip: str, uid: str = "u1", **kw: object) -> Instance:
    return Instance(ip=ip, uid=uid, pod="p-" + ip, zmq_endpoint=f"tcp://{ip}:5557", **kw)  # type: ignore[arg-type]


def _reconciler(client: redis.Redis) -> tuple[Reconciler, RecordingStore]:
    store = RecordingStore(client)
    return Reconciler(store, "a", 5.0, DiscoveryMetrics.register(Registry())), store


def test_a_pass_writes_only_the_instances_that_differ(redis_client: redis.Redis) -> None:
    rec, store = _reconciler(redis_client)
    want = {ip: _inst(ip) for ip in ("10.0.0.1", "10.0.0.2", "10.0.0.3")}
    rec.sync(Desired(want, None))
    assert sorted(store.upserts) == sorted(want)
    store.upserts.clear()
    rec.sync(Desired(want, None))
    assert store.upserts == [], "an unchanged registry is not written again"
    changed = {**want, "10.0.0.2": _inst("10.0.0.2", restarts="1:5")}
    rec.sync(Desired(changed, None))
    assert store.upserts == ["10.0.0.2"]


def test_a_registered_ip_whose_instance_data_was_lost_is_written_again(
    redis_client: redis.Redis,
) -> None:
    """The IP is in the instance set but its description is gone (a write half lost, e.g.
    to a failover): the next pass registers it again rather than trusting the set."""
    rec, store = _reconciler(redis_client)
    want = {"10.0.0.1": _inst("10.0.0.1"), "10.0.0.2": _inst("10.0.0.2")}
    rec.sync(Desired(want, None))
    redis_client.delete(keys.instance_meta("10.0.0.2"))
    assert store.get_instance("10.0.0.2") is None and "10.0.0.2" in store.instance_ips()
    store.upserts.clear()
    rec.sync(Desired(want, None))
    assert store.upserts == ["10.0.0.2"]
    again = store.get_instance("10.0.0.2")
    assert again is not None and again.uid == "u1" and again.zmq_endpoint == "tcp://10.0.0.2:5557"
    assert value_of(rec.metrics.changes, action="added") == 3


class _Source:
    """A source whose view the test sets; ``fail`` makes the next passes raise."""

    def __init__(self, desired: Desired) -> None:
        self.changed = threading.Event()
        self.view, self.fail = desired, False

    def start(self) -> None:
        pass

    def desired(self) -> Desired:
        if self.fail:
            raise RuntimeError("a bug in the source")
        return self.view

    def close(self) -> None:
        pass


def test_the_loop_reports_readiness_as_the_registry_condition(redis_client: redis.Redis) -> None:
    """``cache_indexer_worker_condition{condition="registry"}`` and /readyz: ready after a
    pass that reached Redis, not ready (and counted, registry kept) after a failed pass."""
    rec, store = _reconciler(redis_client)
    source = _Source(Desired({"10.0.0.1": _inst("10.0.0.1")}, None))
    health, stop = Health(), threading.Event()
    loop = threading.Thread(target=run, args=(source, rec, stop, Backoff(0.05, 0.2), health))
    loop.start()
    try:
        wait_for(lambda: health.conditions() == [("registry", True)], what="ready")
        assert store.instance_ips() == {"10.0.0.1"}
        source.fail = True
        source.view = Desired({}, None)
        source.changed.set()
        wait_for(lambda: health.conditions() == [("registry", False)], what="not ready")
        assert value_of(rec.metrics.errors, kind="internal") >= 1
        assert "the last pass failed" in health.readiness()[1]
        assert store.instance_ips() == {"10.0.0.1"}
        source.fail = False  # the loop outlives a failed pass
        source.changed.set()
        wait_for(lambda: health.conditions() == [("registry", True)], what="ready again")
        assert store.instance_ips() == set()
    finally:
        stop.set()
        loop.join(10)
    assert not loop.is_alive()


def test_the_loop_is_not_ready_while_redis_is_down_and_says_why() -> None:
    dead = redis.Redis(port=reserve_port(), retry=Retry(NoBackoff(), 0))
    rec = Reconciler(OracleStore(dead), "a", 5.0, DiscoveryMetrics.register(Registry()))
    source = _Source(Desired({"10.0.0.1": _inst("10.0.0.1")}, None))
    health, stop = Health(), threading.Event()
    loop = threading.Thread(target=run, args=(source, rec, stop, Backoff(0.05, 0.2), health))
    loop.start()
    try:
        wait_for(lambda: value_of(rec.metrics.errors, kind="redis") >= 2, what="two failed passes")
        ready, text = health.readiness()
        assert not ready and text.startswith("not ready: registry: Redis: ConnectionError: "), text
        assert health.conditions() == [("registry", False)]
    finally:
        stop.set()
        loop.join(10)
    assert not loop.is_alive()


def test_release_on_shutdown_hands_the_lease_over_at_once(redis_client: redis.Redis) -> None:
    a, _ = _reconciler(redis_client)
    b = Reconciler(OracleStore(redis_client), "b", 5.0, DiscoveryMetrics.register(Registry()))
    assert a.hold_lease() and not b.hold_lease()
    a.release()
    assert redis_client.get(keys.lease("discovery")) is None
    assert not a.held and value_of(a.metrics.lease_held) == 0
    c = Reconciler(OracleStore(redis_client), "c", 5.0, DiscoveryMetrics.register(Registry()))
    assert c.hold_lease(), "a standby's next claim takes the lease, without waiting for the TTL"


def test_a_registered_ip_without_its_description_is_still_removed(
    redis_client: redis.Redis,
) -> None:
    rec, store = _reconciler(redis_client)
    rec.sync(Desired({"10.0.0.1": _inst("10.0.0.1"), "10.0.0.2": _inst("10.0.0.2")}, None))
    redis_client.delete(keys.instance_meta("10.0.0.2"))
    rec.sync(Desired({"10.0.0.1": _inst("10.0.0.1")}, None))
    assert store.instance_ips() == {"10.0.0.1"}
    assert value_of(rec.metrics.changes, action="removed") == 1
