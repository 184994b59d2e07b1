"""The instance scripts' KEYS bundle is named once (``common.store_lua.INSTANCE_KEYS``): the
store builds it from that table, and the scripts read it only through the names bound from
it, so no script, and no Python call, depends on a position written anywhere else."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

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


# The replies unpacked by name: the field names are written once, next to the script
# (``store_lua.<SCRIPT>_REPLY``), and every table the script returns has exactly that many
# entries.
REPLIES = {
    "UPSERT_INSTANCE": (store_lua.UPSERT_INSTANCE, store_lua.UPSERT_INSTANCE_REPLY),
    "APPLY_BATCH": (store_lua.APPLY_BATCH, store_lua.APPLY_BATCH_REPLY),
}


def _returned_tables(script: str) -> list[list[str]]:
    body = script[len(store_lua._COMMON) :]
    return [
        [part.strip() for part in table.split(",")]
        for table in re.findall(r"\breturn \{([^{}]*)\}", body)
    ]


def test_every_returned_table_has_the_named_fields() -> None:
    for name, (script, fields) in REPLIES.items():
        assert script.startswith(store_lua._COMMON), name
        tables = _returned_tables(script)
        assert tables, f"{name} returns no table"
        for table in tables:
            assert len(table) == len(fields), f"{name} returns {table}, named {fields}"


def test_the_apply_result_has_the_fields_of_the_reply() -> None:
    names = [f.name for f in dataclasses.fields(store.ApplyResult)]
    assert names == list(store_lua.APPLY_BATCH_REPLY)
    assert f"{{{', '.join(store_lua.APPLY_BATCH_REPLY)}}}" in store_lua.APPLY_BATCH  # its comment


def test_the_replies_have_the_named_length_on_a_server(any_store: Any) -> None:
    ip = "10.0.0.5"
    bundle, prefixes = store._instance_keys(ip), store._rank_prefixes(ip)
    upsert = any_store._upsert(keys=bundle, args=[*prefixes, "u1", "0"])
    assert len(upsert) == len(store_lua.UPSERT_INSTANCE_REPLY)
    # generation 0 is never current: refused, still a whole reply
    apply = any_store._apply(keys=bundle, args=[*prefixes, 0, "", 0, 1, "0", "0", "*", "", ""])
    assert len(apply) == len(store_lua.APPLY_BATCH_REPLY)
    assert int(apply[0]) == -1
