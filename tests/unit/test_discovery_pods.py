"""Pod classification (services.discovery.pods), static lists, and the fake server's selectors."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import pytest
from kubernetes import client

from common.config import (
    Config,
    DiscoveryVLLM,
    Labels,
    MooncakeMaster,
    Static,
    StaticMaster,
    StaticVLLM,
)
from common.errors import ConfigError
from services.discovery import pods
from services.discovery.static import desired_from, static_uid
from tests.fake_kube import make_pod, parse_selector

LABELS = Labels()
VLLM = DiscoveryVLLM()
MM = MooncakeMaster()
ENGINE = {"openfuyao.com/engine": "vllm", "openfuyao.com/pdRole": "prefill"}
MASTER = {"openfuyao.com/kvmanager": "mooncake"}


def _pod(**kw: Any) -> dict[str, Any]:
    pod = make_pod(kw.pop("name", "p"), kw.pop("ip", "10.0.0.1"), kw.pop("labels", ENGINE), **kw)
    pod["metadata"]["uid"] = "uid-1"
    return pod


def test_serving_vllm_pod_becomes_an_instance_with_named_port() -> None:
    inst = pods.vllm_instance(_pod(ports={"zmq-pub": 6000}, restarts=2), LABELS, VLLM)
    assert inst is not None
    assert (inst.ip, inst.uid, inst.pod, inst.role) == ("10.0.0.1", "uid-1", "p", "prefill")
    assert inst.zmq_endpoint == "tcp://10.0.0.1:6000"
    assert inst.replay_endpoint == ""
    assert inst.dp_size == 1
    assert inst.restarts == "2:1704067200"


def test_port_falls_back_to_config_numbers_and_replay_port_by_name() -> None:
    vllm = DiscoveryVLLM(zmq_port=7000, replay_port_name="replay", data_parallel_size=4)
    inst = pods.vllm_instance(_pod(ports={"replay": 5558}), LABELS, vllm)
    assert inst is not None
    assert (inst.zmq_endpoint, inst.replay_endpoint) == (
        "tcp://10.0.0.1:7000",
        "tcp://10.0.0.1:5558",
    )
    assert inst.dp_size == 4
    numeric = pods.vllm_instance(_pod(), LABELS, DiscoveryVLLM(replay_port=5999))
    assert numeric is not None and numeric.replay_endpoint == "tcp://10.0.0.1:5999"


@pytest.mark.parametrize(
    "change",
    [
        {"ip": None},
        {"ready": False},
        {"phase": "Pending"},
        {"phase": "Succeeded"},
        {"labels": {"openfuyao.com/engine": "vllm", "openfuyao.com/pdRole": "decode"}},
        {"labels": {"openfuyao.com/engine": "sglang", "openfuyao.com/pdRole": "prefill"}},
        {"labels": {"openfuyao.com/pdRole": "prefill"}},
    ],
)
def test_pods_that_do_not_count(change: dict[str, Any]) -> None:
    assert pods.vllm_instance(_pod(**change), LABELS, VLLM) is None


def test_terminating_pod_does_not_count() -> None:
    pod = _pod()
    pod["metadata"]["deletionTimestamp"] = "2024-01-01T00:01:00Z"
    assert pods.vllm_instance(pod, LABELS, VLLM) is None


def test_restart_token_changes_with_any_restart_or_a_new_start_time() -> None:
    base = pods.restart_token(_pod(), "vllm")
    assert pods.restart_token(_pod(restarts=1), "vllm") != base
    assert pods.restart_token(_pod(started_at="2024-01-02T00:00:00Z"), "vllm") != base
    assert pods.restart_token(_pod(), "vllm") == base


def test_v1pod_objects_classify_like_their_json() -> None:
    raw = _pod(ports={"zmq-pub": 5557}, restarts=3)
    model = client.ApiClient().deserialize(json.dumps(raw), "V1Pod", "application/json")
    assert isinstance(model, client.V1Pod)
    started = model.status.container_statuses[0].state.running.started_at
    assert started == datetime(2024, 1, 1, tzinfo=UTC)
    as_json = client.ApiClient().sanitize_for_serialization(model)
    assert pods.vllm_instance(as_json, LABELS, VLLM) == pods.vllm_instance(raw, LABELS, VLLM)


def test_infernex_and_kserve_profiles_by_config_alone() -> None:
    infernex = Labels(
        engine_key="infernex.io/pdEngineGroup",
        engine_value="ns1.engine-a",
        pd_role_key="infernex.io/pdRole",
        pd_role_value=["prefill"],
    )
    assert (
        pods.vllm_selector(infernex)
        == "infernex.io/pdEngineGroup=ns1.engine-a,infernex.io/pdRole in (prefill)"
    )
    hit = {"infernex.io/pdEngineGroup": "ns1.engine-a", "infernex.io/pdRole": "prefill"}
    assert pods.vllm_instance(_pod(labels=hit), infernex, VLLM) is not None
    miss = {**hit, "infernex.io/pdRole": "decode"}
    assert pods.vllm_instance(_pod(labels=miss), infernex, VLLM) is None
    kserve = Labels(
        engine_key="app.kubernetes.io/name",
        engine_value="llama",
        pd_role_key="app.kubernetes.io/component",
        pd_role_value=["predictor"],
    )
    ok = {"app.kubernetes.io/name": "llama", "app.kubernetes.io/component": "predictor"}
    inst = pods.vllm_instance(_pod(labels=ok), kserve, VLLM)
    assert inst is not None and inst.role == "predictor"
    assert pods.label_problems(infernex) == [] and pods.label_problems(kserve) == []


def test_empty_role_list_means_any_role_and_bad_labels_are_reported() -> None:
    any_role = Labels(pd_role_value=[])
    assert pods.vllm_selector(any_role) == "openfuyao.com/engine=vllm"
    assert pods.is_vllm(_pod(labels={"openfuyao.com/engine": "vllm"}), any_role)
    bad = Labels(engine_key="", engine_value="a b", pd_role_value=["x,y"])
    problems = " ".join(pods.label_problems(bad))
    assert "engineKey" in problems and "engineValue" in problems and "pdRoleValue[0]" in problems


def test_ip_clash_newest_pod_wins() -> None:
    old, new = _pod(name="old"), _pod(name="new")
    new["metadata"]["uid"] = "uid-2"
    new["metadata"]["creationTimestamp"] = "2024-02-01T00:00:00Z"
    for order in ([old, new], [new, old]):
        chosen = pods.desired_instances(order, LABELS, VLLM)
        assert list(chosen) == ["10.0.0.1"] and chosen["10.0.0.1"].uid == "uid-2"


def test_master_pod_url_and_description() -> None:
    pod = _pod(name="mc-0", ip="10.0.1.5", labels=MASTER, ports={"http": 8080, "rpc": 50051})
    url, desc = pods.mooncake_master(pod, LABELS, MM, "https") or ("", "")
    assert url == "https://10.0.1.5:8080"
    assert json.loads(desc) == {"pod": "mc-0", "ip": "10.0.1.5", "rpc": 50051}
    fallback = pods.mooncake_master(_pod(labels=MASTER), LABELS, MM)
    assert fallback is not None and fallback[0] == "http://10.0.0.1:9003"
    assert json.loads(fallback[1])["rpc"] == 0
    assert pods.mooncake_master(_pod(labels=MASTER, ready=False), LABELS, MM) is None
    assert pods.mooncake_master(_pod(), LABELS, MM) is None  # a vLLM pod is not a master


def test_ipv6_endpoints_are_bracketed() -> None:
    inst = pods.vllm_instance(_pod(ip="fd00::5"), LABELS, VLLM)
    assert inst is not None and inst.zmq_endpoint == "tcp://[fd00::5]:5557"


def test_static_lists_become_the_desired_registry() -> None:
    static = Static(
        vllm=[
            StaticVLLM(
                ip="127.0.0.1",
                zmq_endpoint="tcp://127.0.0.1:5557",
                name="a",
                data_parallel_size=2,
                role="prefill",
            ),
            StaticVLLM(zmq_endpoint="tcp://127.0.0.2:5557", replay_endpoint="tcp://127.0.0.2:5558"),
        ],
        mooncake_masters=[StaticMaster(url="http://127.0.0.1:9003", name="mc")],
    )
    desired = desired_from(static)
    assert desired.instances is not None and desired.masters is not None
    a, b = desired.instances["127.0.0.1"], desired.instances["127.0.0.2"]
    assert (a.pod, a.dp_size, a.role, a.restarts) == ("a", 2, "prefill", "0")
    assert a.uid == static_uid("127.0.0.1", "tcp://127.0.0.1:5557", "")
    assert b.replay_endpoint == "tcp://127.0.0.2:5558" and b.uid != a.uid
    assert json.loads(desired.masters["http://127.0.0.1:9003"]) == {
        "pod": "mc",
        "ip": "127.0.0.1",
        "rpc": 0,
    }


def test_static_problems_are_all_reported() -> None:
    static = Static(
        vllm=[
            StaticVLLM(ip="127.0.0.1", zmq_endpoint="127.0.0.1:5557"),
            StaticVLLM(ip="127.0.0.1", zmq_endpoint="tcp://127.0.0.1:1", data_parallel_size=0),
        ],
        mooncake_masters=[StaticMaster(url="127.0.0.1:9003")],
    )
    with pytest.raises(ConfigError) as err:
        desired_from(static)
    text = str(err.value)
    for part in (
        "vllm[0].zmqEndpoint",
        "vllm[1].ip",
        "vllm[1].dataParallelSize",
        "mooncakeMasters[0].url",
    ):
        assert part in text
    assert desired_from(Config().discovery.static).instances == {}


@pytest.mark.parametrize(
    "selector,labels,expected",
    [
        ("a=1", {"a": "1"}, True),
        ("a==1", {"a": "2"}, False),
        ("a!=1", {}, True),
        ("a in (x, y),b", {"a": "y", "b": ""}, True),
        ("a in (x,y)", {"a": "z"}, False),
        ("a notin (x,y)", {"a": "z"}, True),
        ("!a", {"a": "1"}, False),
        ("a", {}, False),
        ("k.io/n=v,k.io/c in (p)", {"k.io/n": "v", "k.io/c": "p"}, True),
    ],
)
def test_fake_server_selector_parsing(
    selector: str, labels: dict[str, str], expected: bool
) -> None:
    assert parse_selector(selector)(labels) is expected


def test_the_served_model_is_read_from_the_configured_label_and_static_entries() -> None:
    labelled = _pod(labels={**ENGINE, "example.com/model": "Qwen3.5-4B"})
    assert pods.vllm_instance(labelled, LABELS, VLLM).model == ""  # type: ignore[union-attr]
    with_key = Labels(model_key="example.com/model")
    assert pods.vllm_instance(labelled, with_key, VLLM).model == "Qwen3.5-4B"  # type: ignore[union-attr]
    assert pods.label_problems(Labels(model_key="bad key!")) != []
    desired = desired_from(
        Static(
            vllm=[StaticVLLM(ip="10.0.0.3", zmq_endpoint="tcp://10.0.0.3:5557", model="gemma-3")]
        )
    )
    assert desired.instances is not None and desired.instances["10.0.0.3"].model == "gemma-3"


def test_the_openai_http_port_is_found_by_name_else_by_number_else_none() -> None:
    named = pods.vllm_instance(_pod(ports={"zmq-pub": 6000, "http": 8001}), LABELS, VLLM)
    assert named is not None and named.http_endpoint == "http://10.0.0.1:8001"
    fallback = pods.vllm_instance(_pod(), LABELS, VLLM)
    assert fallback is not None and fallback.http_endpoint == "http://10.0.0.1:8000"
    other_name = DiscoveryVLLM(http_port_name="openai", http_port=0)
    renamed = pods.vllm_instance(_pod(ports={"openai": 9000, "http": 8001}), LABELS, other_name)
    assert renamed is not None and renamed.http_endpoint == "http://10.0.0.1:9000"
    none = pods.vllm_instance(_pod(ports={"http": 8001}), LABELS, other_name)
    assert none is not None and none.http_endpoint == ""
    v6 = pods.vllm_instance(_pod(ip="fd00::5", ports={"http": 80}), LABELS, VLLM)
    assert v6 is not None and v6.http_endpoint == "http://[fd00::5]:80"


def test_static_http_endpoints_are_kept_checked_and_outside_the_uid() -> None:
    entry = StaticVLLM(ip="10.0.0.3", zmq_endpoint="tcp://10.0.0.3:5557")
    plain = desired_from(Static(vllm=[entry]))
    assert plain.instances is not None and plain.instances["10.0.0.3"].http_endpoint == ""
    entry.http_endpoint = "http://10.0.0.3:8000/"
    desired = desired_from(Static(vllm=[entry]))
    assert desired.instances is not None
    inst = desired.instances["10.0.0.3"]
    assert inst.http_endpoint == "http://10.0.0.3:8000"
    assert inst.uid == plain.instances["10.0.0.3"].uid  # a new port only updates the entry
    for bad in ("10.0.0.3:8000", "tcp://10.0.0.3:8000", "http://10.0.0.3", "http://:80"):
        entry.http_endpoint = bad
        with pytest.raises(ConfigError, match=r"vllm\[0\]\.httpEndpoint"):
            desired_from(Static(vllm=[entry]))
