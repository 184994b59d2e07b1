"""Discovery with more than one ``pdRoleValue`` (issue 33): the default role list
``[prefill, aggregate]`` against pods of every listed role, an unlisted one and none, through
the fake API server's list and watch (tests/fake_kube.py) into a real redis-server.

Two filters decide: the server-side label selector (``services/discovery/pods.py``
``vllm_selector``) and the client-side check of each pod (``is_vllm``). A selector that drops a
role loses its pods at the server; one that drops the role term is hidden by the client check,
so the selector string the client sends is checked too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
import redis

from tests.conftest import RedisServer, wait_for
from tests.fake_kube import FakeKube, make_pod
from tests.services.discovery_support import RunningDiscovery, merge, write_config
from tests.store_oracle import OracleStore

ENGINE = {"openfuyao.com/engine": "vllm"}
ROLE = "openfuyao.com/pdRole"


def pod(name: str, ip: str, role: str | None) -> dict[str, Any]:
    labels = dict(ENGINE) if role is None else {**ENGINE, ROLE: role}
    return make_pod(name, ip, labels)


def set_role(role: str | None) -> Callable[[dict[str, Any]], None]:
    def change(p: dict[str, Any]) -> None:
        labels = p["metadata"]["labels"]
        labels.pop(ROLE, None)
        if role is not None:
            labels[ROLE] = role

    return change


def selector_terms(kube: FakeKube) -> set[frozenset[tuple[str, frozenset[str]]]]:
    """Every label selector the client sent, as sets of (key, accepted values) terms."""
    seen = set()
    for request in kube.requests:
        text = parse_qs(urlsplit(request).query).get("labelSelector", [""])[0]
        terms = []
        for raw in _split(text):
            key, _, values = raw.replace(" in ", "=").partition("=")
            terms.append((key.strip(), frozenset(v.strip() for v in values.strip("()").split(","))))
        seen.add(frozenset(terms))
    return seen


def _split(text: str) -> list[str]:
    """Selector terms split on the commas outside parentheses."""
    out, depth, cur = [], 0, ""
    for ch in text:
        depth += (ch == "(") - (ch == ")")
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    return [*out, cur] if cur else out


@pytest.fixture()
def kube() -> Iterator[FakeKube]:
    server = FakeKube().start()
    yield server
    server.stop()


@pytest.fixture()
def store(redis_client: redis.Redis) -> OracleStore:
    return OracleStore(redis_client)


@pytest.fixture()
def discovery(
    tmp_path: Path, redis_server: RedisServer, kube: FakeKube
) -> Iterator[Callable[..., RunningDiscovery]]:
    running: list[RunningDiscovery] = []

    def _start(extra: dict[str, Any] | None = None) -> RunningDiscovery:
        kc = kube.write_kubeconfig(tmp_path / "kubeconfig")
        cfg = write_config(
            tmp_path / "config.yaml",
            redis_server.url,
            merge({"discovery": {"kubeconfig": str(kc)}}, extra or {}),
        )
        running.append(RunningDiscovery.from_file(cfg).start())
        return running[-1]

    yield _start
    for d in running:
        d.close()


def roles(store: OracleStore) -> dict[str, str]:
    out = {}
    for ip in store.instance_ips():
        inst = store.get_instance(ip)
        if inst is not None:
            out[ip] = inst.role
    return out


def test_the_default_role_list_admits_every_listed_role_and_no_other(
    kube: FakeKube, discovery: Callable[..., RunningDiscovery], store: OracleStore
) -> None:
    """The default config: prefill and aggregate pods are instances, decode and role-less
    pods are not, at the first list and through the watch as labels change."""
    kube.add_pod(pod("p", "10.0.0.1", "prefill"))
    kube.add_pod(pod("a", "10.0.0.2", "aggregate"))
    kube.add_pod(pod("d", "10.0.0.3", "decode"))
    kube.add_pod(pod("none", "10.0.0.4", None))
    discovery()
    want = {"10.0.0.1": "prefill", "10.0.0.2": "aggregate"}
    wait_for(lambda: roles(store) == want, what=f"exactly {want}")
    sent = selector_terms(kube)
    vllm = frozenset(
        {(k, frozenset({"vllm"})) for k in ENGINE} | {(ROLE, frozenset({"prefill", "aggregate"}))}
    )
    assert vllm in sent, f"no vLLM selector with both roles among {sent}"
    assert all(
        dict(terms).get(ROLE) in (None, frozenset({"prefill", "aggregate"})) for terms in sent
    ), sent

    # Through the watch: roles change both ways, a new pod of the second role arrives.
    kube.modify_pod("d", set_role("aggregate"))
    kube.modify_pod("p", set_role("decode"))
    kube.modify_pod("none", set_role("prefill"))
    kube.add_pod(pod("a2", "10.0.0.5", "aggregate"))
    want = {"10.0.0.2": "aggregate", "10.0.0.3": "aggregate", "10.0.0.4": "prefill"}
    want["10.0.0.5"] = "aggregate"
    wait_for(lambda: roles(store) == want, what=f"exactly {want} after the changes")
    kube.modify_pod("a", set_role(None))
    kube.modify_pod("a2", set_role("Aggregate"))  # label values are case-sensitive
    want = {"10.0.0.3": "aggregate", "10.0.0.4": "prefill"}
    wait_for(lambda: roles(store) == want, what=f"exactly {want} after the last changes")


@pytest.mark.parametrize(
    ("values", "admitted"),
    [
        (["decode", "prefill", "aggregate"], {"10.0.0.1", "10.0.0.2", "10.0.0.3"}),
        (["aggregate"], {"10.0.0.2"}),
        ([], {"10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.0.4"}),  # empty: any role, or none
    ],
)
def test_a_configured_role_list_is_the_filter(
    kube: FakeKube,
    discovery: Callable[..., RunningDiscovery],
    store: OracleStore,
    values: list[str],
    admitted: set[str],
) -> None:
    kube.add_pod(pod("p", "10.0.0.1", "prefill"))
    kube.add_pod(pod("a", "10.0.0.2", "aggregate"))
    kube.add_pod(pod("d", "10.0.0.3", "decode"))
    kube.add_pod(pod("none", "10.0.0.4", None))
    kube.add_pod(make_pod("web", "10.0.0.9", {"app": "web", ROLE: "prefill"}))
    discovery({"discovery": {"labels": {"pdRoleValue": values}}})
    wait_for(lambda: set(roles(store)) == admitted, what=f"exactly {sorted(admitted)}")
    vllm = [dict(t) for t in selector_terms(kube) if any(k in ENGINE for k, _ in t)]
    role_terms = {terms.get(ROLE) for terms in vllm}
    assert vllm and role_terms == {frozenset(values) if values else None}, role_terms
