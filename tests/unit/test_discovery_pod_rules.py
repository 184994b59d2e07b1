"""Pod rules the older pod tests left loose (issue 33, mutation testing of
``services/discovery/pods.py``): which config key a label problem names and which keys may be
empty, the 63-character label value limit, the exact master description the registry stores,
and the defaults of the master helpers."""

from __future__ import annotations

import json
from typing import Any

from common.config import DiscoveryVLLM, Labels, MooncakeMaster
from services.discovery import pods
from tests.fake_kube import make_pod

LABELS = Labels()
MM = MooncakeMaster()
VLLM = DiscoveryVLLM()
MASTER = {"openfuyao.com/kvmanager": "mooncake"}


def _master(**kw: Any) -> dict[str, Any]:
    return make_pod(kw.pop("name", "mc-0"), kw.pop("ip", "10.0.1.5"), MASTER, **kw)


def test_each_label_problem_names_its_config_key() -> None:
    bad = Labels(
        engine_key="bad key",
        engine_value="a b",
        pd_role_key="bad key",
        pd_role_value=["ok", "x,y"],
        kv_manager_key="bad key",
        kv_manager_value="-x",
        model_key="bad key",
    )
    assert pods.label_problems(bad) == [
        "discovery.labels.engineKey: 'bad key' is not a label key",
        "discovery.labels.pdRoleKey: 'bad key' is not a label key",
        "discovery.labels.kvManagerKey: 'bad key' is not a label key",
        "discovery.labels.modelKey: 'bad key' is not a label key",
        "discovery.labels.engineValue: 'a b' is not a label value",
        "discovery.labels.kvManagerValue: '-x' is not a label value",
        "discovery.labels.pdRoleValue[1]: 'x,y' is not a label value",
    ]


def test_only_the_role_and_model_keys_may_be_empty() -> None:
    # An empty role key means any role, an empty model key no model: both are valid.
    assert pods.label_problems(Labels(pd_role_key="", model_key="")) == []
    assert pods.label_problems(Labels(engine_key="")) == [
        "discovery.labels.engineKey: '' is not a label key"
    ]
    assert pods.label_problems(Labels(kv_manager_key="")) == [
        "discovery.labels.kvManagerKey: '' is not a label key"
    ]


def test_a_label_value_may_have_63_characters_not_64() -> None:
    assert pods.label_problems(Labels(engine_value="v" * 63)) == []
    assert pods.label_problems(Labels(kv_manager_value="m" * 63, pd_role_value=["r" * 63])) == []
    assert pods.label_problems(Labels(engine_value="v" * 64)) == [
        f"discovery.labels.engineValue: {'v' * 64!r} is not a label value"
    ]


def test_the_master_description_is_stored_in_one_canonical_form() -> None:
    """The registry's master hash holds this text; the reconciler rewrites the hash when the
    text differs, so its form (sorted keys, no spaces) is part of the stored value."""
    assert pods.master_json("mc-0", "10.0.1.5", 50051) == (
        '{"ip":"10.0.1.5","pod":"mc-0","rpc":50051}'
    )
    found = pods.mooncake_master(_master(ports={"http": 8080, "rpc": 50051}), LABELS, MM)
    assert found == ("http://10.0.1.5:8080", '{"ip":"10.0.1.5","pod":"mc-0","rpc":50051}')


def test_a_master_pod_without_a_name_is_described_with_an_empty_one() -> None:
    pod = _master()
    del pod["metadata"]["name"]
    found = pods.mooncake_master(pod, LABELS, MM)
    assert found is not None and json.loads(found[1])["pod"] == ""


def test_masters_are_http_urls_unless_a_scheme_is_given() -> None:
    two = [_master(name="mc-1", ip="10.0.1.6"), _master()]
    assert list(pods.desired_masters(two, LABELS, MM)) == [
        "http://10.0.1.5:9003",
        "http://10.0.1.6:9003",
    ]
    assert list(pods.desired_masters(two, LABELS, MM, "https")) == [
        "https://10.0.1.5:9003",
        "https://10.0.1.6:9003",
    ]


ENGINE = {"openfuyao.com/engine": "vllm", "openfuyao.com/pdRole": "prefill"}


def _two_containers(first: str, second: str, zmq_in: str | None) -> dict[str, Any]:
    """A vLLM pod with two containers started at different times, restarted 1 and 2 times;
    the ZMQ port (named ``zmq-pub``) on container ``zmq_in``, or on none."""
    pod = make_pod("p", "10.0.0.1", ENGINE)
    pod["spec"]["containers"] = [
        {
            "name": name,
            "ports": [
                {
                    "name": "zmq-pub" if name == zmq_in else "metrics",
                    "containerPort": 6000 if name == zmq_in else 9090,
                }
            ],
        }
        for name in (first, second)
    ]
    pod["status"]["containerStatuses"] = [
        {"name": name, "restartCount": n, "state": {"running": {"startedAt": at}}}
        for name, n, at in (
            (first, 1, "2024-01-01T00:00:10Z"),
            (second, 2, "2024-01-01T00:00:20Z"),
        )
    ]
    return pod


def _token(pod: dict[str, Any]) -> str:
    inst = pods.vllm_instance(pod, LABELS, DiscoveryVLLM(zmq_port_name="zmq-pub"))
    assert inst is not None
    return inst.restarts


def test_the_restart_token_follows_the_container_with_the_zmq_port() -> None:
    """Restart count of every container, start time of the one publishing KV events: the one
    with the ZMQ port, else the one named vllm, else the first."""
    t10, t20 = 1704067210, 1704067220
    assert _token(_two_containers("proxy", "engine", zmq_in="engine")) == f"3:{t20}"
    assert _token(_two_containers("engine", "proxy", zmq_in="engine")) == f"3:{t10}"
    assert _token(_two_containers("proxy", "vllm", zmq_in=None)) == f"3:{t20}"
    assert _token(_two_containers("proxy", "sidecar", zmq_in=None)) == f"3:{t10}"
    assert _token(_two_containers("sidecar", "proxy", zmq_in=None)) == f"3:{t10}"


def test_a_pod_that_does_not_count_does_not_hide_the_ones_after_it() -> None:
    web = make_pod("web", "10.0.0.9", {"app": "web"})
    pending = make_pod("pending", "10.0.0.8", ENGINE, ready=False)
    good = make_pod("good", "10.0.0.1", ENGINE)
    assert list(pods.desired_instances([web, pending, good], LABELS, VLLM)) == ["10.0.0.1"]


def test_the_restart_token_of_a_container_not_running_or_not_reported_has_start_0() -> None:
    """The token is stored with the instance and a change of it is a restart (the L1 index of
    the instance is dropped), so its value for a container without a start time is pinned:
    the same in every process and every version."""
    waiting = make_pod("p", "10.0.0.1", ENGINE, restarts=4)
    waiting["status"]["containerStatuses"][0]["state"] = {"waiting": {"reason": "CrashLoop"}}
    assert pods.restart_token(waiting, "vllm") == "4:0"
    unreadable = make_pod("p", "10.0.0.1", ENGINE, started_at="yesterday")
    assert pods.restart_token(unreadable, "vllm") == "0:0"
    not_reported = make_pod("p", "10.0.0.1", ENGINE, restarts=1)
    assert pods.restart_token(not_reported, "engine") == "1:0"
    del not_reported["status"]["containerStatuses"]
    assert pods.restart_token(not_reported, "vllm") == "0:0"


def test_odd_timestamps_and_a_pod_without_containers_still_classify() -> None:
    """A malformed pod must not break the pass (it would keep the whole registry stale)."""
    numeric = make_pod("p", "10.0.0.1", ENGINE, started_at=1704067200)  # type: ignore[arg-type]
    numeric["metadata"]["creationTimestamp"] = 1704067200
    inst = pods.vllm_instance(numeric, LABELS, VLLM)
    assert inst is not None and inst.restarts == "0:0"
    assert list(pods.desired_instances([numeric], LABELS, VLLM)) == ["10.0.0.1"]
    bare = make_pod("p", "10.0.0.1", ENGINE)
    del bare["spec"]
    inst = pods.vllm_instance(bare, LABELS, VLLM)
    assert inst is not None and inst.zmq_endpoint == "tcp://10.0.0.1:5557"
    assert inst.restarts == "0:0"  # no container to take a start time from


def test_missing_labels_and_names_are_registered_as_empty_and_the_uid_falls_back() -> None:
    """What the registry stores for a pod lacking a role label (any role admitted), the model
    label, its name or uid: empty strings, and the uid falls back to the name, then the IP
    (a uid change is a new instance)."""
    pod = make_pod("p", "10.0.0.1", {"openfuyao.com/engine": "vllm"})
    any_role = Labels(pd_role_value=[], model_key="example.com/model")
    inst = pods.vllm_instance(pod, any_role, VLLM)
    assert inst is not None and (inst.role, inst.model, inst.uid) == ("", "", "p")
    del pod["metadata"]["name"]
    inst = pods.vllm_instance(pod, any_role, VLLM)
    assert inst is not None and (inst.pod, inst.uid) == ("", "10.0.0.1")


def test_port_1_is_a_port() -> None:
    vllm = DiscoveryVLLM(replay_port=1, http_port=1)
    inst = pods.vllm_instance(make_pod("p", "10.0.0.1", ENGINE), LABELS, vllm)
    assert inst is not None
    assert (inst.replay_endpoint, inst.http_endpoint) == ("tcp://10.0.0.1:1", "http://10.0.0.1:1")
