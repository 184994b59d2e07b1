"""No silent zeros: the hash self-check, the L1 states and the masters' key counts, end to end
over real ZMQ publishers (the simulator, and frames captured from vLLM's own publisher), a real
redis-server and the ingester (in-process, or a process killed to leave its instance unowned).
"""

from __future__ import annotations

import json
import signal
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import zmq

from common import keys
from common.blockhash import HashSettings
from common.events import AllBlocksCleared, encode_batch
from common.status_report import Limits, StatusReader, build_report
from common.store import Instance
from services.simulator.cache_model import Request
from services.simulator.engine import SimulatedVLLM
from tests.conftest import DATA, reserve_port, wait_for
from tests.integration.l1_support import (
    InProcessIngester,
    register,
    spawn_ingester,
    write_config,
)
from tests.store_oracle import OracleStore

LIMITS = Limits(no_events_after=1.0, lease_ttl=1.0)


@pytest.fixture()
def make_sim() -> Iterator[Callable[..., SimulatedVLLM]]:
    sims: list[SimulatedVLLM] = []

    def make(version: str = "0.28.0", **kw: Any) -> SimulatedVLLM:
        sim = SimulatedVLLM(
            f"tcp://*:{reserve_port()}",
            f"tcp://*:{reserve_port()}",
            "kv-events",
            vllm_version=version,
            num_blocks=64,
            **kw,
        )
        sims.append(sim)
        return sim

    yield make
    for sim in sims:
        sim.close()


def report_of(client: redis.Redis, ip: str) -> dict[str, Any]:
    doc = build_report(StatusReader(client).read(), LIMITS)
    return next(i for i in doc["instances"] if i["server_ip"] == ip)


def serve_prompts(sim: SimulatedVLLM, salted: bool = False) -> None:
    for n in range(4):
        tokens = tuple(range(1000 * n, 1000 * n + 70))
        sim.serve([Request(tokens, cache_salt="tenant-a" if salted else None)])
    sim.flush()


def wait_check(
    client: redis.Redis, ip: str, verdict: str, sim: SimulatedVLLM, salted: bool = False
) -> dict[str, Any]:
    def settled() -> dict[str, Any] | None:
        serve_prompts(sim, salted)  # the first batches may be lost before the SUB joins
        inst = report_of(client, ip)
        return inst if inst["l1"]["hash_check"] == verdict else None

    found: dict[str, Any] = wait_for(
        settled, timeout=20, interval=0.3, what=f"hash_check {verdict}"
    )
    return found


CASES = [  # simulated engine, config, words the detail must contain
    (
        {"hash_seed": "1"},
        {},
        "the engine hashes with pythonHashSeed '1' and sha256_cbor; "
        "the config says pythonHashSeed '0'",
    ),
    (
        {"hash_algo": "sha256"},
        {},
        "the engine hashes with pythonHashSeed '0' and sha256; "
        "the config says prefixCachingHashAlgo sha256_cbor",
    ),
    (
        {"version": "0.34.0"},
        {},
        "tagged extra keys (vLLM >= 0.31); the config says vllmVersion "
        "0.28.0 (untagged extra keys)",
    ),
    (
        {},
        {"seed": "1"},
        "the engine hashes with pythonHashSeed '0' and sha256_cbor; "
        "the config says pythonHashSeed '1'",
    ),
]


@pytest.mark.parametrize(
    ("engine", "config", "detail"), CASES, ids=["seed", "algo", "extra-key-rule", "config-seed"]
)
def test_wrong_setting_is_a_mismatch_naming_the_engine_setting(
    redis_client: redis.Redis,
    make_sim: Callable[..., SimulatedVLLM],
    ingester: Callable[..., InProcessIngester],
    engine: dict[str, str],
    config: dict[str, str],
    detail: str,
) -> None:
    sim = make_sim(**engine)
    ip = "127.0.0.61"
    settings = HashSettings.from_strings("sha256_cbor", config.get("seed", "0"), "0.28.0")
    ing = ingester(settings)
    register(ing.store, ip, sim)
    inst = wait_check(redis_client, ip, "mismatch", sim, salted="version" in engine)
    assert detail in inst["l1"]["hash_check_detail"]
    assert inst["l1"]["hash_check_mismatch"] > 0
    assert ing.count("hash_checks", result="mismatch") > 0


def test_right_config_is_ok_and_synced(
    redis_client: redis.Redis,
    make_sim: Callable[..., SimulatedVLLM],
    ingester: Callable[..., InProcessIngester],
) -> None:
    sim = make_sim("0.34.0", hash_seed="7")
    ip = "127.0.0.62"
    ing = ingester(HashSettings.from_strings("sha256_cbor", "7", "0.34.0"))
    register(ing.store, ip, sim)
    inst = wait_check(redis_client, ip, "ok", sim, salted=True)
    assert inst["l1"]["state"] == "synced" and inst["l1"]["hash_check_mismatch"] == 0
    assert inst["l1"]["hash_check_ok"] > 0 and inst["l1"]["blocks"] > 0
    assert inst["l1"]["ingester"] == "in-process"
    assert 0 <= inst["l1"]["last_event_age_s"] < 60  # seconds, not ms (a unit check, no timing)
    assert ing.count("hash_checks", result="mismatch") == 0


def test_publisher_that_never_sends_is_no_events_and_a_closed_port_unreachable(
    redis_client: redis.Redis,
    make_sim: Callable[..., SimulatedVLLM],
    ingester: Callable[..., InProcessIngester],
) -> None:
    silent = make_sim()  # listening, never publishing (no --kv-events batches)
    ing = ingester(noEventsAfter="1s")
    register(ing.store, "127.0.0.63", silent)
    closed = f"tcp://127.0.0.1:{reserve_port()}"
    ing.store.upsert_instance(Instance("127.0.0.64", "uid-closed", zmq_endpoint=closed))
    wait_for(
        lambda: report_of(redis_client, "127.0.0.63")["l1"]["state"] == "no_events",
        timeout=15,
        what="no_events",
    )
    inst = report_of(redis_client, "127.0.0.63")
    assert inst["l1"]["last_event_age_s"] is None
    assert "nothing received" in inst["l1"]["state_detail"]
    wait_for(
        lambda: report_of(redis_client, "127.0.0.64")["l1"]["state"] == "unreachable",
        timeout=15,
        what="unreachable",
    )


def test_dead_ingester_leaves_its_instance_unassigned(
    redis_server: Any,
    redis_client: redis.Redis,
    tmp_path: Path,
    make_sim: Callable[..., SimulatedVLLM],
    subprocess_env: dict[str, str],
    procs: list[subprocess.Popen[bytes]],
) -> None:
    sim = make_sim()
    ip = "127.0.0.65"
    register(OracleStore(redis_client), ip, sim)
    config = write_config(tmp_path / "c.yaml", redis_server.url)
    proc = spawn_ingester(config, subprocess_env, "--id", "doomed")
    procs.append(proc)

    def owned() -> bool:
        serve_prompts(sim)
        l1 = report_of(redis_client, ip)["l1"]
        return l1["state"] == "synced" and l1["ingester"] == "doomed"

    wait_for(owned, timeout=20, interval=0.3, what="the ingester to own the instance")
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    inst = wait_for(
        lambda: (lambda i: i if i["l1"]["state"] == "unassigned" else None)(
            report_of(redis_client, ip)
        ),
        timeout=15,
        what="unassigned",
    )
    assert "doomed" in inst["l1"]["state_detail"] or "reported" in inst["l1"]["state_detail"]


def test_unknown_l3_keys_are_counted_with_a_sample(redis_client: redis.Redis) -> None:
    store = OracleStore(redis_client)
    url = "http://127.0.0.70:9003"
    store.set_masters({url: json.dumps({"pod": "master-0"})})
    redis_client.hset(
        keys.master_state(url),
        mapping={
            "keys": "120",
            "keys_unparsed": "20",
            "sample_unparsed": "tenantX/blk/0001",
            "blocks": "25",
            "updated_ms": str(redis_client.time()[0] * 1000),
            "stale": "0",
            "error": "",
        },
    )
    store.upsert_instance(Instance("127.0.0.71", "uid-l3", pod="vllm-l3"))
    store.replace_l3(
        "127.0.0.71", [1, 2, 3], {"master": url, "blocks": "3", "stale": "0", "updated_ms": "1"}
    )
    doc = build_report(StatusReader(redis_client).read(), LIMITS)
    assert doc["masters"] == [
        {
            "url": url,
            "keys": 120,
            "keys_unparsed": 20,
            "sample_unparsed": "tenantX/blk/0001",
            "keys_unmappable_group": 0,
            "blocks": 25,
            "age_s": doc["masters"][0]["age_s"],
            "stale": False,
            "error": None,
        }
    ]
    assert doc["masters"][0]["age_s"] < 5
    (inst,) = doc["instances"]
    assert inst["l3"]["blocks"] == 3 and inst["l3"]["master"] == url
    assert inst["l3"]["age_s"] > 1000 and inst["l3"]["stale"] is False
    assert inst["l1"]["state"] == "unassigned"


# -- vLLM's own events ---------------------------------------------------------------------


def _capture() -> dict[str, Any]:
    doc = json.loads((DATA / "vllm_event_vectors.json").read_text())
    capture: dict[str, Any] = next(c for c in doc["captures"] if c["algo"] == "sha256_cbor")
    return capture


@pytest.mark.parametrize(("seed", "verdict"), [("0", "mismatch"), ("1", "ok")])
def test_vllm_published_events_through_zmq(
    redis_client: redis.Redis, ingester: Callable[..., InProcessIngester], seed: str, verdict: str
) -> None:
    """Payloads from vLLM 0.28's KVCacheManager + ZmqEventPublisher (PYTHONHASHSEED=1),
    re-sent byte for byte on a real PUB socket; the config's seed decides the verdict."""
    capture = _capture()
    port = reserve_port()
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.bind(f"tcp://127.0.0.1:{port}")
    try:
        ing = ingester(HashSettings.from_strings("sha256_cbor", seed, "0.28.0"))
        ip = "127.0.0.66"
        ing.store.upsert_instance(Instance(ip, "uid-vllm", zmq_endpoint=f"tcp://127.0.0.1:{port}"))
        seq = [0]

        def send(payload: bytes) -> None:
            pub.send_multipart([b"kv-events", seq[0].to_bytes(8, "big"), payload])
            seq[0] += 1

        warm = encode_batch(
            [AllBlocksCleared()], ts=1.0, data_parallel_rank=0, vllm_version=(0, 28, 0)
        )
        wait_for(
            lambda: send(warm) or ing.store.last_seq(ip, 0) is not None,
            timeout=15,
            interval=0.05,
            what="the ingester to join",
        )  # slow joiner (spec §1.2)
        for frame in capture["frames"]:
            send(bytes.fromhex(frame["payload_hex"]))
        wait_for(lambda: ing.store.last_seq(ip, 0) == seq[0] - 1, what="all batches applied")
        inst = wait_for(
            lambda: (lambda i: i if i["l1"]["hash_check"] == verdict else None)(
                report_of(redis_client, ip)
            ),
            timeout=10,
            what=f"hash_check {verdict}",
        )
    finally:
        pub.close(linger=0)
        ctx.term()
    if verdict == "ok":
        assert inst["l1"]["hash_check_ok"] >= 10 and inst["l1"]["hash_check_mismatch"] == 0
    else:
        assert inst["l1"]["hash_check_detail"] == (
            "the engine hashes with pythonHashSeed '1' and sha256_cbor; "
            "the config says pythonHashSeed '0'"
        )
