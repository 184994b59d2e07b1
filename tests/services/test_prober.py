"""The audit prober (services/prober) against the real API app and a real redis-server, with
fake vLLM OpenAI servers (tests/fake_openai.py) on 127.0.0.x whose stored blocks are applied
to the index as an L1 ingester would apply their events."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterator
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import httpx
import pytest
import redis

from common.blockhash import BlockHasher, HashSettings
from common.metrics import Registry
from common.settings import ApiSettings, ProberSettings
from common.store import Instance, Store, TierOps
from services.api.api_metrics import ApiMetrics
from services.api.app import create_app
from services.prober.metrics import ProberMetrics
from services.prober.probe import Outcome, Prober, Target
from services.prober.scheduler import Scheduler, targets
from tests.conftest import reserve_port, wait_for
from tests.fake_openai import FakeOpenAI
from tests.store_oracle import OracleStore

BLOCK = 16


class _Quiet(WSGIRequestHandler):
    def log_message(self, *_: object) -> None:
        pass


class _ThreadingWSGI(WSGIServer):
    daemon_threads = True

    def process_request(self, request, client_address):  # type: ignore[no-untyped-def]
        threading.Thread(target=self._one, args=(request, client_address), daemon=True).start()

    def _one(self, request, client_address):  # type: ignore[no-untyped-def]
        try:
            self.finish_request(request, client_address)
        finally:
            self.shutdown_request(request)


@pytest.fixture()
def store(redis_client: redis.Redis) -> Store:
    return OracleStore(redis_client)


@pytest.fixture()
def api(store: Store) -> Iterator[str]:
    """The real API app over the test's Redis, served on 127.0.0.1."""
    app = create_app(ApiSettings(), store, BlockHasher(HashSettings()), ApiMetrics())
    server = make_server("127.0.0.1", reserve_port(), app, _ThreadingWSGI, _Quiet)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


Engine = Callable[[str], FakeOpenAI]


@pytest.fixture()
def engine(store: Store) -> Iterator[Engine]:
    """``engine(ip)``: a fake vLLM on ``ip`` registered as an instance; its stored blocks are
    applied to the index as batches of its events."""
    started: list[FakeOpenAI] = []
    seqs = itertools.count(1)

    def _start(ip: str) -> FakeOpenAI:
        holder: dict[str, int] = {}

        def publish(hashes: list[int]) -> None:
            ops = TierOps()
            ops.store("l1", hashes)
            store.apply_batch(ip, holder["gen"], 0, next(seqs), ops)

        fake = FakeOpenAI(ip, BLOCK, publish).start()
        _, holder["gen"] = store.upsert_instance(
            Instance(ip, f"uid-{ip}", pod=f"vllm-{ip}", http_endpoint=fake.url)
        )
        started.append(fake)
        return fake

    yield _start
    for fake in started:
        fake.stop()


def _settings(api: str, **kw: object) -> ProberSettings:
    base: dict[str, object] = {
        "enabled": True,
        "api_url": api,
        "interval": 1.0,
        "concurrency": 2,
        "timeout": 10.0,
        "index_deadline": 1.5,
        "prompt_blocks": 3,
        "block_size": BLOCK,
    }
    return ProberSettings(**{**base, **kw})  # type: ignore[arg-type]


def _probe(api: str, target: Target, **kw: object):  # type: ignore[no-untyped-def]
    with httpx.Client() as client:
        return Prober(_settings(api, **kw), client).probe(target)


def _target(fake: FakeOpenAI, ip: str) -> Target:
    return Target(ip, fake.url, BLOCK, BLOCK)


def test_a_correct_index_is_exact_and_the_probe_is_fresh_and_salted(
    api: str, engine: Engine
) -> None:
    fake = engine("127.0.0.2")
    result = _probe(api, _target(fake, "127.0.0.2"))
    assert result.outcome is Outcome.EXACT, result
    assert result.predicted == result.realized == 3 * BLOCK
    first, second = fake.completions
    assert first["prompt"] == second["prompt"] and len(first["prompt"]) == 3 * BLOCK + 1
    assert first["cache_salt"] == "cache-indexer-probe" and first["max_tokens"] == 1
    again = _probe(api, _target(fake, "127.0.0.2"))
    assert again.outcome is Outcome.EXACT
    assert fake.completions[2]["prompt"] != first["prompt"]  # a fresh prompt every probe


def test_an_engine_reusing_less_than_the_answer_is_over(api: str, engine: Engine) -> None:
    fake = engine("127.0.0.2")
    fake.cached_bias = -BLOCK
    result = _probe(api, _target(fake, "127.0.0.2"))
    assert result.outcome is Outcome.OVER, result
    assert (result.predicted, result.realized) == (3 * BLOCK, 2 * BLOCK)


def test_blocks_whose_events_were_lost_are_under(api: str, engine: Engine) -> None:
    fake = engine("127.0.0.2")
    fake.publish_limit = 2  # the index learns 2 of the prompt's 3 blocks
    result = _probe(api, _target(fake, "127.0.0.2"))
    assert result.outcome is Outcome.UNDER, result
    assert (result.predicted, result.realized) == (2 * BLOCK, 3 * BLOCK)


def test_events_that_never_reach_the_index_are_events_missing(api: str, engine: Engine) -> None:
    fake = engine("127.0.0.2")
    fake.publish_events = False
    result = _probe(api, _target(fake, "127.0.0.2"))
    assert result.outcome is Outcome.EVENTS_MISSING, result
    assert "1.5s" in result.detail and len(fake.completions) == 1  # no question was audited


def test_engine_faults_are_outcomes(api: str, engine: Engine) -> None:
    fake = engine("127.0.0.2")
    target = _target(fake, "127.0.0.2")
    fake.status = 503
    assert _probe(api, target).outcome is Outcome.ENGINE_ERROR
    fake.status, fake.details = 200, False
    result = _probe(api, target, model="fake-model")
    assert result.outcome is Outcome.NO_CACHED_TOKENS and "prompt-tokens-details" in result.detail
    fake.details, fake.delay = True, 2.0
    assert _probe(api, target, timeout=1.0).outcome is Outcome.TIMEOUT
    fake.delay = 0.0
    assert _probe(api, target, model="other").outcome is Outcome.ENGINE_ERROR  # 404 model
    refused = Target("127.0.0.3", f"http://127.0.0.3:{reserve_port()}", BLOCK, BLOCK)
    assert _probe(api, refused).outcome is Outcome.ENGINE_ERROR
    assert _probe(api, Target("127.0.0.4", "", BLOCK, BLOCK)).outcome is Outcome.NO_ENDPOINT


def test_an_unreachable_api_is_an_api_error(engine: Engine) -> None:
    fake = engine("127.0.0.2")
    result = _probe(f"http://127.0.0.1:{reserve_port()}", _target(fake, "127.0.0.2"))
    assert result.outcome is Outcome.API_ERROR and "hit-rate" in result.detail


def test_targets_take_the_block_size_the_index_learned() -> None:
    doc = {
        "instances": [
            {"server_ip": "10.0.0.1", "http": "http://10.0.0.1:8000/", "groups": {}},
            {
                "server_ip": "10.0.0.2",
                "http": None,
                "groups": {
                    "hash_unit": 32,
                    "kv_cache_groups": [{"block_size": 32}, {"block_size": 64}],
                },
            },
            {"pod": "no ip"},
            "garbage",
        ]
    }
    a, b = targets(doc, ProberSettings(block_size=16))
    assert a == Target("10.0.0.1", "http://10.0.0.1:8000", 16, 16)
    assert b == Target("10.0.0.2", "", 32, 64)
    assert targets({"instances": None}, ProberSettings()) == []


def _count(registry: Registry, name: str, **labels: str) -> float:
    value = registry.collector.get_sample_value(name, labels or None)
    return value or 0.0


def test_the_loop_probes_each_instance_once_per_interval_and_survives_faults(
    api: str, engine: Engine
) -> None:
    good = [engine(ip) for ip in ("127.0.0.2", "127.0.0.3", "127.0.0.4")]
    bad = engine("127.0.0.5")
    bad.status = 500
    registry = Registry()
    metrics = ProberMetrics.register(registry)
    settings = _settings(api, interval=1.0, concurrency=2)
    stop = threading.Event()
    started = time.monotonic()
    with httpx.Client() as client:
        loop = Scheduler(settings, Prober(settings, client, stop=stop), client, metrics)
        thread = threading.Thread(target=loop.run, args=(stop,), daemon=True)
        thread.start()
        try:
            total = "cache_indexer_probe_outcomes_total"
            wait_for(
                lambda: _count(registry, total, outcome="exact") >= 6,
                timeout=60,
                what="two exact probes per good instance",
            )
            assert _count(registry, total, outcome="engine_error") >= 1
            assert _count(registry, "cache_indexer_probe_instances") == 4
            assert _count(registry, "cache_indexer_probe_in_flight") <= 2
        finally:
            stop.set()
            thread.join(30)
    assert not thread.is_alive()
    intervals = (time.monotonic() - started) / settings.interval
    for fake in good:  # one probe = two completions; at most one probe per interval
        assert 4 <= len(fake.completions) <= 2 * (intervals + 1)
    ratio = max(len(f.completions) for f in good) / min(len(f.completions) for f in good)
    assert ratio <= 2.0, [len(f.completions) for f in good]  # round-robin, none starved


def test_the_loop_counts_a_registry_it_cannot_read_and_keeps_going() -> None:
    registry = Registry()
    metrics = ProberMetrics.register(registry)
    settings = _settings(f"http://127.0.0.1:{reserve_port()}", interval=0.2)
    stop = threading.Event()
    with httpx.Client() as client:
        loop = Scheduler(settings, Prober(settings, client, stop=stop), client, metrics)
        thread = threading.Thread(target=loop.run, args=(stop,), daemon=True)
        thread.start()
        wait_for(
            lambda: _count(registry, "cache_indexer_probe_errors_total", kind="instances") >= 1,
            timeout=30,
            what="the failed registry read counted",
        )
        assert thread.is_alive()
        stop.set()
        thread.join(30)
    assert not thread.is_alive()
