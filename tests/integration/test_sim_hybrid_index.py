"""Hybrid-shaped simulators through the real L1 ingester (ZMQ, redis-server) and the API app:
every served prompt's answer is the simulator's own truth, vLLM's rule over what each of its
KV-cache groups holds (evictions, sparse stores and chunked prefills included)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import falcon.testing
import orjson
import pytest
import redis

from common.blockhash import BlockHasher
from common.settings import ApiSettings
from services.api.api_metrics import ApiMetrics
from services.api.app import create_app
from services.simulator.cache_model import Request
from services.simulator.engine import SimulatedVLLM
from services.simulator.workload import Workload
from tests.conftest import reserve_ports
from tests.integration.l1_support import InProcessIngester, register, wait_quiet
from tests.store_oracle import OracleStore

IP = "127.0.0.71"


@pytest.fixture()
def sims() -> Iterator[list[SimulatedVLLM]]:
    made: list[SimulatedVLLM] = []
    yield made
    for sim in made:
        sim.close()


def _ask(client: falcon.testing.TestClient, request: Request) -> dict[str, object]:
    doc = {"server_ip": [IP], "body": {"token_ids": list(request.token_ids), "block_size": 16}}
    result = client.simulate_post(
        "/kv-cache/hit-rate", body=orjson.dumps(doc), params={"detail": "1"}
    )
    assert result.status_code == 200, result.text
    score: dict[str, object] = result.json["server_score_list"][0]
    return score


@pytest.mark.parametrize(
    ("shape", "version", "chunk"),
    [("gemma3", "0.30.0", 0), ("qwen3next", "0.28.0", 32), ("gptoss", "0.24.0", 0)],
)
def test_the_index_answers_the_simulators_hybrid_truth(
    redis_client: redis.Redis,
    ingester: Callable[..., InProcessIngester],
    sims: list[SimulatedVLLM],
    shape: str,
    version: str,
    chunk: int,
) -> None:
    store = OracleStore(redis_client)
    sim = SimulatedVLLM(
        f"tcp://*:{reserve_ports()}",
        f"tcp://*:{reserve_ports()}",
        "kv-events",
        vllm_version=version,
        num_blocks=90,
        model_shape=shape,
        prefill_chunk=chunk,
    )
    sims.append(sim)
    ingester()
    register(store, IP, sim)
    workload = Workload("mixed", prompts=10, prompt_len=120, block_size=16, seed=6)
    client = falcon.testing.TestClient(
        create_app(ApiSettings(), store, BlockHasher(ApiSettings().hash), ApiMetrics())
    )
    seen: dict[Request, None] = {}
    checked = hits = below_fa = 0
    for step in range(1, 31):
        served = [workload.next() for _ in range(3)]
        sim.serve(served)
        seen.update(dict.fromkeys(r for r in served if not r.cache_salt))
        if step % 5:
            continue
        wait_quiet(store, IP, sim)
        # Every prompt served so far (some evicted, some without their window tail) and a
        # few not served yet (shared prefixes only).
        for request in [*seen, *(workload.next() for _ in range(5))]:
            if request.cache_salt:
                continue  # salted variants hash like their engine release; asked unsalted
            want = sim.true_hit_tokens(request)
            got = _ask(client, request)
            assert got["l1_hit_tokens"] == want, (step, len(request.token_ids), got)
            checked += 1
            hits += want > 0
            below_fa += want < min(
                sim.true_prefix_len(request) * 16, (len(request.token_ids) - 1) // 16 * 16
            )
    assert sum(m.rejected for m in sim.models.values()) == 0
    assert checked > 100 and hits > 20, (checked, hits)
    assert below_fa, "some answers must be below the full-attention prefix"
