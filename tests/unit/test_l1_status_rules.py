"""The L1 status rules beyond the single-rank happy path: the status script's generation fence
for the lease owner itself, and an instance that delivered batches and then went quiet.
(A gap kept on DP rank >= 1: ``tests/services/test_l1_rank_stream.py``.)"""

from __future__ import annotations

from common import keys
from common.status_report import InstanceState, Limits, Raw, StatusReader, l1_state
from common.store import Instance, L1Status, Store
from services.l1_ingest.status import InstanceStatus
from tests.conftest import wait_for

IP = "10.0.0.8"
OWNER = "ing-a"


def test_the_owners_status_for_an_older_generation_is_refused(any_store: Store) -> None:
    """Issue 21, behaviour 1: vLLM restarted (new generation) while the ingester kept the
    lease; a status still computed for the old generation must not touch the new one's state
    (verdict, detail, counters), exactly as the batch script refuses its batches."""
    _, old = any_store.upsert_instance(Instance(IP, "uid-1"))
    assert any_store.claim_instance(IP, OWNER, 60_000)
    _, new = any_store.upsert_instance(Instance(IP, "uid-1", restarts="1"))  # vLLM restarted
    assert new > old and any_store.r.get(keys.l1_owner(IP)) == OWNER.encode()  # still held
    fresh = L1Status(
        IP,
        new,
        OWNER,
        {"conn": "connected", "hash_check": "ok", "hash_check_detail": "3 blocks verified"},
        {"hash_check_ok": 3, "hash_check_mismatch": 0},
    )
    assert any_store.write_l1_status([fresh]) == [True]
    before = any_store.l1_state(IP)
    stale = L1Status(
        IP,
        old,
        OWNER,
        {"conn": "connected", "hash_check": "mismatch", "hash_check_detail": "from the old engine"},
        {"hash_check_ok": 40, "hash_check_mismatch": 7},
    )
    assert any_store.write_l1_status([stale]) == [False]
    after = any_store.l1_state(IP)
    assert after == before
    assert (after["hash_check"], after["hash_check_detail"]) == ("ok", "3 blocks verified")
    assert (after["hash_check_ok"], after["hash_check_mismatch"]) == ("3", "0")
    # the owner's write for the current generation still lands
    assert any_store.write_l1_status([fresh]) == [True]
    assert any_store.l1_state(IP)["hash_check_ok"] == "6"


HOUR_MS = 3_600_000


def test_an_instance_that_went_quiet_keeps_its_last_event_and_turns_no_events(
    any_store: Store,
) -> None:
    """Issue 21, behaviour 5: batches arrived, then nothing. The status keeps reporting the
    last batch's time (not the subscription's, not the status write's), and the state is
    ``no_events`` once that is older than ``noEventsAfter``. The subscription is an hour old
    and ``noEventsAfter`` a minute, so either stamp taken for the other shows."""
    _, gen = any_store.upsert_instance(Instance(IP, "uid-1"))
    status = InstanceStatus(Instance(IP, "uid-1", gen=gen), None)
    status.subscribed_ms -= HOUR_MS  # followed for an hour
    status.batches += 3  # the rank streams counted three batches
    first = status.update("", "ing-1", "connected", "tcp://x:5557", False)
    assert any_store.write_l1_status([first]) == [True]
    last_event = int(first.fields["last_event_ms"])

    def quiet_round() -> L1Status | None:  # the ingester keeps reporting; nothing arrives
        update = status.update("", "ing-1", "connected", "tcp://x:5557", False)
        assert any_store.write_l1_status([update]) == [True]
        return update if int(update.fields["status_ms"]) > last_event else None

    wait_for(quiet_round, what="a status round after the last batch")
    raw = StatusReader(any_store.r).read()
    l1 = raw.instances[IP]["l1"]
    assert int(l1["last_event_ms"]) == last_event < int(l1["status_ms"])

    limits = Limits(no_events_after=60, lease_ttl=HOUR_MS / 1000)  # status stays fresh

    def at(offset_s: float) -> tuple[InstanceState, str]:  # the reader's clock, injected
        return l1_state(l1, None, Raw(last_event + int(offset_s * 1000), {}), limits)

    assert at(0)[0] is InstanceState.SYNCED
    assert at(59)[0] is InstanceState.SYNCED
    state, why = at(61)
    assert state is InstanceState.NO_EVENTS
    assert why == "no batch for 61s (noEventsAfter 60s)"
