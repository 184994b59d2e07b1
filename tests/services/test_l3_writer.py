"""L3Writer against a real redis-server: unchanged sets are not rewritten, and what forces a
rewrite (new content, a new generation, a Redis error, a refused write)."""

from __future__ import annotations

import random
from array import array
from collections import Counter
from collections.abc import Collection, Iterable, Mapping

import pytest
import redis

from common import keys
from common.store import Instance
from services.l3_poller.index import Blocks
from services.l3_poller.metrics import PollerMetrics
from services.l3_poller.writer import L3Writer, MasterView
from tests.metrics_oracle import value_of
from tests.store_oracle import OracleStore

POD_A, POD_B = "10.0.0.1", "10.0.0.2"
MASTER = "http://m:9003"


class CountingStore(OracleStore):
    """A real store that counts set replacements and can be made to fail them."""

    def __init__(self, client: redis.Redis) -> None:
        super().__init__(client)
        self.replaced: Counter[str] = Counter()
        self.fail = False
        self.refuse: set[str] = set()
        self.mapped: list[str] = []
        """IPs written with a group mapping (not a plain collection), in order."""

    def replace_l3(
        self,
        ip: str,
        hashes: Iterable[int] | Mapping[int, Iterable[int]],
        state: dict[str, str] | None = None,
        gen: int | None = None,
    ) -> bool:
        if self.fail:
            raise redis.ConnectionError("injected")
        self.replaced[ip] += 1
        if isinstance(hashes, Mapping):
            self.mapped.append(ip)
        if ip in self.refuse:  # what the script answers when the generation moved meanwhile
            return False
        return super().replace_l3(ip, hashes, state, gen=gen)


@pytest.fixture()
def store(redis_client: redis.Redis) -> CountingStore:
    s = CountingStore(redis_client)
    for ip in (POD_A, POD_B):
        s.upsert_instance(Instance(ip=ip, uid=f"uid-{ip}"))
    return s


def pool_view(writer: L3Writer, hashes: Collection[int], polled_ms: int) -> MasterView:
    """A fresh view (new array object, new poll time) as each poll publishes."""
    return MasterView(
        Blocks({}, array("Q", sorted(hashes)), len(hashes)),
        frozenset({POD_A, POD_B}),
        polled_ms,
        gens=writer.generations(),
    )


def test_pool_scope_skips_unchanged_sets(store: CountingStore) -> None:
    metrics = PollerMetrics.register()
    writer = L3Writer(store, "pool", metrics)
    writer.enroll(MASTER, "owner")
    pool = set(random.Random(1).sample(range(1, 1 << 62), 2000))
    assert writer.publish(MASTER, pool_view(writer, pool, 1), "owner")
    assert store.replaced == {POD_A: 1, POD_B: 1}
    for polled in range(2, 5):  # steady state: same content, only the poll time moves
        assert writer.publish(MASTER, pool_view(writer, pool, polled), "owner")
    assert store.replaced == {POD_A: 1, POD_B: 1}
    assert value_of(metrics.sets_written) == 2
    assert store.l3_members(POD_A) == pool == store.l3_members(POD_B)

    pool.add(7)  # one block more: both sets rewritten
    assert writer.publish(MASTER, pool_view(writer, pool, 5), "owner")
    assert store.replaced == {POD_A: 2, POD_B: 2}
    assert store.l3_members(POD_B) == pool

    # a Redis error in the middle of a write: everything is rewritten next time, even the
    # content that was written before the failed attempt
    store.fail = True
    assert not writer.publish(MASTER, pool_view(writer, pool - {7}, 6), "owner")
    store.fail = False
    assert writer.publish(MASTER, pool_view(writer, pool, 7), "owner")
    assert store.replaced == {POD_A: 3, POD_B: 3}

    # a new pod on A's IP (new generation): A is rewritten, B is not
    store.upsert_instance(Instance(ip=POD_A, uid="uid-new-pod"))
    assert store.l3_members(POD_A) == set()  # the replacement dropped the old pod's data
    assert writer.publish(MASTER, pool_view(writer, pool, 8), "owner")
    assert store.replaced == {POD_A: 4, POD_B: 3}
    assert store.l3_members(POD_A) == pool

    # the stale flag is state: dropping the master rewrites both sets
    assert writer.publish(MASTER, pool_view(writer, pool, 9).dropped(), "owner")
    assert store.replaced == {POD_A: 5, POD_B: 4}
    assert store.l3_state(POD_B)["stale"] == "1" and store.l3_members(POD_B) == set()


def test_a_refused_write_is_not_remembered(store: CountingStore) -> None:
    writer = L3Writer(store, "pool", PollerMetrics.register())
    writer.enroll(MASTER, "owner")
    store.refuse.add(POD_A)
    assert writer.publish(MASTER, pool_view(writer, {1, 2, 3}, 1), "owner")
    store.refuse.clear()
    assert writer.publish(MASTER, pool_view(writer, {1, 2, 3}, 2), "owner")
    assert store.replaced == {POD_A: 2, POD_B: 1}
    assert store.l3_members(POD_A) == {1, 2, 3}


def test_segment_scope_rewrites_only_the_instance_that_changed(store: CountingStore) -> None:
    writer = L3Writer(store, "segment", PollerMetrics.register())
    writer.enroll(MASTER, "owner")

    def view(a: set[int], b: set[int], polled: int) -> MasterView:
        per_ip = {POD_A: array("Q", sorted(a)), POD_B: array("Q", sorted(b))}
        return MasterView(
            Blocks(per_ip, None, len(a | b)),
            frozenset({POD_A, POD_B}),
            polled,
            gens=writer.generations(),
        )

    assert writer.publish(MASTER, view({1, 2}, {3}, 1), "owner")
    assert writer.publish(MASTER, view({1, 2}, {3}, 2), "owner")
    assert writer.publish(MASTER, view({1, 2}, {3, 4}, 3), "owner")
    assert store.replaced == {POD_A: 1, POD_B: 2}
    assert store.l3_members(POD_B) == {3, 4} and store.l3_state(POD_B)["blocks"] == "2"


def test_groups_are_written_as_sets_and_take_part_in_change_detection(store: CountingStore) -> None:
    writer = L3Writer(store, "segment", PollerMetrics.register())
    writer.enroll(MASTER, "owner")

    def view(a: dict[int, set[int]], polled: int) -> MasterView:
        def blocks(hashes: set[int]) -> Blocks:
            return Blocks({POD_A: array("Q", sorted(hashes))} if hashes else {}, None, len(hashes))

        top = blocks(a.get(0, set()))
        top.groups = {g: blocks(h) for g, h in a.items() if g}
        return MasterView(top, frozenset({POD_A, POD_B}), polled, gens=writer.generations())

    assert writer.publish(MASTER, view({0: {1, 2, 3}}, 1), "owner")
    assert store.mapped == []  # single group: today's plain write
    assert writer.publish(MASTER, view({0: {1, 2, 3}, 1: {3}}, 2), "owner")
    assert store.replaced[POD_A] == 2 and store.mapped == [POD_A]
    assert (store.l3_members(POD_A), store.l3_members(POD_A, 1)) == ({1, 2, 3}, {3})
    assert store.l3_state(POD_A)["groups"] == "0,1" and store.l3_state(POD_A)["blocks"] == "4"
    assert writer.publish(MASTER, view({0: {1, 2, 3}, 1: {3}}, 3), "owner")
    assert store.replaced[POD_A] == 2  # unchanged groups: not rewritten
    assert writer.publish(MASTER, view({0: {1, 2, 3}, 1: {2}}, 4), "owner")
    assert store.replaced[POD_A] == 3 and store.l3_members(POD_A, 1) == {2}  # group 1 moved
    assert writer.publish(MASTER, view({0: {1, 2, 3}, 2: {2}}, 5), "owner")
    assert store.replaced[POD_A] == 4  # the same hashes in another group are a change
    assert store.l3_state(POD_A)["groups"] == "0,2"
    assert not store.r.exists(keys.l3_group_set(POD_A, 1))
    assert writer.publish(MASTER, view({1: {5}}, 6), "owner")  # group 0 empty, still written
    assert (store.l3_members(POD_A), store.l3_members(POD_A, 1)) == (set(), {5})
    assert store.l3_state(POD_A)["groups"] == "0,1"
    assert writer.publish(MASTER, view({0: {1}}, 7), "owner")  # back to one group
    assert store.mapped[-1] == POD_A and len(store.mapped) == 4
    assert store.l3_state(POD_A)["groups"] == "0" and store.l3_members(POD_A) == {1}
    assert not store.r.exists(keys.l3_group_set(POD_A, 1))
    assert store.replaced[POD_B] == 1  # B has nothing in any group: written once


def test_groups_of_two_masters_are_merged_per_group(store: CountingStore) -> None:
    writer = L3Writer(store, "pool", PollerMetrics.register())
    for url in (MASTER, MASTER + "2"):
        writer.enroll(url, "owner")

    def view(g0: set[int], g1: set[int]) -> MasterView:
        top = Blocks({}, array("Q", sorted(g0)), len(g0 | g1))
        top.groups = {1: Blocks({}, array("Q", sorted(g1)), len(g1))}
        return MasterView(top, frozenset({POD_A}), 1, gens=writer.generations())

    assert writer.publish(MASTER, view({1, 2}, {2}), "owner")
    assert writer.publish(MASTER + "2", view({3}, {3}), "owner")
    assert (store.l3_members(POD_A), store.l3_members(POD_A, 1)) == ({1, 2, 3}, {2, 3})
    assert store.l3_members(POD_B) == set() and store.l3_state(POD_B)["groups"] == "0"


def _snapshot(store: OracleStore, ip: str) -> dict[str, bytes]:
    """The instance's L3 keys as DUMP blobs: what a replica holds that missed later writes."""
    names = (keys.l3_set(ip), keys.l3_state(ip))
    return {k: blob for k in names if (blob := store.r.dump(k)) is not None}  # type: ignore[misc]


def _roll_back(store: OracleStore, ip: str, snapshot: dict[str, bytes]) -> None:
    """Put the instance's L3 keys back as the snapshot had them (a failover lost the rest)."""
    store.r.delete(keys.l3_set(ip), keys.l3_state(ip))
    for k, blob in snapshot.items():
        store.r.restore(k, 0, blob)


@pytest.mark.parametrize("before", [{1, 2}, set()], ids=["older-set", "never-written"])
def test_a_rewrite_that_redis_lost_is_written_again_on_the_next_poll(
    store: CountingStore, before: set[int]
) -> None:
    """Issue 19: an acknowledged rewrite lost by a failover (the new master is a replica that
    never received it) is noticed on the next poll by its ``written`` token, not after
    REWRITE_AFTER, while the content the poller sees does not change."""
    metrics = PollerMetrics.register()
    writer = L3Writer(store, "pool", metrics)
    writer.enroll(MASTER, "owner")
    if before:
        assert writer.publish(MASTER, pool_view(writer, before, 1), "owner")
    lost = _snapshot(store, POD_A)
    assert writer.publish(MASTER, pool_view(writer, {1, 2, 3}, 2), "owner")
    _roll_back(store, POD_A, lost)
    assert store.l3_members(POD_A) == before
    assert writer.publish(MASTER, pool_view(writer, {1, 2, 3}, 3), "owner")
    assert store.l3_members(POD_A) == {1, 2, 3} == store.l3_members(POD_B)
    assert store.l3_state(POD_A)["updated_ms"] == "3"
    assert value_of(metrics.sets_lost) == 1
    replaced = dict(store.replaced)
    assert writer.publish(MASTER, pool_view(writer, {1, 2, 3}, 4), "owner")
    assert store.replaced == replaced, "healed: unchanged sets are skipped again"
    assert store.l3_state(POD_A)["updated_ms"] == "4"
