"""`cache-indexer discovery` as a process with the default role list (issue 33): pods of both
default roles (prefill, aggregate), of an unlisted role and without one, listed and then
changed through the watch of the fake API server; the registry in a real redis-server."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import redis

from tests.store_oracle import OracleStore
from tests.conftest import RedisServer, wait_for
from tests.fake_kube import FakeKube, make_pod
from tests.integration.test_discovery_process import Proc
from tests.services.discovery_support import write_config

ROLE = "openfuyao.com/pdRole"


def _pod(name: str, ip: str, role: str | None) -> dict[str, Any]:
    labels = {"openfuyao.com/engine": "vllm"}
    if role is not None:
        labels[ROLE] = role
    return make_pod(name, ip, labels)


def _roles(store: OracleStore) -> dict[str, str]:
    out = {}
    for ip in store.instance_ips():
        inst = store.get_instance(ip)
        if inst is not None:
            out[ip] = inst.role
    return out


def test_a_discovery_process_registers_every_default_role_and_no_other(
    tmp_path: Path,
    redis_server: RedisServer,
    redis_client: redis.Redis,
    subprocess_env: dict[str, str],
) -> None:
    kube = FakeKube().start()
    proc = None
    try:
        kube.add_pod(_pod("p", "10.0.0.1", "prefill"))
        kube.add_pod(_pod("a", "10.0.0.2", "aggregate"))
        kube.add_pod(_pod("d", "10.0.0.3", "decode"))
        kube.add_pod(_pod("none", "10.0.0.4", None))
        config = write_config(  # no discovery.labels: the defaults
            tmp_path / "config.yaml",
            redis_server.url,
            {"discovery": {"kubeconfig": str(kube.write_kubeconfig(tmp_path / "kubeconfig"))}},
        )
        store = OracleStore(redis_client)
        proc = Proc(config, subprocess_env)
        want = {"10.0.0.1": "prefill", "10.0.0.2": "aggregate"}
        wait_for(lambda: _roles(store) == want, timeout=30, what=f"exactly {want}")
        kube.modify_pod("d", lambda p: p["metadata"]["labels"].update({ROLE: "aggregate"}))
        kube.modify_pod("p", lambda p: p["metadata"]["labels"].update({ROLE: "decode"}))
        kube.add_pod(_pod("a2", "10.0.0.5", "aggregate"))
        want = {"10.0.0.2": "aggregate", "10.0.0.3": "aggregate", "10.0.0.5": "aggregate"}
        wait_for(lambda: _roles(store) == want, timeout=30, what=f"exactly {want} via the watch")
        wait_for(
            lambda: proc is not None and proc.metric("cache_indexer_discovery_instances") == 3,
            timeout=15,
            what="the process to count 3 instances",
        )
    finally:
        if proc is not None:
            proc.stop()
        kube.stop()
