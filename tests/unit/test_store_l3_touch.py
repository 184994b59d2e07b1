"""``Store.touch_l3_state`` with no state fields: the L3 writer's check, after a poll in
which no master answered, that the set it last wrote is still the stored one.

Issue 33 (mutation testing of ``common/store.py``): the early return for "nothing to write,
nothing to check" taken whenever no field is given (so the writer's token check never ran:
every such poll counted a lost set and rewrote it) or answering True, passed the suite.
"""

from __future__ import annotations

from common.store import Instance, Store

IP = "10.0.0.7"


def test_the_written_token_alone_is_checked_and_nothing_else_is_written(any_store: Store) -> None:
    store = any_store
    _, gen = store.upsert_instance(Instance(ip=IP, uid="u"))
    assert store.replace_l3(IP, [1, 2], {"updated_ms": "5", "written": "tok-1"}, gen=gen)
    before = store.l3_state(IP)
    assert store.touch_l3_state(IP, {}, gen, "tok-1")  # still the set the writer wrote
    assert not store.touch_l3_state(IP, {}, gen, "tok-0")  # another write's token: lost
    assert not store.touch_l3_state(IP, {}, gen + 1, "tok-1")  # a new generation
    assert store.l3_state(IP) == before and store.l3_members(IP) == {1, 2}


def test_nothing_to_write_and_nothing_to_check_is_not_a_touch(any_store: Store) -> None:
    store = any_store
    _, gen = store.upsert_instance(Instance(ip=IP, uid="u"))
    assert store.replace_l3(IP, [1], {"updated_ms": "5", "written": "tok-1"}, gen=gen)
    assert store.touch_l3_state(IP, {}, gen) is False
    assert store.touch_l3_state(IP, {"updated_ms": "6"}, gen) is True
    assert store.l3_state(IP)["updated_ms"] == "6"
