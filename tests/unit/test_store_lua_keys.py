"""The instance scripts' KEYS bundle is named once (``common.store_lua.INSTANCE_KEYS``): the
store builds it from that table, and the scripts read it only through the names bound from
it, so no script, and no Python call, depends on a position written anywhere else."""

from __future__ import annotations

import re

from common import store, store_lua

INSTANCE_SCRIPTS = {
    "UPSERT_INSTANCE": store_lua.UPSERT_INSTANCE,
    "REMOVE_INSTANCE": store_lua.REMOVE_INSTANCE,
    "APPLY_BATCH": store_lua.APPLY_BATCH,
    "L1_STATUS": store_lua.L1_STATUS,
    "REPLACE_L3": store_lua.REPLACE_L3,
    "TOUCH_L3": store_lua.TOUCH_L3,
}


def test_the_store_builds_the_bundle_from_the_table() -> None:
    assert list(store._INSTANCE_KEY) == list(store_lua.INSTANCE_KEYS)
    bundle = store._instance_keys("10.0.0.5")
    assert len(bundle) == len(store_lua.INSTANCE_KEYS) == len(set(bundle))
    assert bundle[store_lua.INSTANCE_KEYS.index("l1_owner")] == store.keys.l1_owner("10.0.0.5")


def test_instance_scripts_use_only_the_named_keys() -> None:
    names = set(store_lua.INSTANCE_KEYS)
    for name, script in INSTANCE_SCRIPTS.items():
        assert script.startswith(store_lua._KEYS), name
        body = script[len(store_lua._KEYS) :]
        assert "KEYS[" not in body, f"{name} spells a KEYS position"
        used = set(re.findall(r"\bK\.(\w+)", body))
        assert used and used <= names, f"{name} uses unknown keys {used - names}"


def test_the_preamble_binds_every_name_to_its_position() -> None:
    bound = dict(re.findall(r"(\w+) = KEYS\[(\d+)\]", store_lua._KEYS))
    assert [bound[n] for n in store_lua.INSTANCE_KEYS] == [
        str(i) for i in range(1, len(store_lua.INSTANCE_KEYS) + 1)
    ]
