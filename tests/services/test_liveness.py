"""Worker liveness and readiness on the metrics port: each loop is wedged in turn (a
dependency injected into it blocks on an event; only that loop's thread stops, the HTTP
server keeps answering), ``/healthz`` fails naming the loop, then recovers once the
dependency is released. Real redis-server; the blocking parts are the injected ones."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
import redis

from common.settings import L1IngestSettings, L3PollerSettings
from common.health import Health
from common.lifecycle import Backoff
from common.metrics import Registry, serve
from common.store import Instance, Store, StoredCursor
from services.discovery.metrics import DiscoveryMetrics
from services.discovery.reconcile import Desired, Reconciler, run
from services.l1_ingest.metrics import IngestMetrics
from services.l1_ingest.sharding import StaticAssigner, run_assignment
from services.l1_ingest.subscriber import Subscriber
from services.l3_poller.metrics import PollerMetrics
from services.l3_poller.poller import L3Poller
from tests.conftest import reserve_port, wait_for

TIMEOUT = 0.5  # the liveness timeout of these tests (metrics.livenessTimeout)


class Gate:
    """Blocks a caller while closed; the test opens it to unwedge the loop."""

    def __init__(self) -> None:
        self.open = threading.Event()
        self.open.set()
        self.entered = threading.Event()

    def close(self) -> None:
        self.entered.clear()
        self.open.clear()

    def pass_through(self) -> None:
        if not self.open.is_set():
            self.entered.set()
            self.open.wait()


class WedgingStore(Store):
    """A real Store whose registry read and cursor read can be made to hang."""

    def __init__(self, client: redis.Redis, gate: Gate) -> None:
        super().__init__(client)
        self.gate = gate

    def list_instances(self) -> list[Instance]:
        self.gate.pass_through()
        return super().list_instances()

    def cursor(self, ip: str, rank: int) -> StoredCursor:  # what a new session reads now
        self.gate.pass_through()
        return super().cursor(ip, rank)


class Probe:
    def __init__(self, health: Health) -> None:
        self.server = serve(Registry(), "127.0.0.1", 0, health)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def get(self, path: str) -> tuple[int, str]:
        resp = httpx.get(f"{self.url}{path}", timeout=5)
        return resp.status_code, resp.text

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture()
def health() -> Iterator[tuple[Health, Probe]]:
    h = Health(TIMEOUT)
    probe = Probe(h)
    yield h, probe
    probe.close()


def _wedge_and_release(probe: Probe, gate: Gate, loop: str) -> None:
    wait_for(lambda: probe.get("/healthz")[0] == 200, timeout=10, what="a live process")
    gate.close()
    wait_for(gate.entered.is_set, timeout=10, what=f"the {loop} to enter the gate")
    status, text = wait_for(
        lambda: (r := probe.get("/healthz"))[0] == 503 and r, timeout=10, what="/healthz to fail"
    )
    assert loop in text and "no progress" in text
    assert probe.get("/readyz")[0] == 503, "a stalled process is not ready"
    gate.open.set()
    wait_for(lambda: probe.get("/healthz") == (200, "ok\n"), timeout=10, what="/healthz to recover")


def _thread(target: Callable[..., Any], *args: Any, **kw: Any) -> threading.Thread:
    t = threading.Thread(target=target, args=args, kwargs=kw, daemon=True)
    t.start()
    return t


def test_l1_assignment_loop(redis_client: redis.Redis, health: tuple[Health, Probe]) -> None:
    h, probe = health
    gate, stop = Gate(), threading.Event()
    store = WedgingStore(redis_client, gate)
    t = _thread(
        run_assignment,
        stop,
        store,
        StaticAssigner(0, 1),
        lambda _: None,
        interval=0.05,
        backoff=Backoff(0.05, 0.2),
        health=h,
    )
    wait_for(lambda: probe.get("/readyz") == (200, "ok\n"), what="ready once Redis was read")
    _wedge_and_release(probe, gate, "assignment loop")
    stop.set()
    t.join(5)
    assert probe.get("/healthz")[0] == 200, "a loop that stopped on purpose is not a stall"


def test_l1_ingester_is_not_ready_without_redis() -> None:
    h = Health(10)  # redis-py retries a refused connection with backoff: allow for it
    probe = Probe(h)
    stop = threading.Event()
    down = Store(redis.Redis(port=reserve_port(), socket_connect_timeout=0.2))
    t = _thread(
        run_assignment,
        stop,
        down,
        StaticAssigner(0, 1),
        lambda _: None,
        interval=0.05,
        backoff=Backoff(0.05, 0.1),
        health=h,
    )
    status, text = wait_for(
        lambda: (r := probe.get("/readyz"))[1] != "not ready: redis: not checked yet\n" and r,
        what="a readiness verdict",
    )
    assert status == 503 and "cannot read the registry" in text
    assert probe.get("/healthz")[0] == 200, "failing calls are progress: live, not ready"
    stop.set()
    t.join(5)
    probe.close()


def test_l1_subscriber_loop(redis_client: redis.Redis, health: tuple[Health, Probe]) -> None:
    h, probe = health
    gate, stop = Gate(), threading.Event()
    store = WedgingStore(redis_client, gate)
    sub = Subscriber(store, L1IngestSettings(), IngestMetrics(), health=h)
    t = _thread(sub.run, stop)
    wait_for(lambda: probe.get("/healthz")[0] == 200, what="a live subscriber")
    gate.close()  # the next subscription reads its cursor (Store.cursor) and hangs there
    sub.set_instances(
        {
            "127.0.0.9": Instance(
                ip="127.0.0.9", uid="u", zmq_endpoint=f"tcp://127.0.0.1:{reserve_port()}"
            )
        }
    )
    wait_for(gate.entered.is_set, timeout=10, what="the subscriber to enter the gate")
    _, text = wait_for(
        lambda: (r := probe.get("/healthz"))[0] == 503 and r, what="/healthz to fail"
    )
    assert "subscriber loop" in text
    gate.open.set()
    wait_for(lambda: probe.get("/healthz")[0] == 200, what="/healthz to recover")
    stop.set()
    t.join(5)


class _WedgedSource:
    def __init__(self, gate: Gate) -> None:
        self.changed = threading.Event()
        self.gate = gate

    def start(self) -> None:
        pass

    def desired(self) -> Desired:
        self.gate.pass_through()
        self.changed.set()  # pass again at once: many beats while healthy
        return Desired(instances={}, masters={})

    def close(self) -> None:
        pass


def test_discovery_loop(redis_client: redis.Redis, health: tuple[Health, Probe]) -> None:
    h, probe = health
    gate, stop = Gate(), threading.Event()
    reconciler = Reconciler(
        Store(redis_client), "holder", 1.0, DiscoveryMetrics.register(Registry())
    )
    source = _WedgedSource(gate)
    t = _thread(run, source, reconciler, stop, Backoff(0.05, 0.2), h)
    wait_for(lambda: probe.get("/readyz")[0] == 200, what="ready after a pass")
    _wedge_and_release(probe, gate, "discovery loop")
    stop.set()
    t.join(5)


class _HangingMaster:
    """Just enough of a MasterClient: its segment listing hangs while the gate is closed,
    otherwise it fails (a master that is down), which is progress for the loop."""

    def __init__(self, gate: Gate) -> None:
        self.gate = gate

    def segments(self) -> list[str]:
        self.gate.pass_through()
        raise redis.ConnectionError("not a real master")

    def close(self) -> None:
        pass


def test_l3_master_poll_loop(redis_client: redis.Redis, health: tuple[Health, Probe]) -> None:
    h, probe = health
    gate, stop = Gate(), threading.Event()
    store = Store(redis_client)
    store.set_masters({"http://127.0.0.1:9": "{}"})
    cfg = L3PollerSettings(
        poll_interval=0.05, http_timeout=0.2, segments_timeout=0.2, stale_after=60
    )
    poller = L3Poller(
        cfg,
        store,
        PollerMetrics.register(),
        client_factory=lambda _url: _HangingMaster(gate),  # type: ignore
        health=h,
    )
    t = _thread(poller.run, stop)
    wait_for(lambda: probe.get("/readyz")[0] == 200, what="ready after a registry read")
    _wedge_and_release(probe, gate, "master http://127.0.0.1:9")
    stop.set()
    t.join(5)
