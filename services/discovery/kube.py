"""Kubernetes discovery: list-then-watch pods in one namespace into in-memory pod caches.

Two :class:`PodWatcher` threads — one per label selector (vLLM pods, Mooncake master pods;
a selector cannot express "either") — each keep ``uid → pod`` (the API's JSON dicts) with
the official client:

    list (→ resourceVersion) ─► watch from it, bounded by timeoutSeconds ─► … ─► relist
         ▲                      │ stream ends early or breaks: re-watch from the last rv
         │                      │ 410 Gone (ERROR event or HTTP status): relist now
         └── capped backoff ◄───┘ API down, 403, 5xx: retry the list after a delay

Every ``discovery.refreshInterval`` the watcher relists anyway (a safety net for missed
events). A failed call never touches the cache: only a successful list, or a watch event,
changes what discovery believes, so the registry is not emptied while the API is away.
Each watcher's state is logged once per change (watching / relisting / failing: kind).

Watch events are read as raw JSON (``_RawWatch``): the classification in
:mod:`services.discovery.pods` reads the API dicts, and skipping the ``V1Pod`` model keeps a
pod the model cannot parse from breaking the watch.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal

import urllib3
import yaml
from kubernetes import client, config, watch
from kubernetes.client.exceptions import ApiException
from kubernetes.config.config_exception import ConfigException

from common.errors import ConfigError
from common.lifecycle import Backoff, StateLog
from common.settings import DiscoverySettings
from services.discovery import pods as podrules
from services.discovery.metrics import DiscoveryMetrics
from services.discovery.reconcile import Desired

logger = logging.getLogger(__name__)

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
CONNECT_TIMEOUT = 5.0
LIST_READ_TIMEOUT = 30.0
_MIN_WATCH = 1.0
"""A watch that ends sooner than this (seconds) without an error is reopened after a backoff."""


def connect(
    d: DiscoverySettings, env: Mapping[str, str], sa_dir: Path = SERVICE_ACCOUNT_DIR
) -> tuple[client.ApiClient, str]:
    """An API client and the namespace to watch.

    ``discovery.kubeconfig``, else ``$KUBECONFIG`` (its first file), else in-cluster (service
    account token + CA in ``sa_dir``). The namespace is ``discovery.namespace`` /
    ``POD_NAMESPACE``, else the kubeconfig context's or the service account's, else default.
    """
    conf = client.Configuration()
    # No urllib3 retry of refused connects (our loop backs off and logs once per state);
    # one retry of a read, for a pooled keep-alive connection the server closed.
    conf.retries = urllib3.Retry(total=1, connect=0, redirect=0, status=0)
    path = d.kubeconfig or env.get("KUBECONFIG", "").split(os.pathsep)[0]
    try:
        if path:
            config.load_kube_config(  # type: ignore[no-untyped-call]
                config_file=path, client_configuration=conf, persist_config=False
            )
            _, context = config.list_kube_config_contexts(path)  # type: ignore[no-untyped-call]
            namespace = str((context or {}).get("context", {}).get("namespace") or "")
        else:
            loader: Any = config.incluster_config.InClusterConfigLoader(  # type: ignore[no-untyped-call]
                token_filename=str(sa_dir / "token"),
                cert_filename=str(sa_dir / "ca.crt"),
                environ=env,
            )
            loader.load_and_set(conf)
            namespace = _read_text(sa_dir / "namespace")
    except (ConfigException, OSError, ValueError, TypeError, yaml.YAMLError) as exc:
        where = f"kubeconfig {path}" if path else "in-cluster config (no discovery.kubeconfig)"
        raise ConfigError(f"discovery: cannot load {where}: {exc}") from exc
    return client.ApiClient(conf), d.namespace or namespace or "default"


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8").strip()
    except OSError:
        return ""


class _RawWatch(watch.Watch):
    """A Watch yielding the API's JSON (``raw_object``) without building ``V1Pod`` models."""

    def get_return_type(self, func: Any) -> str:
        return ""


WatchError = Literal["gone", "forbidden", "unreachable", "api_error", "decode", "internal"]
"""What a failed list or watch call was (the errors counter's ``kind`` label)."""


def error_kind(exc: BaseException) -> WatchError:
    """A short label for logs and the errors counter."""
    if isinstance(exc, ApiException):
        status = int(exc.status or 0)
        if status == 410:
            return "gone"
        if status in (401, 403):
            return "forbidden"
        return "unreachable" if status == 0 else "api_error"
    if isinstance(exc, (urllib3.exceptions.HTTPError, OSError)):
        return "unreachable"
    if isinstance(exc, (ValueError, KeyError, TypeError)):
        return "decode"
    return "internal"


class PodWatcher:
    """Keeps every pod matching one label selector, by UID, from list + watch."""

    def __init__(
        self,
        name: str,
        api: client.CoreV1Api,
        namespace: str,
        selector: str,
        refresh: float,
        backoff: Backoff,
        metrics: DiscoveryMetrics,
        on_change: Callable[[], None],
    ) -> None:
        self.name, self.selector = name, selector
        self._api, self._ns, self._refresh = api, namespace, max(refresh, 1.0)
        self._backoff, self._metrics, self._on_change = backoff, metrics, on_change
        self._pods: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._watch: Any = _RawWatch()  # type: ignore[no-untyped-call]
        self._state = StateLog(logger, f"pods {name} [{selector}] in {namespace}")
        self._thread = threading.Thread(target=self._loop, name=f"watch-{name}", daemon=True)
        self.synced = False

    def start(self) -> None:
        self._thread.start()

    def close(self, timeout: float = 5.0) -> None:
        self._closing.set()
        deadline = time.monotonic() + timeout
        while self._thread.is_alive() and time.monotonic() < deadline:
            # stop() shuts the stream's socket down, unblocking a read in progress; repeated
            # because a stop() landing just before stream() opens its request is forgotten.
            self._watch.stop()
            self._thread.join(0.05)

    def pods(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._pods.values())

    def _loop(self) -> None:
        while not self._closing.is_set():
            try:
                rv = self._list()
                self._state.set("watching", f"{len(self._pods)} pods, rv {rv}")
                self._watch_until(rv, time.monotonic() + self._refresh)
            except Exception as exc:  # noqa: BLE001 - top of the loop: classify, back off
                if self._closing.is_set():
                    return
                self._fail(exc)

    def _fail(self, exc: BaseException) -> None:
        kind = error_kind(exc)
        self._metrics.errors.inc(kind=kind)
        if kind == "gone":
            self._state.set("relisting", "resource version expired (410)")
            return
        if kind == "internal":
            logger.exception("pods %s: unexpected error", self.name)
        self._state.set(
            f"failing: {kind}",
            f"{type(exc).__name__}: {_short(exc)}; keeping the last good pods",
            logging.WARNING,
        )
        self._closing.wait(self._backoff.next_delay())

    def _list(self) -> str:
        resp: Any = self._api.list_namespaced_pod(  # a urllib3 response (no preload)
            self._ns,
            label_selector=self.selector,
            _preload_content=False,
            _request_timeout=(CONNECT_TIMEOUT, LIST_READ_TIMEOUT),
        )
        try:
            body = json.loads(resp.data)
        finally:
            resp.release_conn()
        found = {_uid(p): p for p in body.get("items") or []}
        rv = str(body["metadata"]["resourceVersion"])
        with self._lock:
            self._pods = found
            self.synced = True
        self._metrics.relists.inc(source=self.name)
        self._backoff.reset()
        self._on_change()
        return rv

    def _watch_until(self, rv: str, deadline: float) -> None:
        """Watch from ``rv`` until the refresh deadline; resume after early ends or breaks."""
        first = True
        while not self._closing.is_set():
            left = deadline - time.monotonic()
            if left < 1.0:
                return
            if not first:
                self._metrics.watch_restarts.inc(source=self.name)
            first = False
            started = time.monotonic()
            try:
                rv = self._watch_once(rv, left)
                if time.monotonic() - started < _MIN_WATCH:  # ended at once: don't spin
                    self._closing.wait(self._backoff.next_delay())
                else:
                    self._backoff.reset()
            except urllib3.exceptions.ProtocolError as exc:
                if self._closing.is_set():
                    return
                self._metrics.errors.inc(kind="watch_broken")
                self._state.set("watch broken", _short(exc), logging.WARNING)
                self._closing.wait(self._backoff.next_delay())

    def _watch_once(self, rv: str, left: float) -> str:
        timeout = max(1, math.ceil(left))
        stream = self._watch.stream(
            self._api.list_namespaced_pod,
            self._ns,
            label_selector=self.selector,
            resource_version=rv,
            timeout_seconds=timeout,
            allow_watch_bookmarks=True,
            _request_timeout=(CONNECT_TIMEOUT, timeout + 5),
        )
        try:
            for event in stream:
                rv = self._apply(event) or rv
                self._state.set("watching")
                if self._closing.is_set():
                    break
        finally:
            stream.close()
        return rv

    def _apply(self, event: Any) -> str | None:
        """Apply one event to the cache; returns its resourceVersion."""
        if not isinstance(event, dict) or not isinstance(event.get("raw_object"), dict):
            self._metrics.errors.inc(kind="decode")
            return None
        kind, obj = event.get("type"), event["raw_object"]
        rv = (obj.get("metadata") or {}).get("resourceVersion")
        if kind in ("ADDED", "MODIFIED", "DELETED"):
            with self._lock:
                if kind == "DELETED":
                    self._pods.pop(_uid(obj), None)
                else:
                    self._pods[_uid(obj)] = obj
            logger.debug("pods %s: %s %s", self.name, kind, _uid(obj))
            self._on_change()
        return str(rv) if rv else None


def _uid(pod: Mapping[str, Any]) -> str:
    meta = pod.get("metadata") or {}
    return str(meta.get("uid") or meta.get("name") or "")


def _short(exc: BaseException) -> str:
    text = str(exc).replace("\n", " ")
    return text if len(text) <= 200 else text[:197] + "..."


class KubeSource:
    """The vLLM and Mooncake master pod caches of one namespace, as a :class:`Desired`."""

    def __init__(
        self,
        api_client: client.ApiClient,
        namespace: str,
        d: DiscoverySettings,
        metrics: DiscoveryMetrics,
    ) -> None:
        self.changed = threading.Event()
        self._d = d
        api = client.CoreV1Api(api_client)

        def watcher(name: str, selector: str) -> PodWatcher:
            return PodWatcher(
                name,
                api,
                namespace,
                selector,
                d.refresh_interval,
                Backoff(d.backoff_initial, d.backoff_max),
                metrics,
                self.changed.set,
            )

        self.vllm = watcher("vllm", podrules.vllm_selector(self._d.labels))
        self.masters = watcher("masters", podrules.master_selector(self._d.labels))

    def start(self) -> None:
        self.vllm.start()
        self.masters.start()

    def desired(self) -> Desired:
        d = self._d
        instances = (
            podrules.desired_instances(self.vllm.pods(), d.labels, d.vllm)
            if self.vllm.synced
            else None
        )
        masters = (
            podrules.desired_masters(
                self.masters.pods(), d.labels, d.mooncake_master, d.master_scheme
            )
            if self.masters.synced
            else None
        )
        return Desired(instances=instances, masters=masters)

    def close(self) -> None:
        self.vllm.close()
        self.masters.close()
