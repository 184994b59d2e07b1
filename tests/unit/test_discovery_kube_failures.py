"""services.discovery.kube's failure handling, in-process (found open by mutation testing,
issue 33): how a failed list or watch call is classified (the errors counter's ``kind`` and
the state line operators read), what a watcher does with each kind, its watch events, and
the small helpers. The list/watch behaviour against an API server is in
tests/services/test_discovery_kube.py; each test here names the wrong versions it kills,
applied by hand and seen to fail (docs/testing.md, "Issue 33")."""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import urllib3
import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from common.config import Config
from common.errors import ConfigError
from common.lifecycle import Backoff
from common.metrics import Registry
from services.discovery import kube
from services.discovery import pods as podrules
from services.discovery.kube import PodWatcher, error_kind
from common.settings import DiscoverySettings
from services.discovery.metrics import DiscoveryMetrics
from services.discovery.reconcile import Desired
from tests.metrics_oracle import value_of


@pytest.mark.parametrize(
    ("exc", "kind"),
    [
        (ApiException(status=410), "gone"),
        (ApiException(status=401), "forbidden"),
        (ApiException(status=403), "forbidden"),
        (ApiException(status=402), "api_error"),
        (ApiException(status=404), "api_error"),
        (ApiException(status=500), "api_error"),
        (ApiException(status=1), "api_error"),
        (ApiException(status=0), "unreachable"),
        (ApiException(status=None), "unreachable"),  # the client's own failure: no response
        (urllib3.exceptions.MaxRetryError(None, "/api"), "unreachable"),
        (ConnectionRefusedError(), "unreachable"),
        (ValueError("bad json"), "decode"),
        (KeyError("metadata"), "decode"),
        (TypeError("not a dict"), "decode"),
        (RuntimeError("bug"), "internal"),
    ],
)
def test_each_failure_has_its_kind(exc: BaseException, kind: str) -> None:
    """Kills 402 for 401, ``status or 1`` (no response taken for an HTTP answer), the
    ``unreachable``/``api_error`` choice inverted or on ``status == 1``, and the labels'
    texts (``XXdecodeXX``, ``INTERNAL``…: the counter's label values are an interface)."""
    assert error_kind(exc) == kind


class _Clock:
    """Stands in for the watcher's closing Event: records the back-off waits."""

    def __init__(self) -> None:
        self.waits: list[float] = []

    def wait(self, seconds: float) -> bool:
        self.waits.append(seconds)
        return False

    def is_set(self) -> bool:
        return False


def _watcher(changes: list[int] | None = None) -> tuple[PodWatcher, DiscoveryMetrics, _Clock]:
    metrics = DiscoveryMetrics.register(Registry())
    seen = changes if changes is not None else []
    w = PodWatcher(
        "vllm",
        None,  # type: ignore[arg-type] - no call reaches the API here
        "ns",
        "app=vllm",
        60.0,
        Backoff(2.0, 2.0),
        metrics,
        lambda: seen.append(1),
    )
    clock = _Clock()
    w._closing = clock  # type: ignore[assignment]
    return w, metrics, clock


def test_a_410_relists_at_once_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    """Kills ``kind != "gone"`` (every failure relisting at once, a 410 backing off), the
    relisting state or its reason dropped or changed."""
    w, metrics, clock = _watcher()
    with caplog.at_level(logging.INFO, logger=kube.__name__):
        w._fail(ApiException(status=410))
    assert clock.waits == []  # no back-off: the resource version is simply too old
    assert w._state.state == "relisting"
    assert "pods vllm [app=vllm] in ns: relisting (resource version expired (410))" in (caplog.text)
    assert value_of(metrics.errors, kind="gone") == 1


@pytest.mark.parametrize(
    ("exc", "kind"),
    [
        (ApiException(status=403, reason="Forbidden"), "forbidden"),
        (RuntimeError("boom"), "internal"),
    ],
)
def test_any_other_failure_backs_off_keeping_the_pods_and_says_why(
    exc: BaseException, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Kills the failing state's text or detail dropped (``None``), the exception's type or
    message not named, and the back-off skipped."""
    w, metrics, clock = _watcher()
    w._pods = {"u1": {"metadata": {"uid": "u1"}}}
    with caplog.at_level(logging.INFO, logger=kube.__name__):
        w._fail(exc)
    assert len(clock.waits) == 1 and 1.0 <= clock.waits[0] <= 2.0  # Backoff(2, 2): [cap/2, cap]
    assert w._state.state == f"failing: {kind}"
    line = [r for r in caplog.records if "failing" in r.getMessage()][-1]
    assert line.levelno == logging.WARNING
    assert f"{type(exc).__name__}: {kube._short(exc)}; keeping the last good pods" in (
        line.getMessage()
    )
    assert str(exc).split("\n")[0][:20] in line.getMessage()
    assert w.pods() == [{"metadata": {"uid": "u1"}}]
    assert value_of(metrics.errors, kind=kind) == 1


def test_only_an_unexpected_error_is_logged_with_its_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Kills ``kind != "internal"`` and the traceback line's text or arguments changed."""
    for exc, traced in ((RuntimeError("boom"), True), (ApiException(status=500), False)):
        w, _, _ = _watcher()
        caplog.clear()
        with caplog.at_level(logging.INFO, logger=kube.__name__):
            w._fail(exc)
        tracebacks = [r for r in caplog.records if r.exc_info]
        assert bool(tracebacks) == traced, exc
        if traced:
            assert tracebacks[0].getMessage() == "pods vllm: unexpected error"


def test_watch_events_change_the_pods_and_give_their_resource_version() -> None:
    w, metrics, _ = _watcher(changes := [])
    pod = {"metadata": {"uid": "u1", "name": "p1", "resourceVersion": "7"}}
    assert w._apply({"type": "ADDED", "raw_object": pod}) == "7"
    assert w.pods() == [pod] and len(changes) == 1
    moved = {"metadata": {"uid": "u1", "name": "p1", "resourceVersion": "8"}, "x": 1}
    assert w._apply({"type": "MODIFIED", "raw_object": moved}) == "8"
    assert w.pods() == [moved]
    bookmark = {"metadata": {"resourceVersion": "9"}}
    assert w._apply({"type": "BOOKMARK", "raw_object": bookmark}) == "9"
    assert w.pods() == [moved] and len(changes) == 2  # a bookmark changes nothing
    assert w._apply({"type": "DELETED", "raw_object": moved}) == "8"
    assert w.pods() == [] and len(changes) == 3
    gone = {"metadata": {"uid": "never-seen", "resourceVersion": "10"}}
    assert w._apply({"type": "DELETED", "raw_object": gone}) == "10"  # not known: no error
    for bad in (None, "x", {"type": "ADDED"}, {"type": "ADDED", "raw_object": "x"}):
        assert w._apply(bad) is None
    assert value_of(metrics.errors, kind="decode") == 4
    assert w._apply({"type": "ADDED", "raw_object": {"metadata": {"name": "p2"}}}) is None
    assert [kube._uid(p) for p in w.pods()] == ["p2"]  # no uid: keyed by name


def test_the_small_helpers(tmp_path: Path) -> None:
    """``_read_text`` (the service account's namespace file) and ``_short`` (a state line's
    detail). Kills the missing file read as ``"XXXX"``, the text not stripped, the cut at
    another length, a pod keyed by its name while it has a UID."""
    (tmp_path / "namespace").write_bytes("  équipe-1\n".encode())
    assert kube._read_text(tmp_path / "namespace") == "équipe-1"
    assert kube._read_text(tmp_path / "missing") == ""
    assert kube._short(ValueError("a\nb")) == "a b"
    assert kube._short(ValueError("x" * 200)) == "x" * 200
    assert kube._short(ValueError("x" * 201)) == "x" * 197 + "..."
    assert kube._uid({}) == "" and kube._uid({"metadata": None}) == ""
    assert kube._uid({"metadata": {"uid": "", "name": "n"}}) == "n"
    # keyed by UID, not name: a pod replaced under the same name (a StatefulSet's) is another
    assert kube._uid({"metadata": {"uid": "u", "name": "n"}}) == "u"


# -- connect: which kubeconfig, which namespace, which retries --------------------------------


def _settings(**changes: str) -> DiscoverySettings:
    return dataclasses.replace(DiscoverySettings.from_config(Config()), **changes)


def _kubeconfig(path: Path, namespace: str | None) -> Path:
    context: dict[str, str] = {"cluster": "c", "user": "u"}
    if namespace is not None:
        context["namespace"] = namespace
    doc = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "c", "cluster": {"server": "http://127.0.0.1:1"}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "x", "context": context}],
        "current-context": "x",
    }
    path.write_text(yaml.safe_dump(doc))
    return path


def test_the_kubeconfig_env_names_the_file_and_its_context_the_namespace(tmp_path: Path) -> None:
    """Without ``discovery.kubeconfig``, the first file of ``$KUBECONFIG`` is loaded and its
    context's namespace watched; ``discovery.namespace`` wins over it; a context without one
    watches ``default``. Kills ``$KUBECONFIG`` read under another name, the context's
    namespace not read (10 ways) or replaced by ``"XXXX"``."""
    first = _kubeconfig(tmp_path / "first.yaml", "team-a")
    second = _kubeconfig(tmp_path / "second.yaml", "team-b")
    env = {"KUBECONFIG": f"{first}{os.pathsep}{second}"}
    api, namespace = kube.connect(_settings(), env)
    assert namespace == "team-a" and api.configuration.host == "http://127.0.0.1:1"
    assert kube.connect(_settings(namespace="mine"), env)[1] == "mine"
    bare = _kubeconfig(tmp_path / "bare.yaml", None)
    assert kube.connect(_settings(), {"KUBECONFIG": str(bare)})[1] == "default"
    assert kube.connect(_settings(kubeconfig=str(second)), env)[1] == "team-b"


def test_no_urllib3_retry_of_a_refused_connect_and_one_of_a_read(tmp_path: Path) -> None:
    """The discovery loop backs off and logs once per state, so urllib3 must not retry a
    refused connect or a redirect or a status itself; one read retry covers a pooled
    keep-alive connection the server closed. Kills every other ``Retry``."""
    path = _kubeconfig(tmp_path / "k.yaml", "ns")
    api, _ = kube.connect(_settings(kubeconfig=str(path)), {})
    retries = api.configuration.retries
    assert isinstance(retries, urllib3.Retry)
    assert (retries.total, retries.connect, retries.redirect, retries.status) == (1, 0, 0, 0)


def test_close_stops_the_watch_until_the_thread_ends_or_the_timeout_passes() -> None:
    """``close`` keeps stopping the watch stream (a stop landing before the stream opens is
    forgotten) while the thread lives, and gives up after its timeout. Kills the deadline
    taken as already passed (``monotonic() - timeout``: the stream is never stopped) or
    ``None``."""
    w, _, _ = _watcher()
    stops: list[float] = []
    release = threading.Event()

    class _Watch:
        def stop(self) -> None:
            stops.append(time.monotonic())
            if len(stops) >= 3:
                release.set()

    w._closing = threading.Event()
    w._watch = _Watch()
    w._thread = threading.Thread(target=release.wait, daemon=True)
    w._thread.start()
    w.close(timeout=60.0)
    assert len(stops) >= 3 and not w._thread.is_alive()
    stuck, _, _ = _watcher()
    stuck._closing = threading.Event()
    stuck._watch = _Watch()
    hold = threading.Event()
    stuck._thread = threading.Thread(target=hold.wait, daemon=True)
    stuck._thread.start()
    stuck.close(timeout=0.2)  # returns although the thread still runs
    assert stuck._thread.is_alive()
    hold.set()


# -- what a watcher asks the API server ---------------------------------------------------------


class _Response:
    def __init__(self, body: bytes) -> None:
        self.data, self.released = body, False

    def release_conn(self) -> None:
        self.released = True


class _Api:
    """``list_namespaced_pod`` recording its calls and answering one list."""

    def __init__(self, body: bytes) -> None:
        self.calls: list[tuple[tuple[object, ...], dict[str, object]]] = []
        self.response = _Response(body)

    def list_namespaced_pod(self, *args: object, **kwargs: object) -> _Response:
        self.calls.append((args, kwargs))
        return self.response


class _Stream:
    def __init__(self, events: list[dict[str, object]]) -> None:
        self.events, self.closed = events, False

    def __iter__(self) -> Iterator[dict[str, object]]:
        return iter(self.events)

    def close(self) -> None:
        self.closed = True


class _RecordingWatch:
    def __init__(self, events: list[dict[str, object]]) -> None:
        self.calls: list[tuple[tuple[object, ...], dict[str, object]]] = []
        self.stream_made = _Stream(events)

    def stream(self, *args: object, **kwargs: object) -> _Stream:
        self.calls.append((args, kwargs))
        return self.stream_made


def test_a_list_asks_for_the_raw_pods_of_its_selector_with_bounded_timeouts() -> None:
    """Kills the list's selector, raw response (``_preload_content``) or timeouts dropped,
    the connection not released, the resource version or pods not taken from the body."""
    body = b'{"metadata": {"resourceVersion": "42"}, "items": [{"metadata": {"uid": "u1"}}]}'
    api = _Api(body)
    changes: list[int] = []
    w, metrics, _ = _watcher(changes)
    w._api = api  # type: ignore[assignment]
    assert w._list() == "42"
    assert api.calls == [
        (
            ("ns",),
            {
                "label_selector": "app=vllm",
                "_preload_content": False,
                "_request_timeout": (kube.CONNECT_TIMEOUT, kube.LIST_READ_TIMEOUT),
            },
        )
    ]
    assert api.response.released and w.synced and len(changes) == 1
    assert w.pods() == [{"metadata": {"uid": "u1"}}]
    assert value_of(metrics.relists, source="vllm") == 1


def test_a_watch_resumes_from_its_version_with_bookmarks_and_a_bounded_read() -> None:
    """Kills the watch's resource version, bookmarks, server-side timeout (at least 1 s,
    rounded up) or read timeout (5 s more) changed or dropped, the stream left open, and
    the version lost to an event without one."""
    pod = {"metadata": {"uid": "u2", "resourceVersion": "50"}}
    # an event without a version (here a malformed one) keeps the last one
    recording = _RecordingWatch([{"type": "ADDED", "raw_object": pod}, {"type": "ADDED"}])
    w, _, _ = _watcher()
    api = _Api(b"")
    w._api, w._watch = api, recording  # type: ignore[assignment]
    assert w._watch_once("42", 12.2) == "50"
    ((args, kwargs),) = recording.calls
    assert args == (api.list_namespaced_pod, "ns")
    assert kwargs == {
        "label_selector": "app=vllm",
        "resource_version": "42",
        "timeout_seconds": 13,
        "allow_watch_bookmarks": True,
        "_request_timeout": (kube.CONNECT_TIMEOUT, 18),
    }
    assert recording.stream_made.closed and w.pods() == [pod]
    w._watch = _RecordingWatch([])
    assert w._watch_once("50", 0.2) == "50"
    assert w._watch.calls[0][1]["timeout_seconds"] == 1


class _ClosingWatch(_RecordingWatch):
    """A watch whose streams end at once; the watcher is closed after ``calls`` of them."""

    def __init__(self, closing: threading.Event, calls: int) -> None:
        super().__init__([])
        self.closing, self.limit = closing, calls

    def stream(self, *args: object, **kwargs: object) -> _Stream:
        super().stream(*args, **kwargs)
        if len(self.calls) >= self.limit:
            self.closing.set()
        return _Stream([])


@pytest.mark.parametrize("calls", [1, 3])
def test_only_a_reopened_watch_counts_as_a_restart(calls: int) -> None:
    """The first watch after a list is not a restart; each reopening is. Kills ``first``
    starting false (every list would count a watch restart)."""
    w, metrics, _ = _watcher()
    closing = _RecordingEvent()  # never blocks: a lost back-off fails, it does not hang
    w._api, w._closing = _Api(b""), closing  # type: ignore[assignment]
    w._watch = _ClosingWatch(closing, calls)
    w._backoff = Backoff(0.001, 0.001)
    w._watch_until("1", time.monotonic() + 600)
    assert len(w._watch.calls) == calls
    assert value_of(metrics.watch_restarts, source="vllm") == calls - 1


def test_a_watch_is_not_opened_past_the_refresh_deadline() -> None:
    """Less than a second before the relist is due, no watch is opened. Kills the time left
    computed as ``deadline + now``."""
    w, _, _ = _watcher()
    closing = _RecordingEvent()  # never blocks: a lost back-off fails, it does not hang
    w._api, w._closing = _Api(b""), closing  # type: ignore[assignment]
    w._watch = _ClosingWatch(closing, 1)
    w._watch_until("1", time.monotonic() - 5)
    assert w._watch.calls == []


def test_a_config_that_cannot_be_loaded_is_named_in_the_error(tmp_path: Path) -> None:
    """Kills the refusal without its text, or naming the wrong source (the kubeconfig file
    for the in-cluster config or the other way round)."""
    missing = tmp_path / "missing.yaml"
    with pytest.raises(ConfigError, match=f"^discovery: cannot load kubeconfig {missing}: "):
        kube.connect(_settings(kubeconfig=str(missing)), {})
    with pytest.raises(
        ConfigError,
        match=r"^discovery: cannot load in-cluster config \(no discovery.kubeconfig\): ",
    ):
        kube.connect(_settings(), {}, sa_dir=tmp_path / "no-service-account")


class _RecordingEvent(threading.Event):
    """The closing Event, recording how long each back-off asked to wait."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: list[object] = []

    def wait(self, timeout: float | None = None) -> bool:
        self.asked.append(timeout)
        return super().wait(0 if self.is_set() else 0.001)


def test_a_watch_that_ends_at_once_is_reopened_only_after_a_back_off() -> None:
    """A watch stream that ends at once (an API server that closes it) must not be reopened
    in a tight loop. Kills the elapsed time computed as ``now + started`` (never short) and
    the back-off's delay dropped (``wait(None)``)."""
    w, _, _ = _watcher()
    closing = _RecordingEvent()
    w._api, w._closing = _Api(b""), closing  # type: ignore[assignment]
    w._watch = _ClosingWatch(closing, 3)
    w._backoff = Backoff(0.001, 0.001)
    w._watch_until("1", time.monotonic() + 600)
    assert len(closing.asked) == 3
    assert all(isinstance(t, float) and 0 < t <= 0.001 for t in closing.asked), closing.asked


def test_the_two_watchers_watch_their_own_selectors_and_masters_wait_for_their_list() -> None:
    """One watcher per selector, named for the metrics' ``source`` label; until a watcher's
    first list succeeds its side of the desired state is unknown (None), so the reconciler
    removes nothing. Kills the masters watcher's name or selector replaced, and the masters
    taken as listed before their first list (``synced or True``: every registered master
    would be dropped at start)."""
    settings = _settings()
    source = kube.KubeSource(
        client.ApiClient(), "ns", settings, DiscoveryMetrics.register(Registry())
    )
    assert (source.vllm.name, source.vllm.selector) == (
        "vllm",
        podrules.vllm_selector(settings.labels),
    )
    assert (source.masters.name, source.masters.selector) == (
        "masters",
        podrules.master_selector(settings.labels),
    )
    assert source.desired() == Desired(instances=None, masters=None)
    source.masters.synced = True
    assert source.desired() == Desired(instances=None, masters={})
