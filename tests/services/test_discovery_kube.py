"""Kubernetes discovery end to end: fake API server (tests/fake_kube.py) → real redis-server."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from common import keys
from common.config import load_config
from common.settings import DiscoverySettings
from common.store import Instance, Store, TierOps
from services.discovery.kube import KubeSource, connect
from tests.conftest import RedisServer, require, wait_for
from tests.fake_kube import FakeKube, make_pod
from tests.services.discovery_support import (
    MASTER,
    RunningDiscovery,
    merge,
    set_ready,
    vllm_pod,
    write_config,
)
from tests.store_oracle import OracleStore

Start = Callable[..., RunningDiscovery]


@pytest.fixture()
def kube() -> Iterator[FakeKube]:
    server = FakeKube().start()
    yield server
    server.stop()


@pytest.fixture()
def store(redis_client: redis.Redis) -> Store:
    return OracleStore(redis_client)


@pytest.fixture()
def start(tmp_path: Path, redis_server: RedisServer, kube: FakeKube) -> Iterator[Start]:
    """Start a discovery loop against ``kube`` (or ``server``) and the session redis."""
    running: list[RunningDiscovery] = []

    def _start(
        extra: dict[str, Any] | None = None,
        server: FakeKube | None = None,
        redis_url: str | None = None,
    ) -> RunningDiscovery:
        kc = (server or kube).write_kubeconfig(tmp_path / "kubeconfig")
        cfg = write_config(
            tmp_path / f"config{len(running)}.yaml",
            redis_url or redis_server.url,
            merge({"discovery": {"kubeconfig": str(kc)}}, extra or {}),
        )
        running.append(RunningDiscovery.from_file(cfg).start())
        return running[-1]

    yield _start
    for d in running:
        d.close()


def ips(store: Store) -> set[str]:
    return store.instance_ips()


def fill(store: Store, ip: str) -> None:
    """Give ``ip`` some L1 and L3 blocks, as the ingesters would."""
    inst = store.get_instance(ip)
    assert inst is not None
    ops = TierOps()
    ops.store("l1", [11, 12, 13])
    assert store.apply_batch(ip, inst.gen, 0, 1, ops).status == "applied"
    assert store.replace_l3(ip, [21, 22])
    assert store.tier_members(ip) == {11, 12, 13} and store.l3_members(ip) == {21, 22}


def test_add_label_change_readiness_and_delete(kube: FakeKube, start: Start, store: Store) -> None:
    a = kube.add_pod(vllm_pod("a", "10.0.0.1", ports={"zmq-pub": 6000}))
    kube.add_pod(vllm_pod("b", "10.0.0.2"))
    kube.add_pod(make_pod("web", "10.0.0.9", {"app": "web"}))
    d = start()
    wait_for(lambda: ips(store) == {"10.0.0.1", "10.0.0.2"}, what="both vLLM pods")
    inst = store.get_instance("10.0.0.1")
    assert inst is not None
    assert (inst.uid, inst.pod, inst.role) == (a["metadata"]["uid"], "a", "prefill")
    assert inst.zmq_endpoint == "tcp://10.0.0.1:6000"
    assert store.get_instance("10.0.0.2").zmq_endpoint == "tcp://10.0.0.2:5557"  # type: ignore[union-attr]

    kube.modify_pod(
        "b", lambda p: p["metadata"]["labels"].update({"openfuyao.com/pdRole": "decode"})
    )
    wait_for(lambda: ips(store) == {"10.0.0.1"}, what="b to leave on a label change")
    fill(store, "10.0.0.1")
    kube.modify_pod("a", set_ready(False))
    wait_for(lambda: ips(store) == set(), what="a to leave when not ready")
    assert store.tier_members("10.0.0.1") == set() and store.l3_members("10.0.0.1") == set()
    kube.modify_pod("a", set_ready(True))
    wait_for(lambda: ips(store) == {"10.0.0.1"}, what="a back when ready")
    assert store.get_instance("10.0.0.1").gen > inst.gen  # type: ignore[union-attr]
    kube.delete_pod("a")
    wait_for(lambda: ips(store) == set(), what="a to leave when deleted")
    wait_for(lambda: d.count("changes", action="removed") == 3, what="3 removals counted")
    assert d.count("instances") == 0


def test_ip_change_and_container_restart(kube: FakeKube, start: Start, store: Store) -> None:
    kube.add_pod(vllm_pod("a", "10.0.0.1"))
    d = start()
    wait_for(lambda: ips(store) == {"10.0.0.1"}, what="a")
    fill(store, "10.0.0.1")
    gen = store.get_instance("10.0.0.1").gen  # type: ignore[union-attr]

    def restart(pod: dict[str, Any]) -> None:
        status = pod["status"]["containerStatuses"][0]
        status["restartCount"] += 1
        status["state"] = {"running": {"startedAt": "2024-01-01T01:00:00Z"}}

    kube.modify_pod("a", restart)
    wait_for(
        lambda: store.get_instance("10.0.0.1").gen > gen,  # type: ignore[union-attr]
        what="restart to bump the generation",
    )
    assert store.tier_members("10.0.0.1") == set(), "L1 of the old process must be gone"
    assert store.l3_members("10.0.0.1") == {21, 22}, "Mooncake still holds the L3 blocks"
    wait_for(lambda: d.count("changes", action="restarted") == 1, what="the restart counted")

    kube.modify_pod("a", lambda p: p["status"].update({"podIP": "10.0.0.7"}))
    wait_for(lambda: ips(store) == {"10.0.0.7"}, what="the new IP only")
    assert store.l3_members("10.0.0.1") == set()


def test_ip_reused_by_a_new_pod_starts_empty(kube: FakeKube, start: Start, store: Store) -> None:
    kube.add_pod(vllm_pod("old", "10.0.0.1"))
    d = start()
    wait_for(lambda: ips(store) == {"10.0.0.1"}, what="old pod")
    fill(store, "10.0.0.1")
    new = vllm_pod("new", "10.0.0.1")
    new["metadata"]["creationTimestamp"] = "2024-06-01T00:00:00Z"
    new_uid = kube.add_pod(new)["metadata"]["uid"]
    kube.delete_pod("old")
    wait_for(
        lambda: store.get_instance("10.0.0.1").uid == new_uid,  # type: ignore[union-attr]
        what="the new pod to own the IP",
    )
    assert store.tier_members("10.0.0.1") == set() and store.l3_members("10.0.0.1") == set()
    wait_for(lambda: d.count("changes", action="replaced") == 1, what="the replacement counted")
    assert store.get_instance("10.0.0.1").pod == "new"  # type: ignore[union-attr]


def test_broken_watch_resumes_from_last_resource_version(
    kube: FakeKube, start: Start, store: Store
) -> None:
    kube.add_pod(vllm_pod("a", "10.0.0.1"))
    d = start()
    wait_for(lambda: ips(store) == {"10.0.0.1"}, what="a")
    kube.break_watches()
    kube.add_pod(vllm_pod("b", "10.0.0.2"))
    wait_for(lambda: ips(store) == {"10.0.0.1", "10.0.0.2"}, what="b after the break")
    assert d.count("watch_restarts", source="vllm") >= 1
    assert d.count("errors", kind="watch_broken") >= 1
    assert d.count("relists", source="vllm") == 1, "resumed the watch without a relist"


@pytest.mark.parametrize("how", ["error_event", "too_old_event", "too_old_http"])
def test_410_gone_relists(kube: FakeKube, start: Start, store: Store, how: str) -> None:
    kube.add_pod(vllm_pod("a", "10.0.0.1"))
    d = start()
    wait_for(lambda: ips(store) == {"10.0.0.1"}, what="a")
    if how == "error_event":
        kube.expire_watches()
    else:
        kube.gone_as_http = how == "too_old_http"
        kube.compact()
        kube.break_watches()
    kube.delete_pod("a")
    kube.add_pod(vllm_pod("b", "10.0.0.2"))
    wait_for(lambda: ips(store) == {"10.0.0.2"}, what="the relisted view")
    assert d.count("errors", kind="gone") >= 1
    assert d.count("relists", source="vllm") >= 2


def test_api_server_down_at_start_keeps_registry_then_reconciles(
    start: Start, store: Store
) -> None:
    store.upsert_instance(Instance(ip="10.9.9.9", uid="from-before", pod="old"))
    down = FakeKube()  # not started: connection refused
    d = start(server=down)
    wait_for(
        lambda: d.count("errors", kind="unreachable") >= 4 and d.count("lease_held") == 1,
        what="retries while holding the lease",
    )
    assert ips(store) == {"10.9.9.9"}, "a failed list must not remove anything"
    down.add_pod(vllm_pod("a", "10.0.0.1"))
    down.start()
    try:
        wait_for(lambda: ips(store) == {"10.0.0.1"}, what="reconcile once the API is up")
    finally:
        down.stop()


@pytest.mark.parametrize("status,kind", [(403, "forbidden"), (500, "api_error")])
def test_failing_api_keeps_last_good_registry(
    kube: FakeKube, start: Start, store: Store, status: int, kind: str
) -> None:
    kube.add_pod(vllm_pod("a", "10.0.0.1"))
    d = start()
    wait_for(lambda: ips(store) == {"10.0.0.1"}, what="a")
    kube.fail(status, times=10**6)
    kube.break_watches()
    kube.delete_pod("a")  # happens while discovery is blind
    wait_for(lambda: d.count("errors", kind=kind) >= 3, what=f"{status} retries")
    assert ips(store) == {"10.0.0.1"}, "kept while the API refuses"
    kube.clear_failures()
    wait_for(lambda: ips(store) == set(), what="removal after a successful relist")


def test_api_server_restart_on_same_port(kube: FakeKube, start: Start, store: Store) -> None:
    kube.add_pod(vllm_pod("a", "10.0.0.1"))
    d = start()
    wait_for(lambda: ips(store) == {"10.0.0.1"}, what="a")
    kube.stop()
    kube.add_pod(vllm_pod("b", "10.0.0.2"))
    wait_for(lambda: d.count("errors", kind="unreachable") >= 2, what="failures while down")
    assert ips(store) == {"10.0.0.1"}
    kube.start()
    wait_for(lambda: ips(store) == {"10.0.0.1", "10.0.0.2"}, what="b after the restart")


def test_mooncake_masters(kube: FakeKube, start: Start, store: Store) -> None:
    kube.add_pod(make_pod("mc-0", "10.0.1.1", MASTER, ports={"http": 9100, "rpc": 50051}))
    kube.add_pod(make_pod("mc-1", "10.0.1.2", MASTER))
    kube.add_pod(vllm_pod("a", "10.0.0.1"))
    start({"ingest": {"l3": {"scheme": "https"}}})
    want = {
        "https://10.0.1.1:9100": {"pod": "mc-0", "ip": "10.0.1.1", "rpc": 50051},
        "https://10.0.1.2:9003": {"pod": "mc-1", "ip": "10.0.1.2", "rpc": 0},
    }
    wait_for(
        lambda: {u: json.loads(v) for u, v in store.list_masters().items()} == want,
        what="both masters",
    )
    assert ips(store) == {"10.0.0.1"}
    kube.modify_pod("mc-0", set_ready(False))
    wait_for(lambda: list(store.list_masters()) == ["https://10.0.1.2:9003"], what="mc-0 gone")
    kube.delete_pod("mc-1")
    wait_for(lambda: store.list_masters() == {}, what="no masters")


PROFILES = {
    "infernex": (
        {
            "engineKey": "infernex.io/pdEngineGroup",
            "engineValue": "prod.llama",
            "pdRoleKey": "infernex.io/pdRole",
            "pdRoleValue": ["prefill"],
        },
        {"infernex.io/pdEngineGroup": "prod.llama", "infernex.io/pdRole": "prefill"},
        "infernex.io/pdRole",
    ),
    "kserve": (
        {
            "engineKey": "app.kubernetes.io/name",
            "engineValue": "llama",
            "pdRoleKey": "app.kubernetes.io/component",
            "pdRoleValue": ["predictor", "prefill"],
        },
        {"app.kubernetes.io/name": "llama", "app.kubernetes.io/component": "predictor"},
        "app.kubernetes.io/component",
    ),
}


@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_label_profiles_by_config_alone(
    kube: FakeKube, start: Start, store: Store, profile: str
) -> None:
    labels, match, role_key = PROFILES[profile]
    kube.add_pod(make_pod("yes", "10.0.0.1", match))
    kube.add_pod(make_pod("other-role", "10.0.0.2", {**match, role_key: "decode"}))
    kube.add_pod(vllm_pod("default-labels", "10.0.0.3"))
    start({"discovery": {"labels": labels}})
    wait_for(lambda: ips(store) == {"10.0.0.1"}, what=f"the {profile} pod only")
    served = [r for r in kube.requests if "watch=true" not in r and "%20in%20" in r]
    assert served, "the role filter is a server-side `key in (...)` selector"


def test_two_loops_one_writer_and_takeover(
    kube: FakeKube, start: Start, store: Store, redis_client: redis.Redis
) -> None:
    kube.add_pod(vllm_pod("a", "10.0.0.1"))
    first = start()
    wait_for(
        lambda: ips(store) == {"10.0.0.1"} and first.count("lease_held") == 1,
        what="the first loop to write",
    )
    second = start()
    wait_for(lambda: second.count("relists", source="vllm") >= 1, what="the standby to list")
    kube.add_pod(vllm_pod("b", "10.0.0.2"))
    wait_for(lambda: ips(store) == {"10.0.0.1", "10.0.0.2"}, what="b")
    assert redis_client.get(keys.lease("discovery")) == first.holder.encode()
    wait_for(lambda: second.count("instances") == 2, what="the standby to keep watching")
    assert second.count("lease_held") == 0 and second.writes() == 0

    first.close()  # releases the lease
    wait_for(
        lambda: redis_client.get(keys.lease("discovery")) == second.holder.encode(),
        what="the standby to take over",
    )
    kube.delete_pod("a")
    wait_for(lambda: ips(store) == {"10.0.0.2"}, what="the new holder's write")
    wait_for(lambda: second.writes() >= 1, what="the write counted")


def test_redis_outage_is_retried(kube: FakeKube, start: Start, tmp_path: Path) -> None:
    own = RedisServer().start()
    try:
        kube.add_pod(vllm_pod("a", "10.0.0.1"))
        d = start(redis_url=own.url)
        client = redis.Redis.from_url(own.url)
        wait_for(lambda: OracleStore(client).instance_ips() == {"10.0.0.1"}, what="a")
        own.stop()
        kube.add_pod(vllm_pod("b", "10.0.0.2"))
        wait_for(lambda: d.count("errors", kind="redis") >= 2, what="redis errors")
        own = RedisServer(own.port).start()  # empty again: discovery must rebuild it all
        client = redis.Redis.from_url(own.url)
        wait_for(
            lambda: OracleStore(client).instance_ips() == {"10.0.0.1", "10.0.0.2"},
            what="the registry rebuilt after the outage",
        )
        assert d.count("lease_held") == 1
    finally:
        own.cleanup()


def _self_signed(tmp_path: Path) -> tuple[str, str]:
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
    )
    return str(cert), str(key)


def test_in_cluster_config_https_token_and_namespace(
    tmp_path: Path, redis_server: RedisServer, store: Store
) -> None:
    require(shutil.which("openssl"), "needs the openssl CLI (apt-get install openssl)")
    cert, key = _self_signed(tmp_path)
    server = FakeKube(token="sa-token", tls=(cert, key)).start()
    sa = tmp_path / "sa"
    sa.mkdir()
    (sa / "token").write_text("sa-token")
    (sa / "ca.crt").write_text(Path(cert).read_text())
    (sa / "namespace").write_text("team-a")
    try:
        server.add_pod(vllm_pod("a", "10.0.0.1", namespace="team-a"))
        server.add_pod(vllm_pod("elsewhere", "10.0.0.2"))  # namespace default
        path = write_config(tmp_path / "c.yaml", redis_server.url, {"discovery": {"namespace": ""}})
        cfg = load_config(path, env={})
        env = {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": str(server.port)}
        settings = DiscoverySettings.from_config(cfg)
        api, namespace = connect(settings, env, sa_dir=sa)
        assert namespace == "team-a"
        d = RunningDiscovery(cfg, path, lambda m: KubeSource(api, namespace, settings, m)).start()
        try:
            wait_for(lambda: ips(store) == {"10.0.0.1"}, what="the team-a pod over https")
        finally:
            d.close()
    finally:
        server.stop()


def test_http_port_is_registered_and_a_registry_without_it_is_updated_in_place(
    kube: FakeKube, start: Start, store: Store
) -> None:
    a = kube.add_pod(vllm_pod("a", "10.0.0.1", ports={"zmq-pub": 6000, "http": 8001}))
    uid_b = kube.add_pod(vllm_pod("b", "10.0.0.2"))["metadata"]["uid"]
    # What an older release registered for b: the same pod, no HTTP endpoint, some blocks.
    restarts = "0:1704067200"
    _, gen_b = store.upsert_instance(
        Instance("10.0.0.2", uid_b, pod="b", zmq_endpoint="tcp://10.0.0.2:5557", restarts=restarts)
    )
    fill(store, "10.0.0.2")
    d = start()
    wait_for(
        lambda: getattr(store.get_instance("10.0.0.2"), "http_endpoint", "") != "",
        what="b to gain its HTTP endpoint",
    )
    a_inst, b_inst = store.get_instance("10.0.0.1"), store.get_instance("10.0.0.2")
    assert a_inst is not None and a_inst.uid == a["metadata"]["uid"]
    assert a_inst.http_endpoint == "http://10.0.0.1:8001"
    assert b_inst is not None and b_inst.http_endpoint == "http://10.0.0.2:8000"
    assert b_inst.gen == gen_b and store.tier_members("10.0.0.2") == {11, 12, 13}
    wait_for(lambda: d.count("changes", action="updated") == 1, what="b updated, not replaced")
