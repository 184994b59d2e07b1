"""The L3 poller with vllm-ascend keys (in-memory masters, real redis-server): segment naming
forms, scopes, layer-wise keys, key-format narrowing, and the per-master status hash."""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest

from common import keys
from common.config import Duration
from tests.conftest import wait_for
from tests.fake_master import FakeMaster
from tests.metrics_oracle import value_of
from tests.services.test_l3_poller import DIGESTS, INTS, POD_A, POD_B, POD_C, Harness
from tests.unit.test_l3_groups import rehash

MODEL = "Qwen2.5-7B-Instruct"


def akey(block: int, head: int, pp: int = 0, model: str = MODEL) -> str:
    """v0.13 – v0.19 normal key."""
    return f"{model}@pcp0@dcp0@head_or_tp_rank:{head}@pp_rank:{pp}@{DIGESTS[block].hex()}"


def lw_old(block: int, head: int, layer: int) -> str:
    """v0.20.2rc1 layer-wise key: the layer id after the hash."""
    return (
        f"{MODEL}@pcp0@dcp0@head_or_tp_rank:{head}@group:0@cache_role:kv"
        f"@cache_family:default@{DIGESTS[block].hex()}@{layer}"
    )


def lw_new(block: int, head: int, layer: int) -> str:
    """v0.21+ layer-wise key: ``layer_id:`` before the hash."""
    return (
        f"{MODEL}@pcp0@dcp0@head_or_tp_rank:{head}@group:0@cache_role:kv"
        f"@cache_family:default@layer_id:{layer}@{DIGESTS[block].hex()}"
    )


@pytest.mark.parametrize(
    ("version", "seg_a", "seg_b"),
    [
        ("0.3.13", f"{POD_A}:17001", f"{POD_B}:17002"),  # ascend_direct: {pod_ip}:{te_rpc_port}
        ("0.3.13", f"{POD_A}:12345:npu_0", f"{POD_B}:12345:npu_1"),  # old HCCL transport names
        ("0.3.10", f"{POD_A}:17001", f"{POD_B}:12345:npu_1"),  # no segments detail: by host
    ],
)
def test_tp2_normal_keys_per_segment_naming(
    harness_factory: Callable[..., Harness], version: str, seg_a: str, seg_b: str
) -> None:
    m = FakeMaster(version).start()
    try:
        ep_a, ep_b = m.mount(seg_a, seg_a), m.mount(seg_b, seg_b)
        for b in range(4):
            m.put(akey(b, 0), ep_a)  # each rank's keys on its own segment
            m.put(akey(b, 1), ep_b)
        m.put(akey(4, 0), ep_a)  # block 4: head 1 never written
        h = harness_factory()
        h.register(POD_A, POD_B, POD_C)
        h.start(m)
        h.wait_members(POD_A, set(INTS[:4]))
        h.wait_members(POD_B, set(INTS[:4]))
        assert h.members(POD_C) == set()
        m.remove(akey(1, 1))  # block 1 loses head 1: the prefix stops at block 1
        h.wait_members(POD_A, {INTS[0], INTS[2], INTS[3]})
        assert value_of(h.metrics.keys_skipped, master=m.url, reason="unparsed") == 0
    finally:
        m.stop()


@pytest.mark.parametrize("make", [lw_old, lw_new], ids=["v0.20-layer-last", "v0.21-layer-id"])
def test_layerwise_pool_scope(
    harness_factory: Callable[..., Harness],
    master: FakeMaster,
    make: Callable[[int, int, int], str],
) -> None:
    ep_a = master.mount(f"{POD_A}:17001", f"{POD_A}:17001")
    ep_b = master.mount(f"{POD_B}:17002", f"{POD_B}:17002")
    for b in range(3):
        for head in (0, 1):
            for layer in range(4):
                if (b, head, layer) != (1, 1, 3):  # block 1 misses one layer of head 1
                    master.put(make(b, head, layer), ep_a if head == 0 else ep_b)
    h = harness_factory(scope="pool")
    h.register(POD_A, POD_B, POD_C)
    h.start(master)
    h.wait_members(POD_A, {INTS[0], INTS[2]})
    h.wait_members(POD_B, {INTS[0], INTS[2]})
    assert h.members(POD_C) == set()  # no segment on this master
    assert master.calls["/batch_query_keys"] == 0


def test_key_formats_narrow_and_say_so(
    harness_factory: Callable[..., Harness], master: FakeMaster
) -> None:
    ep_a = master.mount(f"{POD_A}:17001", f"{POD_A}:17001")
    master.put(akey(0, 0), ep_a)
    h = harness_factory(key_formats=("vllm",))
    h.register(POD_A)
    h.start(master)
    wait_for(
        lambda: value_of(h.metrics.keys_skipped, master=master.url, reason="format_disabled") >= 1,
        what="the Ascend key skipped as disabled",
    )
    assert h.members(POD_A) == set()
    wait_for(lambda: h.store.get_master_state(master.url).get("keys") == "1", what="state")
    assert h.store.get_master_state(master.url)["keys_unparsed"] == "0"


def test_master_state_hash(
    harness_factory: Callable[..., Harness], master: FakeMaster, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="services.l3_poller")
    ep_a = master.mount(f"{POD_A}:17001", f"{POD_A}:17001")
    for b in range(3):
        master.put(akey(b, 0), ep_a)
    junk = "lmcache@Qwen@1@0@" + "z" * 300
    master.put(junk, ep_a)
    h = harness_factory(stale_after=Duration(1.0), http_timeout=Duration(0.3))
    h.register(POD_A)
    h.start(master)
    h.wait_members(POD_A, set(INTS[:3]))
    state = wait_for(
        lambda: s if (s := h.store.get_master_state(master.url)).get("keys") == "4" else None,
        what="the master's status",
    )
    assert set(state) == {
        "keys",
        "keys_unparsed",
        "sample_unparsed",
        "keys_unmappable_group",
        "blocks",
        "updated_ms",
        "stale",
        "error",
    }
    assert (
        state["keys_unparsed"],
        state["keys_unmappable_group"],
        state["blocks"],
        state["stale"],
        state["error"],
    ) == ("1", "0", "3", "0", "")
    assert state["sample_unparsed"] == junk[:200]
    assert int(state["updated_ms"]) > 1_600_000_000_000
    assert value_of(h.metrics.keys_unparsed, master=master.url) == 1
    warned = [r for r in caplog.records if "no known key family" in r.getMessage()]
    assert len(warned) == 1 and "lmcache@Qwen" in warned[0].getMessage()
    master.remove(junk)
    wait_for(
        lambda: h.store.get_master_state(master.url)["keys_unparsed"] == "0",
        what="unparsed back to 0",
    )
    assert h.store.get_master_state(master.url)["sample_unparsed"] == ""
    master.fault = "503"  # failing: error shown, last good counts kept, then stale
    failing = wait_for(
        lambda: s if (s := h.store.get_master_state(master.url))["error"] else None,
        what="error in the status",
    )
    assert "503" in failing["error"] and failing["keys"] == "3" and failing["stale"] == "0"
    wait_for(lambda: h.store.get_master_state(master.url)["stale"] == "1", what="stale")
    assert h.store.get_master_state(master.url)["blocks"] == "0"
    master.fault = None
    wait_for(lambda: h.store.get_master_state(master.url)["error"] == "", what="recovered")
    assert h.store.get_master_state(master.url)["stale"] == "0"
    h.store.set_masters({})  # retired: its status goes
    wait_for(lambda: not h.store.r.exists(keys.master_state(master.url)), what="status gone")


def ckey(block_hex: str, head: int, group: int, family: str = "default") -> str:
    """v0.20.2rc1 – main normal key of one KV-cache group."""
    return (
        f"{MODEL}@pcp0@dcp0@head_or_tp_rank:{head}@pp_rank:0@group:{group}"
        f"@cache_role:kv@cache_family:{family}@{block_hex}"
    )


def hybrid_keys(ep: str, release: str) -> dict[str, tuple[str, ...]]:
    """TP2; group 0 at hash unit 16 (blocks 0–7), group 1 at block 64 (k = 4): main writes
    its blocks' last sub-hash, v0.21–v0.24 a sha256 rehash of the four."""
    out = {ckey(DIGESTS[b].hex(), head, 0): (ep,) for b in range(8) for head in (0, 1)}
    for j in (0, 1):
        sub = DIGESTS[4 * j : 4 * j + 4]
        coarse = sub[-1].hex() if release == "main" else rehash(sub).hex()
        out |= {ckey(coarse, head, 1, "c4"): (ep,) for head in (0, 1)}
    return out


def test_main_hybrid_groups_and_an_unmappable_release(
    harness_factory: Callable[..., Harness], master: FakeMaster, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="services.l3_poller")
    ep = master.mount(f"{POD_A}:17001", f"{POD_A}:17001")
    master.set_keys(hybrid_keys(ep, "main"))
    h = harness_factory()
    h.register(POD_A)
    h.start(master)
    h.wait_members(POD_A, set(INTS[:8]))
    wait_for(lambda: h.store.l3_members(POD_A, 1) == {INTS[3], INTS[7]}, what="group 1")
    state = wait_for(
        lambda: s if (s := h.store.get_master_state(master.url)).get("keys") == "20" else None,
        what="the master's status",
    )
    assert (state["keys_unmappable_group"], state["blocks"]) == ("0", "10")
    # the same model on v0.21–v0.24: group 1 is a rehash; nothing is guessed
    master.set_keys(hybrid_keys(ep, "v0.23.0"))
    h.wait_members(POD_A, set())
    assert h.store.l3_members(POD_A, 1) == set()
    state = wait_for(
        lambda: (
            s
            if (s := h.store.get_master_state(master.url)).get("keys_unmappable_group") == "20"
            else None
        ),
        what="unmappable keys in the status",
    )
    assert (state["keys_unparsed"], state["blocks"]) == ("0", "0")
    assert value_of(h.metrics.keys_unmappable_group, master=master.url) == 20
    warned = [r.getMessage() for r in caplog.records if "share no block hash" in r.getMessage()]
    assert len(warned) == 1 and f"{MODEL} group 1" in warned[0]
    master.set_keys(hybrid_keys(ep, "main"))
    wait_for(
        lambda: h.store.get_master_state(master.url)["keys_unmappable_group"] == "0",
        what="mappable again",
    )
    h.wait_members(POD_A, set(INTS[:8]))
    assert value_of(h.metrics.keys_unmappable_group, master=master.url) == 0
