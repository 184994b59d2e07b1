"""The reconciler alone against real Redis: diff writes, unknown parts, losing the lease."""

from __future__ import annotations

import redis

import pytest
from redis.backoff import NoBackoff
from redis.retry import Retry

from common import keys
from common.metrics import Registry
from common.store import Instance
from services.discovery.metrics import DiscoveryMetrics
from services.discovery.reconcile import Desired, Reconciler
from tests.conftest import reserve_port, wait_for
from tests.metrics_oracle import value_of
from tests.store_oracle import OracleStore


def _reconciler(client: redis.Redis, holder: str, ttl: float = 5.0) -> Reconciler:
    return Reconciler(OracleStore(client), holder, ttl, DiscoveryMetrics.register(Registry()))


def _inst(ip: str, uid: str = "u1", **kw: object) -> Instance:
    return Instance(ip=ip, uid=uid, pod="p-" + ip, zmq_endpoint=f"tcp://{ip}:5557", **kw)  # type: ignore[arg-type]


def test_diff_writes_only_what_differs_and_unknown_parts_are_left_alone(
    redis_client: redis.Redis,
) -> None:
    rec = _reconciler(redis_client, "a")
    store = rec.store
    rec.sync(
        Desired(
            {"10.0.0.1": _inst("10.0.0.1"), "10.0.0.2": _inst("10.0.0.2")},
            {"http://10.0.1.1:9003": "{}"},
        )
    )
    assert store.instance_ips() == {"10.0.0.1", "10.0.0.2"}
    assert value_of(rec.metrics.changes, action="added") == 2
    rec.sync(
        Desired(
            {"10.0.0.1": _inst("10.0.0.1"), "10.0.0.2": _inst("10.0.0.2")},
            {"http://10.0.1.1:9003": "{}"},
        )
    )
    assert value_of(rec.metrics.changes, action="masters") == 1, (
        "an equal master set is not rewritten"
    )
    assert value_of(rec.metrics.changes, action="added") == 2

    rec.sync(Desired(None, None))  # never listed: nothing is removed
    assert store.instance_ips() == {"10.0.0.1", "10.0.0.2"} and store.list_masters()
    rec.sync(Desired({"10.0.0.1": _inst("10.0.0.1", role="prefill")}, None))
    assert store.instance_ips() == {"10.0.0.1"}
    assert store.get_instance("10.0.0.1").role == "prefill"  # type: ignore[union-attr]
    assert value_of(rec.metrics.changes, action="updated") == 1
    assert store.list_masters() == {"http://10.0.1.1:9003": "{}"}


def test_a_holder_whose_lease_expired_stops_writing(redis_client: redis.Redis) -> None:
    a, b = _reconciler(redis_client, "a", ttl=0.3), _reconciler(redis_client, "b", ttl=5.0)
    a.sync(Desired({"10.0.0.1": _inst("10.0.0.1")}, None))
    assert a.held and a.store.instance_ips() == {"10.0.0.1"}
    # `a` stalls past its TTL; `b` takes the lease over.
    wait_for(lambda: b.hold_lease(), what="b to get the expired lease")
    assert redis_client.get(keys.lease("discovery")) == b"b"
    a.sync(Desired({}, None))  # would remove 10.0.0.1 if `a` still wrote
    assert not a.held and a.store.instance_ips() == {"10.0.0.1"}
    assert value_of(a.metrics.lease_held) == 0
    a.release()
    assert redis_client.get(keys.lease("discovery")) == b"b", "release never drops another's lease"


def test_every_pass_reaches_for_redis_while_it_is_down() -> None:
    """A pass after a failed lease claim must not skip Redis and look like success: the
    loop marks discovery ready (and its Redis alert quiet) after any pass that raised nothing."""
    # No retries: every call fails at once, well within the lease's re-claim pause (1 s).
    dead = redis.Redis(port=reserve_port(), retry=Retry(NoBackoff(), 0))
    rec = _reconciler(dead, "a")
    for _ in range(3):
        with pytest.raises(redis.RedisError):
            rec.sync(Desired({"10.0.0.1": _inst("10.0.0.1")}, None))
    assert not rec.held


def _ms(client: redis.Redis) -> int:
    sec, usec = client.time()
    return int(sec) * 1000 + int(usec) // 1000


def _roll_back(client: redis.Redis, names: list[str], snapshot: dict[str, bytes | None]) -> None:
    """Put ``names`` back as ``snapshot`` had them: a failover lost every write since."""
    client.delete(*names)
    for name, blob in snapshot.items():
        if blob is not None:
            client.restore(name, 0, blob)


def test_registry_writes_a_failover_lost_are_redone_at_the_next_pass_with_a_new_gen(
    redis_client: redis.Redis,
) -> None:
    """Issue 19: the registry and generations discovery wrote are re-read on every pass, so
    what a failover lost (a new pod's registration, a replacement's generation) is written
    again at the next pass — and a redone generation is never one a writer saw before."""
    rec = _reconciler(redis_client, "a")
    store = rec.store
    ip, new = "10.0.0.1", "10.0.0.2"
    rec.sync(Desired({ip: _inst(ip, uid="pod-a")}, None))
    names = [keys.INSTANCES, keys.instance_meta(ip), keys.instance_gen(ip)]
    names += [keys.instance_meta(new), keys.instance_gen(new)]
    before = {n: redis_client.dump(n) for n in names}  # what the promoted replica has
    old_gen = store.get_instance(ip).gen  # type: ignore[union-attr]
    rec.sync(Desired({ip: _inst(ip, uid="pod-b"), new: _inst(new)}, None))
    lost_gen = store.get_instance(ip).gen  # type: ignore[union-attr]
    assert lost_gen > old_gen
    _roll_back(redis_client, names, before)  # type: ignore[arg-type]
    # (a failover takes seconds; here the next generation must not fall in the same ms)
    wait_for(lambda: _ms(redis_client) > lost_gen, what="Redis' clock past the lost generation")
    assert store.instance_ips() == {ip} and store.get_instance(ip).uid == "pod-a"  # type: ignore[union-attr]
    rec.sync(Desired({ip: _inst(ip, uid="pod-b"), new: _inst(new)}, None))
    assert store.instance_ips() == {ip, new}
    redone = store.get_instance(ip)
    assert redone is not None and redone.uid == "pod-b"
    assert redone.gen > lost_gen, "a generation is never reused, even after a lost write"
