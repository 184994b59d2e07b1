"""Static discovery: the config file's lists reach Redis and follow edits of the file."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from common.config import load_config
from common.settings import DiscoverySettings
from common.store import TierOps
from services.discovery.static import StaticSource
from tests.conftest import RedisServer, wait_for
from tests.services.discovery_support import RunningDiscovery, write_config
from tests.store_oracle import OracleStore


def _entry(ip: str, port: int = 5557, **kw: Any) -> dict[str, Any]:
    return {"ip": ip, "zmqEndpoint": f"tcp://{ip}:{port}", **kw}


class StaticFile:
    def __init__(self, path: Path, redis_url: str) -> None:
        self.path, self.redis_url = path, redis_url

    def write(
        self, vllm: list[dict[str, Any]], masters: list[dict[str, Any]] | None = None
    ) -> None:
        static = {"vllm": vllm, "mooncakeMasters": masters or []}
        tmp = write_config(
            self.path.with_suffix(".tmp"),
            self.redis_url,
            {"discovery": {"mode": "static", "static": static}},
        )
        tmp.replace(self.path)  # atomically, as a ConfigMap update or an editor does

    def write_text(self, text: str) -> None:
        self.path.with_suffix(".tmp").write_text(text)
        self.path.with_suffix(".tmp").replace(self.path)


@pytest.fixture()
def static_file(tmp_path: Path, redis_server: RedisServer) -> StaticFile:
    return StaticFile(tmp_path / "config.yaml", redis_server.url)


@pytest.fixture()
def running() -> Iterator[list[RunningDiscovery]]:
    started: list[RunningDiscovery] = []
    yield started
    for d in started:
        d.close()


def _start(static_file: StaticFile, running: list[RunningDiscovery]) -> RunningDiscovery:
    cfg = load_config(static_file.path, env={})
    settings = DiscoverySettings.from_config(cfg)
    d = RunningDiscovery(
        cfg,
        static_file.path,
        lambda m: StaticSource(str(static_file.path), settings, m, poll_interval=0.05),
    )
    running.append(d.start())
    return d


def test_static_entries_reload_add_change_remove(
    static_file: StaticFile, running: list[RunningDiscovery], redis_client: redis.Redis
) -> None:
    store = OracleStore(redis_client)
    static_file.write(
        [_entry("127.0.0.1", name="a", role="prefill"), _entry("127.0.0.2")],
        [{"url": "http://127.0.0.1:9003", "name": "mc"}],
    )
    d = _start(static_file, running)
    wait_for(
        lambda: (
            store.instance_ips() == {"127.0.0.1", "127.0.0.2"} and len(store.list_masters()) == 1
        ),
        what="both entries and the master",
    )
    a = store.get_instance("127.0.0.1")
    assert a is not None and (a.pod, a.role, a.zmq_endpoint) == (
        "a",
        "prefill",
        "tcp://127.0.0.1:5557",
    )
    assert json.loads(store.list_masters()["http://127.0.0.1:9003"])["pod"] == "mc"
    gen_b = store.get_instance("127.0.0.2").gen  # type: ignore[union-attr]
    ops = TierOps()
    ops.store("l1", [1, 2])
    assert store.apply_batch("127.0.0.2", gen_b, 0, 1, ops).status == "applied"

    # b's endpoint changes (a new instance: data dropped), a is renamed, c is added.
    static_file.write(
        [
            _entry("127.0.0.1", name="a2", role="prefill"),
            _entry("127.0.0.2", port=6000, dataParallelSize=2),
            _entry("127.0.0.3", replayEndpoint="tcp://127.0.0.3:5558"),
        ],
        [{"url": "http://127.0.0.9:9003"}],
    )
    wait_for(lambda: store.instance_ips() == {"127.0.0.1", "127.0.0.2", "127.0.0.3"}, what="c")
    wait_for(
        lambda: (
            store.get_instance("127.0.0.2").dp_size == 2  # type: ignore[union-attr]
            and list(store.list_masters()) == ["http://127.0.0.9:9003"]
        ),
        what="b's new entry and the new master",
    )
    b = store.get_instance("127.0.0.2")
    assert b is not None and b.zmq_endpoint == "tcp://127.0.0.2:6000" and b.gen > gen_b
    assert store.tier_members("127.0.0.2") == set()
    a2 = store.get_instance("127.0.0.1")
    assert a2 is not None and (a2.pod, a2.uid, a2.gen) == ("a2", a.uid, a.gen)
    assert store.get_instance("127.0.0.3").replay_endpoint == "tcp://127.0.0.3:5558"  # type: ignore[union-attr]
    wait_for(
        lambda: (
            d.count("changes", action="replaced") == 1 and d.count("changes", action="updated") == 1
        ),
        what="the counters",
    )

    static_file.write([_entry("127.0.0.3", replayEndpoint="tcp://127.0.0.3:5558")])
    wait_for(
        lambda: store.instance_ips() == {"127.0.0.3"} and store.list_masters() == {},
        what="a, b and the master removed",
    )


def test_invalid_file_keeps_the_last_good_lists(
    static_file: StaticFile, running: list[RunningDiscovery], redis_client: redis.Redis
) -> None:
    store = OracleStore(redis_client)
    static_file.write([_entry("127.0.0.1")])
    d = _start(static_file, running)
    wait_for(lambda: store.instance_ips() == {"127.0.0.1"}, what="a")
    static_file.write_text("discovery: {mode: static, static: {vllm: [{zmqEndpoint: 1}]}}")
    wait_for(lambda: d.count("reloads", result="invalid") == 1, what="the invalid reload")
    static_file.write_text(":: not yaml")
    wait_for(lambda: d.count("reloads", result="invalid") == 2, what="the unparsable reload")
    static_file.write_text("")  # valid, but it means mode kubernetes: not applied
    wait_for(lambda: d.count("reloads", result="invalid") == 3, what="the empty file")
    assert store.instance_ips() == {"127.0.0.1"}
    static_file.write([_entry("127.0.0.5")])
    wait_for(lambda: store.instance_ips() == {"127.0.0.5"}, what="the next good file")
