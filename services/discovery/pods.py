"""Pure pod classification: which pods are vLLM instances or Mooncake masters, and their identity.

Input is a pod as the API server sends it — the camelCase JSON dict that list and watch
return — so every rule here is unit-tested with plain dicts. No I/O.

Rules (the label keys and values come only from ``discovery.labels``):

- A pod *counts* while it has an IP, is ``Running``, its ``Ready`` condition is ``True`` and
  it is not terminating (no ``deletionTimestamp``). Anything else is absent from the
  registry, so a pod that stops being ready leaves it.
- vLLM instance: ``engineKey=engineValue`` and ``pdRoleKey`` in ``pdRoleValue`` (an empty
  ``pdRoleValue`` list means any role). Its ZMQ port is the container port named
  ``vllm.zmqPortName``, else ``vllm.zmqPort``; likewise the optional replay port and the
  OpenAI-compatible HTTP port (``vllm.httpPortName``/``httpPort``, registered as
  ``http://<ip>:<port>`` for the audit probes; ``httpPort: 0`` and no named port = none).
- Mooncake master: ``kvManagerKey=kvManagerValue``; ports ``httpPortName``/``rpcPortName``,
  else the numeric ``httpPort``/``rpcPort``. Registered as ``<scheme>://<ip>:<http>`` →
  ``{"ip", "pod", "rpc"}`` JSON.
- Restart token ``"<sum of restartCounts>:<vLLM container startedAt, epoch s>"``: it changes
  when any container of the pod restarts, which the store treats as an instance restart.
- Two counted pods on one IP (hostNetwork, or a lingering old pod): the newest
  (creationTimestamp, then name) wins, so the choice is the same in every process.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any

from common.config import DiscoveryVLLM, Labels, MooncakeMaster
from common.store import Instance

Pod = Mapping[str, Any]

_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_LABEL_KEY = re.compile(
    r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
)


def label_problems(labels: Labels) -> list[str]:
    """Config problems that would make the API server reject our label selectors."""
    problems = []
    for name, key in (
        ("engineKey", labels.engine_key),
        ("pdRoleKey", labels.pd_role_key),
        ("kvManagerKey", labels.kv_manager_key),
        ("modelKey", labels.model_key),
    ):
        required = name not in ("pdRoleKey", "modelKey")  # no role key = any role
        if (key or required) and not _LABEL_KEY.match(key):
            problems.append(f"discovery.labels.{name}: {key!r} is not a label key")
    values = [("engineValue", labels.engine_value), ("kvManagerValue", labels.kv_manager_value)]
    values += [(f"pdRoleValue[{i}]", v) for i, v in enumerate(labels.pd_role_value)]
    for name, value in values:
        if len(value) > 63 or not _LABEL_VALUE.match(value):
            problems.append(f"discovery.labels.{name}: {value!r} is not a label value")
    return problems


def vllm_selector(labels: Labels) -> str:
    """``engineKey=engineValue,pdRoleKey in (a,b)`` — the server-side filter for vLLM pods."""
    terms = [f"{labels.engine_key}={labels.engine_value}"]
    if labels.pd_role_key and labels.pd_role_value:
        terms.append(f"{labels.pd_role_key} in ({','.join(labels.pd_role_value)})")
    return ",".join(terms)


def master_selector(labels: Labels) -> str:
    return f"{labels.kv_manager_key}={labels.kv_manager_value}"


def is_vllm(pod: Pod, labels: Labels) -> bool:
    have = _labels(pod)
    if have.get(labels.engine_key) != labels.engine_value:
        return False
    if labels.pd_role_key and labels.pd_role_value:
        return have.get(labels.pd_role_key) in labels.pd_role_value
    return True


def is_master(pod: Pod, labels: Labels) -> bool:
    return _labels(pod).get(labels.kv_manager_key) == labels.kv_manager_value


def is_serving(pod: Pod) -> bool:
    """Running, has an IP, Ready, and not terminating."""
    status = pod.get("status") or {}
    if status.get("phase") != "Running" or not status.get("podIP"):
        return False
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        return False
    return any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in status.get("conditions") or []
    )


def vllm_instance(pod: Pod, labels: Labels, vllm: DiscoveryVLLM) -> Instance | None:
    """The registry entry for a serving vLLM pod, else None."""
    if not is_vllm(pod, labels) or not is_serving(pod):
        return None
    meta, ip = pod.get("metadata") or {}, str(pod["status"]["podIP"])
    container = _vllm_container(pod, vllm.zmq_port_name)
    replay_port = _port(pod, vllm.replay_port_name, vllm.replay_port)
    http_port = _port(pod, vllm.http_port_name, vllm.http_port)
    return Instance(
        ip=ip,
        uid=str(meta.get("uid") or meta.get("name") or ip),
        pod=str(meta.get("name", "")),
        zmq_endpoint=f"tcp://{host_port(ip, _port(pod, vllm.zmq_port_name, vllm.zmq_port))}",
        replay_endpoint=f"tcp://{host_port(ip, replay_port)}" if replay_port > 0 else "",
        dp_size=vllm.data_parallel_size,
        role=_labels(pod).get(labels.pd_role_key, ""),
        restarts=restart_token(pod, container),
        model=_labels(pod).get(labels.model_key, "") if labels.model_key else "",
        http_endpoint=f"http://{host_port(ip, http_port)}" if http_port > 0 else "",
    )


def mooncake_master(
    pod: Pod, labels: Labels, mm: MooncakeMaster, scheme: str = "http"
) -> tuple[str, str] | None:
    """(master URL, JSON description) for a serving Mooncake master pod, else None."""
    if not is_master(pod, labels) or not is_serving(pod):
        return None
    ip, name = str(pod["status"]["podIP"]), str((pod.get("metadata") or {}).get("name", ""))
    url = f"{scheme}://{host_port(ip, _port(pod, mm.http_port_name, mm.http_port))}"
    return url, master_json(name, ip, _port(pod, mm.rpc_port_name, mm.rpc_port))


def master_json(pod: str, ip: str, rpc: int) -> str:
    return json.dumps({"ip": ip, "pod": pod, "rpc": rpc}, sort_keys=True, separators=(",", ":"))


def desired_instances(
    pods: Iterable[Pod], labels: Labels, vllm: DiscoveryVLLM
) -> dict[str, Instance]:
    """pod IP → Instance over every counted vLLM pod (IP clashes: newest pod wins)."""
    chosen: dict[str, tuple[tuple[float, str], Instance]] = {}
    for pod in pods:
        inst = vllm_instance(pod, labels, vllm)
        if inst is None:
            continue
        rank = (_epoch((pod.get("metadata") or {}).get("creationTimestamp")), inst.pod)
        if inst.ip not in chosen or rank > chosen[inst.ip][0]:
            chosen[inst.ip] = (rank, inst)
    return {ip: inst for ip, (_, inst) in chosen.items()}


def desired_masters(
    pods: Iterable[Pod], labels: Labels, mm: MooncakeMaster, scheme: str = "http"
) -> dict[str, str]:
    found = (mooncake_master(p, labels, mm, scheme) for p in pods)
    return dict(sorted(m for m in found if m is not None))


def restart_token(pod: Pod, container: str) -> str:
    status = pod.get("status") or {}
    statuses = status.get("containerStatuses") or []
    total = sum(int(s.get("restartCount") or 0) for s in statuses)
    started = 0
    for s in statuses:
        if s.get("name") == container:
            running = (s.get("state") or {}).get("running") or {}
            started = int(_epoch(running.get("startedAt")))
    return f"{total}:{started}"


def host_port(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def _labels(pod: Pod) -> dict[str, str]:
    return dict((pod.get("metadata") or {}).get("labels") or {})


def _containers(pod: Pod) -> list[Mapping[str, Any]]:
    return list((pod.get("spec") or {}).get("containers") or [])


def _port(pod: Pod, name: str, fallback: int) -> int:
    if name:
        for container in _containers(pod):
            for port in container.get("ports") or []:
                if port.get("name") == name and port.get("containerPort"):
                    return int(port["containerPort"])
    return fallback


def _vllm_container(pod: Pod, zmq_port_name: str) -> str:
    """The container publishing KV events: the one with the ZMQ port, else 'vllm', else first."""
    containers = _containers(pod)
    for c in containers:
        if any(p.get("name") == zmq_port_name for p in c.get("ports") or []):
            return str(c.get("name", ""))
    names = [str(c.get("name", "")) for c in containers]
    return "vllm" if "vllm" in names else (names[0] if names else "")


def _epoch(value: Any) -> float:
    """RFC 3339 string (the API's JSON) → epoch seconds; 0 when absent or unreadable."""
    if isinstance(value, str) and value:
        try:
            return datetime.fromisoformat(value).timestamp()
        except ValueError:
            return 0.0
    return 0.0
