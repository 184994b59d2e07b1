"""The discovery lease's timing against a real redis-server, on a clock the test moves
(issue 33, mutation testing of ``services/discovery/reconcile.py``): the TTL sent to Redis
(with its 0.3 s floor), renewal every TTL/3, a standby's retry at most every second, and
writes refused once 0.8 × TTL has passed since the last successful claim."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import redis

from common import keys
from common.lifecycle import Backoff
from common.metrics import Registry
from common.store import Instance, RegistryChange
from services.discovery import reconcile
from services.discovery.metrics import DiscoveryMetrics
from services.discovery.reconcile import Desired, LeaseLost, Reconciler
from tests.conftest import wait_for
from tests.metrics_oracle import value_of
from tests.store_oracle import OracleStore


class Clock:
    def __init__(self) -> None:
        self.now, self.reads = 1000.0, 0

    def monotonic(self) -> float:
        self.reads += 1
        return self.now


class CountingStore(OracleStore):
    """The real store, counting lease claims; each instance write takes ``write_takes`` s."""

    def __init__(self, client: redis.Redis, clock: Clock) -> None:
        super().__init__(client)
        self.clock, self.claims, self.write_takes = clock, 0, 0.0

    def claim_discovery_lease(self, holder: str, ttl_ms: int) -> bool:
        self.claims += 1
        return super().claim_discovery_lease(holder, ttl_ms)

    def upsert_instance(self, inst: Instance) -> tuple[RegistryChange, int]:
        self.clock.now += self.write_takes
        return super().upsert_instance(inst)


@pytest.fixture()
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(reconcile, "time", SimpleNamespace(monotonic=c.monotonic))
    return c


def _reconciler(
    client: redis.Redis, clock: Clock, ttl: float, holder: str = "a"
) -> tuple[Reconciler, CountingStore]:
    store = CountingStore(client, clock)
    return Reconciler(store, holder, ttl, DiscoveryMetrics.register(Registry())), store


def _inst(ip: str) -> Instance:
    return Instance(ip=ip, uid="u-" + ip, pod="p-" + ip, zmq_endpoint=f"tcp://{ip}:5557")


@pytest.mark.parametrize(("ttl", "lowest", "highest"), [(5.0, 4000, 5000), (0.05, 1, 300)])
def test_the_lease_ttl_sent_to_redis_has_a_floor_of_300_ms(
    redis_client: redis.Redis, clock: Clock, ttl: float, lowest: int, highest: int
) -> None:
    rec, _ = _reconciler(redis_client, clock, ttl)
    assert rec.hold_lease()
    assert lowest <= redis_client.pttl(keys.lease("discovery")) <= highest
    assert value_of(rec.metrics.lease_held) == 1


def test_the_holder_renews_every_third_of_the_ttl(redis_client: redis.Redis, clock: Clock) -> None:
    rec, store = _reconciler(redis_client, clock, ttl=6.0)
    assert rec.hold_lease() and store.claims == 1
    clock.now = 1001.99
    assert rec.hold_lease() and store.claims == 1, "renewed before a third of the TTL"
    clock.now = 1002.0
    assert rec.hold_lease() and store.claims == 2
    clock.now = 1003.99
    assert rec.hold_lease() and store.claims == 2
    clock.now = 1004.0
    assert rec.hold_lease() and store.claims == 3


def test_a_standby_retries_the_claim_once_a_second(redis_client: redis.Redis, clock: Clock) -> None:
    holder, _ = _reconciler(redis_client, clock, ttl=30.0, holder="other")
    assert holder.hold_lease()
    rec, store = _reconciler(redis_client, clock, ttl=6.0)
    assert not rec.hold_lease() and store.claims == 1
    assert value_of(rec.metrics.lease_held) == 0
    clock.now = 1000.5
    assert not rec.hold_lease() and store.claims == 1, "a standby claims at most once a second"
    clock.now = 1001.0
    assert not rec.hold_lease() and store.claims == 2
    # with a short TTL the standby retries every TTL/3 instead
    short, short_store = _reconciler(redis_client, clock, ttl=1.5, holder="b")
    assert not short.hold_lease() and short_store.claims == 1
    clock.now = 1001.49
    assert not short.hold_lease() and short_store.claims == 1
    clock.now = 1001.5
    assert not short.hold_lease() and short_store.claims == 2


def test_writes_stop_once_0_8_ttl_passed_since_the_last_claim(
    redis_client: redis.Redis, clock: Clock
) -> None:
    """A pass whose writes are slow stops writing when the lease may have run out: with a
    TTL of 5 s, a write at 4.0 s after the claim is refused (4.0 = 0.8 × 5, exactly)."""
    rec, store = _reconciler(redis_client, clock, ttl=5.0)
    store.write_takes = 2.0
    want = {ip: _inst(ip) for ip in ("10.0.0.1", "10.0.0.2", "10.0.0.3")}
    with pytest.raises(LeaseLost):
        rec.sync(Desired(want, None))
    assert store.instance_ips() == {"10.0.0.1", "10.0.0.2"}, "writes at 0 s and 2 s only"
    assert store.claims == 1
    # the next pass claims again at once (it may well still hold the lease) and finishes
    store.write_takes = 0.0
    rec.sync(Desired(want, None))
    assert store.claims == 2 and store.instance_ips() == set(want)


class _Source:
    def __init__(self, desired: Desired) -> None:
        self.changed = threading.Event()
        self.view = desired

    def start(self) -> None:
        pass

    def desired(self) -> Desired:
        return self.view

    def close(self) -> None:
        pass


def test_the_loop_reclaims_at_once_after_a_lease_lost_mid_pass(
    redis_client: redis.Redis, clock: Clock
) -> None:
    """The clock stands still while the loop waits, so only a pass that follows at once (no
    wait) can happen: after a pass stopped by the lease check, the loop counts it
    (``errors{kind="lease_lost"}``) and passes again without waiting."""
    rec, store = _reconciler(redis_client, clock, ttl=5.0)
    store.write_takes = 2.0
    want = {ip: _inst(ip) for ip in ("10.0.0.1", "10.0.0.2", "10.0.0.3")}
    stop = threading.Event()
    loop = threading.Thread(
        target=reconcile.run, args=(_Source(Desired(want, None)), rec, stop, Backoff(5, 5))
    )
    loop.start()
    try:
        wait_for(lambda: store.instance_ips() == set(want), what="all three written")
        assert value_of(rec.metrics.errors, kind="lease_lost") == 1
        assert store.claims == 2
    finally:
        stop.set()
        loop.join(10)
    assert not loop.is_alive()


class _CountingSource(_Source):
    def __init__(self, desired: Desired) -> None:
        super().__init__(desired)
        self.passes = 0

    def desired(self) -> Desired:
        self.passes += 1
        return self.view


def test_the_loop_passes_every_third_of_the_ttl_or_when_the_source_changes(
    redis_client: redis.Redis, clock: Clock
) -> None:
    """The loop waits ``leaseTTL/3`` between passes (here 1 s of the test's clock), or less
    when the source changes; never a busy loop, never a pass before its time."""
    rec, _ = _reconciler(redis_client, clock, ttl=3.0)
    source = _CountingSource(Desired({"10.0.0.1": _inst("10.0.0.1")}, None))
    stop = threading.Event()
    loop = threading.Thread(target=reconcile.run, args=(source, rec, stop, Backoff(5, 5)))
    loop.start()
    try:
        wait_for(lambda: source.passes == 1, what="the first pass")
        # after desired(), the pass reads the clock at most twice (lease, one write): a third
        # read is the wait's deadline, taken at 1000.0 (then one read per 0.25 s poll)
        reads = clock.reads
        wait_for(lambda: clock.reads >= reads + 3, what="the loop waiting")
        clock.now = 1000.9
        stop.wait(0.6)  # the loop polls every 0.25 s: time to (wrongly) pass early
        assert source.passes == 1, "a pass before a third of the TTL"
        clock.now = 1001.0
        wait_for(lambda: source.passes == 2, what="the pass at a third of the TTL")
        source.changed.set()
        wait_for(lambda: source.passes == 3, what="a pass on a change of the source")
        stop.wait(0.6)
        assert source.passes == 3
    finally:
        stop.set()
        loop.join(10)
    assert not loop.is_alive()
