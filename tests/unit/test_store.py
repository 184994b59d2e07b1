"""The store's contract, run against fakeredis (with lupa) and a real redis-server."""

from __future__ import annotations

import dataclasses

import pytest
import redis

from common import keys
from common.store import Instance, Store, StoredCursor, TierOps
from tests.conftest import wait_for

IP = "10.0.0.5"


@pytest.fixture()
def store(any_store: Store) -> Store:
    return any_store


def _register(store: Store, ip: str = IP, uid: str = "uid-1", **kw: object) -> int:
    result, gen = store.upsert_instance(Instance(ip=ip, uid=uid, **kw))  # type: ignore[arg-type]
    return gen


def _ops(*items: tuple[str, str, list[int]]) -> TierOps:
    ops = TierOps()
    for op, tier, hashes in items:
        if op == "C":
            ops.clear(tier)
        elif op == "S":
            ops.store(tier, hashes)
        else:
            ops.remove(tier, hashes)
    return ops


def test_upsert_reports_what_happened_and_is_idempotent(store: Store) -> None:
    inst = Instance(ip=IP, uid="u", pod="vllm-0", zmq_endpoint="tcp://10.0.0.5:5557")
    result, gen = store.upsert_instance(inst)
    assert result == "added" and gen > 0
    assert store.upsert_instance(inst) == ("unchanged", gen)
    moved = Instance(ip=IP, uid="u", pod="vllm-0", zmq_endpoint="tcp://10.0.0.5:6000")
    assert store.upsert_instance(moved) == ("updated", gen)
    got = store.get_instance(IP)
    assert got is not None and got.zmq_endpoint == "tcp://10.0.0.5:6000" and got.gen == gen
    assert store.instance_ips() == {IP}
    assert [i.ip for i in store.list_instances()] == [IP]


def test_duplicate_copies_are_counted(store: Store) -> None:
    gen = _register(store)
    ops = _ops(("S", "l1", [7, 8]), ("S", "l1", [7]))
    assert store.apply_batch(IP, gen, 0, 0, ops).status == "applied"
    res = store.apply_batch(IP, gen, 0, 1, _ops(("R", "l1", [7])))
    assert res.status == "applied" and store.tier_counts(IP) == {7: 1, 8: 1}  # one copy removed
    assert store.tier_members(IP) == {7, 8}, "one copy of 7 is still held"
    store.apply_batch(IP, gen, 0, 2, _ops(("R", "l1", [7, 99])))
    assert store.tier_members(IP) == {8}
    assert store.tier_counts(IP) == {8: 1}


def test_remove_of_unknown_hash_is_counted_not_negative(store: Store) -> None:
    gen = _register(store)
    res = store.apply_batch(IP, gen, 0, 0, _ops(("R", "l1", [5])))
    assert res.unknown_removes == 1
    store.apply_batch(IP, gen, 0, 1, _ops(("S", "l1", [5])))
    assert store.tier_members(IP) == {5}


def test_sequence_is_recorded_and_old_batches_are_ignored(store: Store) -> None:
    gen = _register(store)
    assert store.apply_batch(IP, gen, 0, 5, _ops(("S", "l1", [1]))).status == "applied"
    assert store.last_seq(IP, 0) == 5
    assert store.apply_batch(IP, gen, 0, 5, _ops(("S", "l1", [2]))).status == "duplicate"
    assert store.apply_batch(IP, gen, 0, 3, _ops(("S", "l1", [3]))).status == "duplicate"
    assert store.tier_members(IP) == {1}


def test_reset_clears_the_rank_before_applying(store: Store) -> None:
    gen = _register(store)
    store.apply_batch(IP, gen, 0, 9, _ops(("S", "l1", [1, 2]), ("S", "l2", [3])))
    res = store.apply_batch(IP, gen, 0, 0, _ops(("S", "l1", [4])), reset=True)
    assert res.status == "applied"
    assert store.tier_members(IP) == {4}
    assert store.tier_members(IP, "l2") == set()
    assert store.last_seq(IP, 0) == 0


def test_a_write_is_refused_unless_the_stored_cursor_is_the_one_it_follows(store: Store) -> None:
    """Issue 19 item 2 (L1): a batch names the cursor (seq, digest) it follows; a failover
    that took writes back, or an emptied state hash, refuses it and changes nothing."""
    gen = _register(store)

    def write(seq: int, follows: StoredCursor, digest: str, hashes: list[int]) -> str:
        ops = _ops(("S", "l1", hashes))
        return store.apply_batch(IP, gen, 0, seq, ops, follows=follows, digest=digest).status

    assert write(0, StoredCursor(), "aa", [1]) == "applied"  # nothing stored = -1
    assert store.cursor(IP, 0) == StoredCursor(0, "aa")
    assert write(1, StoredCursor(0, "bb"), "cc", [2]) == "cursor_moved"  # other bytes at 0
    assert write(1, StoredCursor(), "cc", [2]) == "cursor_moved"  # believes nothing stored
    assert write(1, StoredCursor(0, "aa"), "cc", [2]) == "applied"
    assert write(2, StoredCursor(1, "cc"), "dd", [3]) == "applied"
    store.r.hset(keys.l1_state(IP), mapping={"seq:0": "1", "dig:0": "cc"})  # a lost write
    assert write(3, StoredCursor(2, "dd"), "ee", [4]) == "cursor_moved"
    assert store.cursor(IP, 0) == StoredCursor(1, "cc") and store.tier_members(IP) == {1, 2, 3}
    store.r.delete(keys.l1_state(IP))  # the hash emptied
    assert write(3, StoredCursor(2, "dd"), "ee", [4]) == "cursor_moved"
    assert store.cursor(IP, 0) == StoredCursor() and store.tier_members(IP) == {1, 2, 3}


def test_a_reset_is_not_fenced_by_the_cursor_and_drops_the_digest(store: Store) -> None:
    gen = _register(store, dp_size=2)
    store.apply_batch(IP, gen, 0, 4, _ops(("S", "l1", [1])), digest="aa")
    res = store.apply_batch(IP, gen, 0, -1, TierOps(), reset=True, follows=StoredCursor(9, "x"))
    assert res.status == "applied" and store.tier_members(IP) == set()
    assert store.cursor(IP, 0) == StoredCursor(-1, "")
    assert StoredCursor(-1, "").same(StoredCursor())  # -1 and no field: nothing applied
    res = store.apply_batch(
        IP, gen, 0, 0, _ops(("S", "l1", [2])), follows=StoredCursor(), digest="dd"
    )
    assert res.status == "applied"
    store.apply_batch(IP, gen, 0, 1, TierOps())  # unchecked, no digest: none recorded
    res = store.apply_batch(IP, gen, 0, 2, TierOps(), follows=StoredCursor(0, ""))
    assert res.status == "cursor_moved"  # the same (empty) digest, another seq
    store.apply_batch(IP, gen, 1, 7, TierOps(), digest="bb")
    assert store.cursors([(IP, 0), (IP, 1), ("10.9.9.9", 0)]) == [
        StoredCursor(1, ""),
        StoredCursor(7, "bb"),
        StoredCursor(),
    ]


def test_all_blocks_cleared_only_clears_its_rank(store: Store) -> None:
    gen = _register(store, dp_size=2)
    store.apply_batch(IP, gen, 0, 0, _ops(("S", "l1", [1, 2])))
    store.apply_batch(IP, gen, 1, 0, _ops(("S", "l1", [2, 3])))
    store.apply_batch(IP, gen, 0, 1, _ops(("C", "l1", []), ("S", "l1", [9])))
    assert store.tier_members(IP) == {2, 3, 9}
    assert store.tier_counts(IP) == {2: 1, 3: 1, 9: 1}


def test_gap_flag_is_counted(store: Store) -> None:
    gen = _register(store, dp_size=2)
    store.apply_batch(IP, gen, 0, 10, TierOps(), gap=True)
    assert store.l1_state(IP)["gap:0"] == "1"
    store.apply_batch(IP, gen, 0, 11, TierOps())  # only a flagged batch counts
    store.apply_batch(IP, gen, 1, 0, TierOps())
    assert store.l1_state(IP) == {"seq:0": "11", "seq:1": "0", "gap:0": "1"}


def test_writes_are_fenced_by_generation_and_owner(store: Store) -> None:
    gen = _register(store)
    assert store.apply_batch(IP, gen + 1, 0, 0, _ops(("S", "l1", [1]))).status == "stale_gen"
    assert store.claim_instance(IP, "ingester-a", 10_000)
    assert not store.claim_instance(IP, "ingester-b", 10_000)
    res = store.apply_batch(IP, gen, 0, 0, _ops(("S", "l1", [1])), owner="ingester-b")
    assert res.status == "not_owner"
    res = store.apply_batch(IP, gen, 0, 0, _ops(("S", "l1", [1])), owner="ingester-a")
    assert res.status == "applied"
    assert store.release_instance(IP, "ingester-a")
    assert store.claim_instance(IP, "ingester-b", 10_000)
    assert store.tier_members(IP) == {1}


def test_unregistered_instance_is_never_written(store: Store) -> None:
    assert store.apply_batch("10.9.9.9", 1, 0, 0, _ops(("S", "l1", [1]))).status == "stale_gen"
    assert not store.replace_l3("10.9.9.9", [1, 2])
    assert store.l3_members("10.9.9.9") == set()


def test_new_pod_on_reused_ip_starts_empty(store: Store) -> None:
    gen = _register(store, uid="old-pod")
    store.apply_batch(IP, gen, 0, 0, _ops(("S", "l1", [1]), ("S", "l2", [2])))
    store.replace_l3(IP, [3])
    result, new_gen = store.upsert_instance(Instance(ip=IP, uid="new-pod"))
    assert result == "replaced" and new_gen > gen
    assert store.tier_members(IP) == set() and store.l3_members(IP) == set()
    assert store.last_seq(IP, 0) is None
    assert store.apply_batch(IP, gen, 0, 1, _ops(("S", "l1", [1]))).status == "stale_gen"


def test_container_restart_drops_l1_but_keeps_l3(store: Store) -> None:
    gen = _register(store, restarts="0")
    store.apply_batch(IP, gen, 0, 0, _ops(("S", "l1", [1, 1])))
    store.replace_l3(IP, [3])
    assert store.r.exists(keys.tier_copies(IP, "l1"))  # two copies of 1
    result, new_gen = store.upsert_instance(Instance(ip=IP, uid="uid-1", restarts="1"))
    assert result == "restarted" and new_gen > gen
    assert store.tier_members(IP) == set()
    assert not store.r.exists(keys.tier_copies(IP, "l1")), "copy counts dropped"
    assert store.l3_members(IP) == {3}


def test_remove_drops_every_key_but_the_generation(store: Store) -> None:
    gen = _register(store, dp_size=2)
    store.apply_batch(IP, gen, 0, 0, _ops(("S", "l1", [1]), ("S", "l2", [5])))
    store.apply_batch(IP, gen, 1, 0, _ops(("S", "l1", [2])))
    store.replace_l3(IP, [3], {"master": "http://m:9003"})
    store.claim_instance(IP, "ing", 10_000)
    assert store.remove_instance(IP)
    left = {k.decode() for k in store.r.keys("*")}
    assert left == {keys.instance_gen(IP)}
    _, gen2 = store.upsert_instance(Instance(ip=IP, uid="uid-1"))
    assert gen2 > gen, "a re-added instance never reuses an old generation"


def test_replace_l3_is_whole_and_empty_clears(store: Store) -> None:
    _register(store)
    assert store.replace_l3(IP, range(25_000), {"master": "m", "blocks": "25000"})
    assert len(store.l3_members(IP)) == 25_000
    assert store.l3_state(IP)["blocks"] == "25000"
    store.replace_l3(IP, [1, 2])
    assert store.l3_members(IP) == {1, 2}
    store.replace_l3(IP, [])
    assert store.l3_members(IP) == set()


def test_prefix_lengths_one_round_trip_semantics(store: Store) -> None:
    gen = _register(store)
    _register(store, ip="10.0.0.6", uid="u6")
    store.apply_batch(IP, gen, 0, 0, _ops(("S", "l1", [1, 2, 4])))
    store.replace_l3(IP, [1])
    store.replace_l3("10.0.0.6", [2, 3])
    members = [b"1", b"2", b"3", b"4"]
    got = store.prefix_lengths([IP, "10.0.0.6", "10.1.1.1", IP], members)
    assert got == [(2, 1), (0, 0), (0, 0), (2, 1)]
    assert store.prefix_lengths([IP], []) == [(0, 0)]


def test_prefix_lengths_of_many_candidates_written_in_several_pieces(store: Store) -> None:
    """~48 KiB of members per command: 60 candidates × 2 tiers are written in 3 pieces."""
    members = [b"%d" % (10**18 + i) for i in range(2000)]
    ips = [f"10.3.0.{i}" for i in range(60)]
    for i, ip in enumerate(ips):
        gen = _register(store, ip=ip, uid=f"u{i}")
        store.apply_batch(ip, gen, 0, 0, _ops(("S", "l1", [int(m) for m in members[: i * 30]])))
        store.replace_l3(ip, [int(m) for m in members[: 2000 - i]])
    got = store.prefix_lengths(ips + ips[:3], members)
    expected = [(i * 30, 2000 - i) for i in range(60)]
    assert got == expected + expected[:3]


def test_leases_and_ingester_heartbeats(store: Store) -> None:
    assert store.claim_discovery_lease("d1", 10_000)
    assert not store.claim_discovery_lease("d2", 10_000)
    assert store.claim_discovery_lease("d1", 10_000), "renewal by the holder"
    assert store.r.get(keys.lease("discovery")) == b"d1"
    assert not store.release_discovery_lease("d2")
    assert store.release_discovery_lease("d1") and store.claim_discovery_lease("d2", 10_000)
    assert store.heartbeat_ingester("a", 10_000) == ["a"]
    assert store.heartbeat_ingester("b", 10_000) == ["a", "b"]
    store.leave_ingesters("a")
    assert store.heartbeat_ingester("b", 10_000) == ["b"]
    assert store.heartbeat_ingester("c", -1) == ["b"], "an expired heartbeat is pruned"


def test_masters_registry_is_replaced_whole(store: Store) -> None:
    store.set_masters({"http://127.0.0.1:9003": "{}", "http://127.0.0.2:9003": "{}"})
    store.set_masters({"http://127.0.0.2:9003": '{"pod":"m"}'})
    assert store.list_masters() == {"http://127.0.0.2:9003": '{"pod":"m"}'}


def test_generation_is_not_reused_after_redis_lost_its_data(store: Store) -> None:
    """A Redis restarted without persistence must not hand out an old generation again."""
    gen = _register(store)
    store.r.flushall()

    def server_ms() -> int:
        sec, usec = store.r.time()
        return int(sec) * 1000 + int(usec) // 1000

    wait_for(lambda: server_ms() > gen, timeout=2, what="a restart to take a millisecond")
    assert _register(store) > gen


def test_l3_data_of_a_replaced_pod_is_refused(store: Store) -> None:
    old_gen = _register(store, uid="pod-a")
    _, new_gen = store.upsert_instance(Instance(ip=IP, uid="pod-b"))
    assert not store.replace_l3(IP, [1, 2], gen=old_gen), "computed for the pod that left"
    assert store.l3_members(IP) == set()
    assert store.replace_l3(IP, [3], gen=new_gen)
    assert store.l3_members(IP) == {3}


def test_a_failed_removal_is_retried_by_the_next_reconcile(store: Store) -> None:
    """The index entry goes last, so an IP whose data is still there stays listed."""
    _register(store)
    store.r.set(keys.l1_state(IP), "not a hash")  # makes the drop script fail half-way
    with pytest.raises(redis.ResponseError):
        store.remove_instance(IP)
    assert IP in store.instance_ips()
    store.r.delete(keys.l1_state(IP))
    assert store.remove_instance(IP)
    assert IP not in store.instance_ips()


def test_touch_l3_state_is_fenced_by_generation(store: Store) -> None:
    gen = _register(store)
    store.replace_l3(IP, [1], {"updated_ms": "1"}, gen=gen)
    assert store.touch_l3_state(IP, {"updated_ms": "2"}, gen)
    assert not store.touch_l3_state(IP, {"updated_ms": "3"}, gen + 1)
    assert store.l3_state(IP)["updated_ms"] == "2" and store.l3_members(IP) == {1}


# -- direct tests of the fences and copy counts (issue 14) ---------------------------------


def test_owner_checked_write_is_still_fenced_by_generation(store: Store) -> None:
    """A lease holder writing with an old generation (the pod behind the IP changed) is
    refused: the generation is checked whether or not an owner is given."""
    old_gen = _register(store, uid="pod-a")
    assert store.claim_instance(IP, "ingester-a", 10_000)
    store.apply_batch(IP, old_gen, 0, 0, _ops(("S", "l1", [1])), owner="ingester-a")
    _, new_gen = store.upsert_instance(Instance(ip=IP, uid="pod-b"))  # a new pod, same IP
    assert store.claim_instance(IP, "ingester-a", 10_000)
    for gen in (old_gen, new_gen + 1):
        res = store.apply_batch(IP, gen, 0, 1, _ops(("S", "l1", [2])), owner="ingester-a")
        assert res.status == "stale_gen"
    assert store.tier_members(IP) == set() and store.last_seq(IP, 0) is None
    res = store.apply_batch(IP, new_gen, 0, 1, _ops(("S", "l1", [3])), owner="ingester-a")
    assert res.status == "applied" and store.tier_members(IP) == {3}


def test_owner_checked_write_after_a_container_restart_is_refused(store: Store) -> None:
    """Same pod, restarted container: the ingester that still holds the lease and the old
    generation must not write the old container's events into the new index."""
    gen = _register(store, restarts="0", dp_size=2)
    assert store.claim_instance(IP, "ingester-a", 10_000)
    store.apply_batch(IP, gen, 0, 4, _ops(("S", "l1", [1, 2])), owner="ingester-a")
    result, new_gen = store.upsert_instance(Instance(ip=IP, uid="uid-1", restarts="1", dp_size=2))
    assert result == "restarted" and new_gen > gen
    for rank, reset in ((0, False), (0, True), (1, False)):
        res = store.apply_batch(
            IP, gen, rank, 5, _ops(("S", "l1", [9])), owner="ingester-a", reset=reset
        )
        assert res.status == "stale_gen"
    assert store.tier_members(IP) == set() and store.tier_counts(IP) == {}
    assert store.l1_state(IP) == {}
    # The lease holder at the new generation writes; another holder is still refused.
    res = store.apply_batch(IP, new_gen, 0, 0, _ops(("S", "l1", [5])), owner="ingester-b")
    assert res.status == "not_owner"
    assert (
        store.apply_batch(IP, new_gen, 0, 0, _ops(("S", "l1", [5])), owner="ingester-a").status
        == "applied"
    )
    assert store.tier_members(IP) == {5}


@pytest.mark.parametrize("how", ["reset", "all_blocks_cleared"])
def test_clearing_a_rank_subtracts_exactly_its_own_copies(store: Store, how: str) -> None:
    """Hash 7 is held twice by rank 0 and once by rank 1 (DP ranks share the instance's
    set): clearing rank 0 must subtract its two copies, leaving rank 1's one."""
    gen = _register(store, dp_size=2)
    store.apply_batch(
        IP, gen, 0, 0, _ops(("S", "l1", [7, 8]), ("S", "l1", [7]), ("S", "l2", [5, 5]))
    )
    store.apply_batch(IP, gen, 1, 0, _ops(("S", "l1", [7]), ("S", "l2", [5])))
    assert store.tier_counts(IP) == {7: 3, 8: 1}
    assert store.tier_counts(IP, "l2") == {5: 3}
    if how == "reset":
        res = store.apply_batch(IP, gen, 0, 0, TierOps(), reset=True)
    else:
        res = store.apply_batch(IP, gen, 0, 1, _ops(("C", "l1", []), ("C", "l2", [])))
    assert res.status == "applied"
    assert store.tier_counts(IP) == {7: 1} and store.tier_members(IP) == {7}
    assert store.tier_counts(IP, "l2") == {5: 1} and store.tier_members(IP, "l2") == {5}
    # Rank 1 removes its copy: nothing is left, and nothing went negative.
    res = store.apply_batch(IP, gen, 1, 1, _ops(("R", "l1", [7]), ("R", "l2", [5])))
    assert res.unknown_removes == 0
    assert store.tier_counts(IP) == {} and store.tier_members(IP) == set()
    assert store.tier_members(IP, "l2") == set()
    # Rank 0's cleared copies are gone for good: removing them again is "unknown".
    res = store.apply_batch(IP, gen, 0, 2, _ops(("R", "l1", [7, 7, 8])))
    assert res.unknown_removes == 3


def test_resetting_the_other_rank_keeps_a_duplicate_held_twice(store: Store) -> None:
    gen = _register(store, dp_size=2)
    store.apply_batch(IP, gen, 0, 0, _ops(("S", "l1", [7, 7])))
    store.apply_batch(IP, gen, 1, 0, _ops(("S", "l1", [7])))
    store.apply_batch(IP, gen, 1, 0, TierOps(), reset=True)
    assert store.tier_counts(IP) == {7: 2}
    store.apply_batch(IP, gen, 0, 1, _ops(("R", "l1", [7])))
    assert store.tier_counts(IP) == {7: 1} and store.tier_members(IP) == {7}


def test_generation_never_goes_back_when_the_server_clock_does(store: Store) -> None:
    """The next generation is above the last one even if Redis's clock is behind it (a
    server restarted on a host with a slower clock, or two changes in one millisecond)."""
    _register(store, restarts="0")
    far = 10**15  # ~ year 33658 in ms: above any clock reading
    store.r.set(keys.instance_gen(IP), str(far))
    store.r.hset(keys.instance_meta(IP), "gen", str(far))
    result, gen = store.upsert_instance(Instance(ip=IP, uid="uid-1", restarts="1"))
    assert result == "restarted" and gen == far + 1
    assert store.remove_instance(IP)
    assert _register(store) == far + 3  # removal took far + 2


def test_removed_copies_leave_no_per_rank_entries(store: Store) -> None:
    """A hash whose copies were removed is gone from the sparse copy counts too (no zero
    entries piling up for the life of the pod), on rank 0 and on another rank."""
    gen = _register(store)
    store.apply_batch(IP, gen, 0, 0, _ops(("S", "l1", [7, 7, 8]), ("S", "l2", [9])))
    store.apply_batch(IP, gen, 1, 0, _ops(("S", "l1", [8]), ("S", "l2", [9])))
    assert store.r.exists(keys.tier_copies(IP, "l1"), keys.tier_copies(IP, "l2")) == 2
    store.apply_batch(IP, gen, 0, 1, _ops(("R", "l1", [7, 8, 7]), ("R", "l2", [9])))
    store.apply_batch(IP, gen, 1, 1, _ops(("R", "l1", [8]), ("R", "l2", [9])))
    for tier in ("l1", "l2"):
        assert store.tier_members(IP, tier) == set(), tier
        assert not store.r.exists(keys.tier_copies(IP, tier)), tier


def test_renewing_a_lease_extends_it_and_only_its_holder_releases_it(store: Store) -> None:
    assert store.claim_instance(IP, "ingester-a", 1_000)
    assert store.claim_instance(IP, "ingester-a", 600_000), "renewal by the holder"
    assert store.r.pttl(keys.l1_owner(IP)) > 1_000, "the renewal extended the lease"
    assert not store.release_instance(IP, "ingester-b")
    assert not store.claim_instance(IP, "ingester-b", 1_000)
    assert store.release_instance(IP, "ingester-a")
    assert store.claim_instance(IP, "ingester-b", 1_000)


def test_instance_round_trips_through_the_registry(store: Store) -> None:
    inst = Instance(
        ip=IP,
        uid="u-1",
        pod="vllm-0",
        zmq_endpoint="tcp://10.0.0.5:5557",
        replay_endpoint="tcp://10.0.0.5:5558",
        dp_size=4,
        role="prefill",
        restarts="3",
    )
    _, gen = store.upsert_instance(inst)
    assert store.get_instance(IP) == dataclasses.replace(inst, gen=gen)
    assert store.list_instances() == [dataclasses.replace(inst, gen=gen)]
    assert store.get_instance("10.9.9.9") is None
    # Fields a registry entry lacks (or holds empty) read as the defaults.
    assert Instance.from_meta(IP, {}) == Instance(ip=IP, uid="")
    assert Instance.from_meta(IP, {"dp": "", "gen": "", "uid": "u"}) == Instance(ip=IP, uid="u")


def test_writes_use_exactly_the_documented_keys(store: Store) -> None:
    """Every key an instance's writes create is one that common.keys spells."""
    gen = _register(store, dp_size=2)
    store.apply_batch(IP, gen, 0, 0, _ops(("S", "l1", [1]), ("S", "l2", [2])), gap=True)
    store.apply_batch(IP, gen, 1, 0, _ops(("S", "l1", [3]), ("S", "l2", [4])))
    store.replace_l3(IP, [5], {"master": "m"}, gen=gen)
    store.claim_instance(IP, "ing", 10_000)
    ops = TierOps()
    ops.describe(2, "sliding_window", 16, 64)
    ops.store("l1", [6, 6], group=2)
    store.apply_batch(IP, gen, 0, 1, ops)
    store.replace_l3(IP, {0: [5], 3: [7]}, {"master": "m"}, gen=gen)
    expected = {
        keys.INSTANCES,
        keys.instance_meta(IP),
        keys.instance_gen(IP),
        keys.l1_state(IP),
        keys.l1_owner(IP),
        keys.l3_set(IP),
        keys.l3_state(IP),
        keys.l1_groups(IP),
        keys.tier_group_set(IP, "l1", 2),
        keys.tier_group_copies(IP, "l1", 2),
        keys.l3_group_set(IP, 3),
    }
    for tier in ("l1", "l2"):  # rank 1's copies: the sparse copies hash, no per-rank keys
        expected |= {keys.tier_set(IP, tier), keys.tier_copies(IP, tier)}
    assert {k.decode() for k in store.r.keys("*")} == expected
    assert store.r.hgetall(keys.tier_copies(IP, "l2")) == {b"4": b"0,1"}
