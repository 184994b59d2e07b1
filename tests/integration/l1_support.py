"""Helpers for the L1 ingester integration tests: in-process and subprocess ingesters,
simulated instances on reserved loopback ports (``tests.conftest.reserve_ports``), and
exactness checks against the simulator."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import redis
import yaml
import zmq

from common.blockhash import HashSettings
from common.config import parse_duration
from common.events import Event
from common.settings import L1IngestSettings
from common.store import Instance, Store
from services.l1_ingest.metrics import IngestMetrics
from services.l1_ingest.sharding import StaticAssigner, run_assignment
from services.l1_ingest.subscriber import Subscriber
from services.simulator.engine import SimulatedVLLM
from tests.conftest import ROOT, wait_for
from tests.metrics_oracle import value_of
from tests.store_oracle import OracleStore

FAST = {
    "backoffInitial": "20ms",
    "backoffMax": "200ms",
    "topic": "kv-events",
    "leaseTTL": "1s",
    "heartbeatInterval": "200ms",
    "replayTimeout": "1s",
}


def l1_config(hash_settings: HashSettings | None = None, **overrides: str) -> L1IngestSettings:
    raw = {**FAST, **overrides}
    return L1IngestSettings(
        backoff_initial=parse_duration(raw["backoffInitial"]),
        backoff_max=parse_duration(raw["backoffMax"]),
        topic=raw["topic"],
        on_unrecoverable_gap=raw.get("onUnrecoverableGap", "keep"),  # type: ignore[arg-type]
        lease_ttl=parse_duration(raw["leaseTTL"]),
        heartbeat_interval=parse_duration(raw["heartbeatInterval"]),
        replay_timeout=parse_duration(raw["replayTimeout"]),
        hash_check_rate=int(raw.get("hashCheckRate", "1000")),
        hash=hash_settings or HashSettings(),
    )


class InProcessIngester:
    """Subscriber + static assignment loop in threads of the test process."""

    def __init__(
        self, client: redis.Redis, hash_settings: HashSettings | None = None, **overrides: str
    ) -> None:
        self.store = OracleStore(client)
        self.metrics = IngestMetrics()
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.subscriber = Subscriber(
            self.store,
            l1_config(hash_settings, **overrides),
            self.metrics,
            ctx=self.ctx,
            ingester="in-process",
        )
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._assign, daemon=True)]
        self.threads[0].start()
        self._sub_stop = threading.Event()
        self._sub_thread: threading.Thread | None = None
        self.resume()

    def pause(self) -> None:
        """Stop the subscriber thread (every socket closes; the Subscriber keeps its memory)."""
        self._sub_stop.set()
        if self._sub_thread is not None:
            self._sub_thread.join(5)
            self._sub_thread = None

    def resume(self) -> None:
        """Run the same Subscriber again; the assignment loop hands it its instances."""
        self._sub_stop = threading.Event()
        self._sub_thread = threading.Thread(
            target=self.subscriber.run, args=(self._sub_stop,), daemon=True
        )
        self._sub_thread.start()

    def _assign(self) -> None:
        from common.lifecycle import Backoff

        run_assignment(
            self.stop,
            self.store,
            StaticAssigner(0, 1),
            self.subscriber.set_instances,
            interval=0.05,
            backoff=Backoff(0.05, 0.2),
        )

    def count(self, metric: str, **labels: str) -> float:
        return float(value_of(getattr(self.metrics, metric), **labels))

    def close(self) -> None:
        self.stop.set()
        self.pause()
        for t in self.threads:
            t.join(5)
        self.ctx.term()


def write_config(path: Path, redis_url: str, **overrides: str) -> Path:
    doc: dict[str, Any] = {
        "redis": {"url": redis_url},
        "ingest": {"l1": {**FAST, **overrides}},
        "log": {"level": "info"},
    }
    path.write_text(yaml.safe_dump(doc), encoding="utf-8")
    return path


def spawn_ingester(
    config: Path, env: dict[str, str], *args: str, log: Path | None = None
) -> subprocess.Popen[bytes]:
    out = open(log, "ab") if log else subprocess.DEVNULL  # noqa: SIM115 - owned by the child
    return subprocess.Popen(
        [sys.executable, "-m", "services.cli", "l1-ingest", "--config", str(config), *args],
        cwd=ROOT,
        env=env,
        stdout=out,
        stderr=out,
    )


def register(
    store: Store, ip: str, sim: SimulatedVLLM, uid: str = "uid-1", restarts: str = "0"
) -> int:
    """Register ``sim`` under ``ip`` with its connect-side endpoints; returns the gen."""

    def connectable(endpoint: str) -> str:
        return endpoint.replace("*", "127.0.0.1")

    _, gen = store.upsert_instance(
        Instance(
            ip=ip,
            uid=uid,
            pod=f"vllm-{ip}",
            zmq_endpoint=connectable(sim.endpoint),
            replay_endpoint=connectable(sim.replay_endpoint),
            dp_size=len(sim.ranks),
            restarts=restarts,
        )
    )
    return gen


def emit(sim: SimulatedVLLM, events: Sequence[Event], *, rank: int = 0, drop: bool = False) -> int:
    """Publish hand-made events on ``sim``'s rank (odd media, groups, placeholders)."""
    return sim.publishers[rank].publish(events, drop=drop)


def true_counts(sim: SimulatedVLLM) -> Counter[int]:
    total: Counter[int] = Counter()
    for model in sim.models.values():
        total.update(model.gpu_counts())
    return total


def wait_quiet(store: Store, ip: str, sim: SimulatedVLLM, timeout: float = 10.0) -> None:
    """Wait until every rank's last applied sequence is the simulator's last sequence."""
    sim.flush()
    wait_for(
        lambda: all(store.last_seq(ip, r) == sim.last_seq(r) for r in sim.ranks),
        timeout=timeout,
        what=f"{ip} to catch up with the simulator",
    )


def assert_exact(store: Store, ip: str, sim: SimulatedVLLM) -> None:
    """L1 copy counts equal the simulator's GPU cache; L2 equals its CPU tier."""
    wait_quiet(store, ip, sim)
    assert store.tier_counts(ip, "l1") == dict(true_counts(sim))
    cpu = set().union(*(m.cpu_hashes() for m in sim.models.values()))
    assert store.tier_members(ip, "l2") == cpu
    assert not store.tier_members(ip, "l1") & (cpu - set(true_counts(sim)))


def warm_up(store: Store, ip: str, sim: SimulatedVLLM, timeout: float = 10.0) -> None:
    """Without a replay endpoint the first batches can be lost (slow joiner, spec §1.2):
    publish no-op AllBlocksCleared batches until the ingester has joined every rank."""
    from common.events import AllBlocksCleared

    def joined() -> bool:
        pending = [r for r in sim.ranks if store.last_seq(ip, r) is None]
        for r in pending:
            emit(sim, [AllBlocksCleared()], rank=r)
        return not pending

    wait_for(joined, timeout=timeout, interval=0.05, what=f"{ip} to join the stream")
    wait_quiet(store, ip, sim)
