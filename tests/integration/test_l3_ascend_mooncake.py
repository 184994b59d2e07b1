"""vllm-ascend end to end on a real ``mooncake_master``: two store clients (one per pod IP,
each keeping its keys on its own segment) hold AscendStoreConnector keys — a TP2 normal
deployment and a TP2 layer-wise one, with one head's or one layer's key missing — and
``POST /kv-cache/hit-rate`` answers the engine lookup's prefix. The scenario is
tests/integration/ascend_mooncake_driver.py, run under ``unshare -n``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.conftest import mooncake_missing, require
from tests.integration import netns

pytestmark = pytest.mark.mooncake

DRIVER = Path(__file__).with_name("ascend_mooncake_driver.py")
A, B, C = "127.0.0.2", "127.0.0.3", "127.0.0.4"


@pytest.fixture(scope="module")
def run() -> dict[str, Any]:
    reason = mooncake_missing()
    require(reason is None, f"the Mooncake side cannot run: {reason}")
    return netns.last_result(DRIVER, 180)


def test_every_put_succeeded(run: dict[str, Any]) -> None:
    assert {r["setup"] for r in run["setup"].values()} == {0}
    assert set(run["puts"] + run["remove"] + run["put_missing"]) == {0}


def test_tp2_normal_block_missing_one_head_ends_the_prefix(run: dict[str, Any]) -> None:
    assert run["p1"] == {A: 5 / 8, B: 0.0, C: 0.0}


def test_tp2_layerwise_block_missing_one_layer_ends_the_prefix(run: dict[str, Any]) -> None:
    assert run["p2"] == {A: 0.0, B: 3 / 6, C: 0.0}
    assert run["p2_after"] == {A: 0.0, B: 1.0, C: 0.0}  # the layer arrived


def test_layer_id_after_the_hash(run: dict[str, Any]) -> None:
    assert run["p4"] == {A: 1.0, B: 0.0, C: 0.0}


def test_heads_on_two_pods_count_for_both_until_one_goes(run: dict[str, Any]) -> None:
    assert run["p3"] == {A: 1.0, B: 1.0, C: 0.0}
    assert run["p3_after"] == {A: 1 / 4, B: 1 / 4, C: 0.0}


def test_master_status_counts_the_unparsed_key(run: dict[str, Any]) -> None:
    state = run["master_state"]
    # p1 (one key missing), p2 (its missing layer arrived), p4, p3 (one key removed), junk
    n_keys = (8 * 2 - 1) + 6 * 2 * 6 + 4 * 2 * 6 + (4 * 2 - 1) + 1
    assert state["keys"] == str(n_keys)
    assert state["keys_unparsed"] == "1"
    assert state["sample_unparsed"] == "some-other-tool@v1@not-a-block"
    assert state["blocks"] == str(7 + 6 + 3 + 4)  # p1 (all but block 5), p2, p3, p4
    assert (state["stale"], state["error"]) == ("0", "")
    assert run["unparsed_gauge"] == 1
