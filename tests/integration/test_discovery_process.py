"""`cache-indexer discovery` as processes: two at once (lease), SIGKILL, SIGTERM, bad config."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from common import keys
from common.store import Store
from tests.conftest import RedisServer, reserve_port, wait_for
from tests.fake_kube import FakeKube
from tests.services.discovery_support import vllm_pod, write_config


class Proc:
    def __init__(self, config: Path, env: dict[str, str]) -> None:
        self.metrics_port = reserve_port()
        self.p = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "services.cli",
                "discovery",
                "--config",
                str(config),
                "--metrics-port",
                str(self.metrics_port),
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )

    def metric(self, name: str) -> float:
        text = httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=2).text
        values = [
            float(line.split()[-1])
            for line in text.splitlines()
            if line.startswith((name + " ", name + "{"))
        ]
        return sum(values)

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait(5)
        if self.p.stderr:
            self.p.stderr.close()


@pytest.fixture()
def procs() -> Iterator[list[Proc]]:
    started: list[Proc] = []
    yield started
    for p in started:
        p.stop()


def _lease(client: redis.Redis) -> str:
    value = client.get(keys.lease("discovery"))
    return value.decode() if value else ""


def test_two_processes_one_writer_kill_and_takeover(
    tmp_path: Path,
    redis_server: RedisServer,
    redis_client: redis.Redis,
    subprocess_env: dict[str, str],
    procs: list[Proc],
) -> None:
    kube = FakeKube().start()
    try:
        kube.add_pod(vllm_pod("a", "10.0.0.1"))
        config = write_config(
            tmp_path / "config.yaml",
            redis_server.url,
            {"discovery": {"kubeconfig": str(kube.write_kubeconfig(tmp_path / "kubeconfig"))}},
        )
        store = Store(redis_client)
        procs += [Proc(config, subprocess_env), Proc(config, subprocess_env)]  # at once
        wait_for(lambda: store.instance_ips() == {"10.0.0.1"}, timeout=15, what="a registered")
        wait_for(
            lambda: all(p.metric("cache_indexer_discovery_instances") == 1 for p in procs),
            timeout=15,
            what="both processes to see the pod",
        )
        first, second = sorted(procs, key=lambda p: f":{p.p.pid}:" not in _lease(redis_client))
        assert f":{first.p.pid}:" in _lease(redis_client)
        assert first.metric("cache_indexer_discovery_lease_held") == 1
        assert second.metric("cache_indexer_discovery_lease_held") == 0
        assert second.metric("cache_indexer_discovery_registry_changes_total") == 0

        first.p.send_signal(signal.SIGKILL)  # no release: the lease must expire (TTL 1 s)
        first.p.wait(5)
        wait_for(
            lambda: f":{second.p.pid}:" in _lease(redis_client),
            timeout=15,
            what="the standby to take over once the lease expires",
        )
        kube.add_pod(vllm_pod("b", "10.0.0.2"))
        wait_for(lambda: store.instance_ips() == {"10.0.0.1", "10.0.0.2"}, what="b")
        assert second.metric("cache_indexer_discovery_lease_held") == 1

        second.p.send_signal(signal.SIGTERM)
        assert second.p.wait(10) == 0
        assert _lease(redis_client) == "", "a clean stop releases the lease"
        assert store.instance_ips() == {"10.0.0.1", "10.0.0.2"}, "stopping removes nothing"
    finally:
        kube.stop()


def test_bad_config_exits_2_naming_the_key(
    tmp_path: Path, redis_server: RedisServer, subprocess_env: dict[str, str]
) -> None:
    config = write_config(
        tmp_path / "config.yaml",
        redis_server.url,
        {"discovery": {"labels": {"engineValue": "not a label value"}}},
    )
    done = subprocess.run(
        [sys.executable, "-m", "services.cli", "discovery", "--config", str(config)],
        check=False,
        env=subprocess_env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 2
    assert "discovery.labels.engineValue" in done.stderr
