"""common.metrics (the facade over prometheus_client, buffering, the workers' endpoint) and
common.health (heartbeats and readiness conditions)."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import httpx
import prometheus_client
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from common.health import Health
from common.metrics import Registry, serve
from common.metrics_buffer import BufferedObserver
from tests.metrics_oracle import value_of, count_of

BUCKETS = (0.001, 0.01, 0.1, 1.0)


def test_the_facade_keeps_names_labels_and_values() -> None:
    r = Registry()
    c = r.counter("t_requests_total", "requests", ("path", "status"))
    c.inc(path="/a", status="200")
    c.inc(2, status="200", path="/a")  # keyword order does not matter
    c.inc(path="/b")  # a missing label is ""
    assert value_of(c, path="/a", status="200") == 3
    assert value_of(c, path="/b", status="") == 1 and value_of(c, path="/c", status="1") == 0
    g = r.gauge("t_sockets", "sockets")
    g.set(4)
    g.inc()
    assert value_of(g) == 5
    with pytest.raises(ValueError):
        c.inc(-1, path="/a", status="200")
    text = r.render()
    assert 't_requests_total{path="/a",status="200"} 3.0' in text
    assert 't_requests_total{path="/b",status=""} 1.0' in text
    assert "# TYPE t_requests_total counter" in text and "t_sockets 5.0" in text
    assert "_created" not in text


@pytest.mark.parametrize("buffered", [False, True])
def test_histograms_match_prometheus_client_bucket_for_bucket(buffered: bool) -> None:
    values = [0.0, 0.0005, 0.001, 0.0010001, 0.05, 0.1, 1.0, 3.0, 1e9]
    ours = Registry(buffered=buffered)
    h = ours.histogram("t_seconds", "latency", ("path",), BUCKETS)
    reference = CollectorRegistry()
    ref = prometheus_client.Histogram(
        "t_seconds", "latency", ("path",), registry=reference, buckets=BUCKETS
    )
    for v in values:
        h.observe(v, path="/x")
        ref.labels("/x").observe(v)
    assert ours.render() == generate_latest(reference).decode()
    assert count_of(h, path="/x") == len(values)
    assert isinstance(h._get({"path": "/x"}), BufferedObserver) == buffered, (
        "prometheus_client's histogram internals changed: buffering fell back"
    )


def test_buffered_counts_appear_on_flush_and_none_are_lost() -> None:
    r = Registry(buffered=True)
    c = r.counter("t_buffered_total", "x", ("k",))
    h = r.histogram("t_buffered_seconds", "x", (), BUCKETS)
    assert isinstance(h._get({}), BufferedObserver)

    def work() -> None:
        for i in range(5000):
            c.inc(k="a")
            h.observe(0.005 if i % 2 else 0.5)

    def flushing(stop: threading.Event) -> None:
        while not stop.is_set():
            r.flush()

    stop = threading.Event()
    flusher = threading.Thread(target=flushing, args=(stop,))
    flusher.start()
    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    flusher.join()
    raw = generate_latest(r.collector).decode()  # not flushed by this call
    text = r.render()  # flushes first
    assert 't_buffered_total{k="a"} 20000.0' in text
    assert 't_buffered_seconds_bucket{le="0.01"} 10000.0' in text
    assert "t_buffered_seconds_count 20000.0" in text
    assert raw.count("\n") == text.count("\n")
    c.inc(k="a")
    assert 't_buffered_total{k="a"} 20000.0' in generate_latest(r.collector).decode()
    assert value_of(c, k="a") == 20001  # reading flushes


# ---- health -----------------------------------------------------------------------------


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_loop_that_stops_beating_fails_liveness_then_recovers() -> None:
    clock = _Clock()
    health = Health(timeout=10, clock=clock)
    a, b = health.heartbeat("loop a"), health.heartbeat("loop b")
    clock.now += 9
    a.beat()
    assert health.liveness() == (True, "ok")
    clock.now += 2  # b: 11 s without progress
    live, text = health.liveness()
    assert not live and "loop b (no progress for 11s)" in text and "loop a" not in text
    b.beat()
    assert health.liveness()[0]
    b.beat(allow=30)  # a planned 30 s wait is not a stall
    clock.now += 35
    a.beat()
    assert health.liveness()[0]
    clock.now += 6
    a.beat()
    assert not health.liveness()[0]
    b.close()  # a loop that ended on purpose is no longer watched
    assert health.liveness()[0]


def test_readiness_needs_every_condition_and_liveness() -> None:
    clock = _Clock()
    health = Health(timeout=10, clock=clock)
    beat = health.heartbeat("loop")
    redis_ok = health.condition("redis")
    assert health.readiness() == (False, "not ready: redis: not checked yet")
    redis_ok.set(True)
    assert health.readiness() == (True, "ok")
    redis_ok.set(False, "connection refused")
    assert health.readiness() == (False, "not ready: redis: connection refused")
    redis_ok.set(True)
    clock.now += 11
    assert not health.readiness()[0], "a stalled process is not ready either"
    beat.beat()
    assert health.readiness()[0]


def test_heartbeat_wait_announces_the_wait_and_returns_the_event_state() -> None:
    health = Health(timeout=0.05)
    beat = health.heartbeat("loop")
    event = threading.Event()
    result: list[bool] = []
    waiter = threading.Thread(target=lambda: result.append(beat.wait(event, 30)))
    waiter.start()
    threading.Event().wait(0.2)  # well past the timeout, inside the announced wait
    assert health.liveness()[0]
    event.set()
    waiter.join(5)
    assert result == [True]


# ---- the endpoint -----------------------------------------------------------------------


@pytest.fixture()
def endpoint() -> Iterator[tuple[str, Health, Registry]]:
    registry, health = Registry(), Health(timeout=60)
    registry.counter("t_served_total", "x").inc(7)
    server = serve(registry, "127.0.0.1", 0, health)
    yield f"http://127.0.0.1:{server.server_address[1]}", health, registry
    server.shutdown()
    server.server_close()


def test_the_endpoint_serves_metrics_and_probes(endpoint: tuple[str, Health, Registry]) -> None:
    url, health, _ = endpoint
    resp = httpx.get(f"{url}/metrics")
    assert resp.status_code == 200 and "t_served_total 7.0" in resp.text
    assert resp.headers["content-type"].startswith("text/plain")
    assert httpx.get(f"{url}/healthz").text == "ok\n"
    assert httpx.get(f"{url}/readyz").status_code == 200  # no conditions
    cond = health.condition("redis")
    resp = httpx.get(f"{url}/readyz")
    assert (resp.status_code, resp.text) == (503, "not ready: redis: not checked yet\n")
    text = httpx.get(f"{url}/metrics").text
    assert 'cache_indexer_worker_condition{condition="redis"} 0.0' in text
    assert "cache_indexer_worker_live 1.0" in text
    cond.set(True)
    assert httpx.get(f"{url}/readyz").status_code == 200
    assert (
        'cache_indexer_worker_condition{condition="redis"} 1.0' in httpx.get(f"{url}/metrics").text
    )
    assert httpx.get(f"{url}/nope").status_code == 404


def test_without_health_both_probes_answer_ok() -> None:
    server = serve(Registry(), "127.0.0.1", 0)
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        assert [httpx.get(f"{url}{p}").status_code for p in ("/healthz", "/readyz")] == [200, 200]
        assert "cache_indexer_worker_live" not in httpx.get(f"{url}/metrics").text
    finally:
        server.shutdown()
        server.server_close()


def test_a_stalled_loop_shows_as_worker_live_0_in_metrics() -> None:
    clock = _Clock()
    health = Health(timeout=10, clock=clock)
    health.heartbeat("loop a")
    server = serve(Registry(), "127.0.0.1", 0, health)
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/metrics"
        assert "cache_indexer_worker_live 1.0" in httpx.get(url).text
        clock.now += 11
        assert "cache_indexer_worker_live 0.0" in httpx.get(url).text
    finally:
        server.shutdown()
        server.server_close()
