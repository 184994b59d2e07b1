"""The ingester's per-instance status: fenced writes to the L1 state hash (fakeredis and a real
server), counters sent as increments exactly once, and the self-check's mismatch hold."""

from __future__ import annotations

from common.blockhash import BlockHasher, HashSettings
from common.status_report import ConnState
from common.store import Instance, L1Status, Store
from services.l1_ingest.hashcheck import MISMATCH, MISMATCH_HOLD, OK, HashChecker
from services.l1_ingest.status import InstanceStatus, worst
from services.simulator.cache_model import PrefixCacheModel, Request

IP = "10.0.0.7"


def _status(gen: int, owner: str = "", **fields: str) -> L1Status:
    return L1Status(IP, gen, owner, {"conn": "connected", **fields}, {"hash_check_ok": 2})


def test_status_writes_are_fenced_by_generation_and_owner(any_store: Store) -> None:
    _, gen = any_store.upsert_instance(Instance(IP, "uid-1"))
    assert any_store.write_l1_status([_status(gen)]) == [True]
    assert any_store.write_l1_status([_status(gen + 1)]) == [False]  # an old pod's ingester
    assert any_store.claim_instance(IP, "ing-a", 60_000)
    assert any_store.write_l1_status([_status(gen, "ing-b"), _status(gen, "ing-a")]) == [
        False,
        True,
    ]
    state = any_store.l1_state(IP)
    assert state["conn"] == "connected" and state["hash_check_ok"] == "4"
    any_store.remove_instance(IP)
    assert any_store.write_l1_status([_status(gen)]) == [False]
    assert any_store.l1_state(IP) == {}


def test_restart_drops_the_status_with_the_index(any_store: Store) -> None:
    _, gen = any_store.upsert_instance(Instance(IP, "uid-1"))
    any_store.write_l1_status([_status(gen, hash_check="mismatch")])
    any_store.upsert_instance(Instance(IP, "uid-1", restarts="1"))
    assert "hash_check" not in any_store.l1_state(IP)


def _events(seed: str) -> list[object]:
    hasher = BlockHasher(HashSettings(seed=seed))
    return list(PrefixCacheModel(16, 16, hasher).step([Request(tuple(range(48)))]))


def test_counters_are_increments_and_resent_until_acked() -> None:
    checker = HashChecker(IP, HashSettings(), 1000)
    status = InstanceStatus(Instance(IP, "u", gen=3), checker)
    checker.offer(_events("0"))  # type: ignore[arg-type]
    first = status.update("", "ing", "connected", "", False)
    assert first.incr == {"hash_check_ok": 3, "hash_check_mismatch": 0}
    assert "last_event_ms" not in first.fields  # no batch counted yet
    status.batches += 1
    again = status.update("", "ing", "connected", "", False)  # the first write failed
    assert again.incr["hash_check_ok"] == 3 and "last_event_ms" in again.fields
    status.acked()
    assert status.update("", "ing", "connected", "", False).incr["hash_check_ok"] == 0
    off = InstanceStatus(Instance(IP, "u"), None).update("", "ing", "connected", "", False)
    assert off.fields["hash_check"] == "unchecked" and "off" in off.fields["hash_check_detail"]


def test_mismatch_holds_then_ok_returns() -> None:
    now = [0.0]
    checker = HashChecker(IP, HashSettings(), 1000, clock=lambda: now[0])
    checker.offer(_events("1"))  # type: ignore[arg-type]
    assert checker.verdict == MISMATCH
    now[0] += 1
    checker.offer(_events("0"))  # type: ignore[arg-type]
    assert checker.verdict == MISMATCH and checker.ok == 3
    now[0] += MISMATCH_HOLD
    checker.offer(_events("0"))  # type: ignore[arg-type]
    assert checker.verdict == OK


def test_worst_connection_state() -> None:
    c = ConnState
    assert worst([c.CONNECTED, c.UNREACHABLE, c.CONNECTING]) is c.UNREACHABLE
    assert worst([c.CONNECTED, c.RETRYING, c.DISCONNECTED]) is c.RETRYING
    assert worst([c.CONNECTED]) is c.CONNECTED
    assert worst([]) is c.CONNECTING
