"""A fake Kubernetes API server speaking just enough of the pods API for the official client.

``GET /api/v1/namespaces/{ns}/pods`` with ``labelSelector`` (``=``, ``==``, ``!=``, ``in``,
``notin``, ``key``, ``!key``), ``resourceVersion``, ``watch=true`` and ``timeoutSeconds``:

- a list is a ``PodList`` with ``metadata.resourceVersion`` (one counter for all changes);
- a watch streams newline-delimited ``{"type", "object"}`` events, chunked, flushed as they
  happen; like the real server, a pod that stops matching the selector arrives as DELETED
  and one that starts matching as ADDED; without ``resourceVersion`` it opens with ADDED
  for every matching pod;
- a resourceVersion older than the last :meth:`compact` is answered with a 410 ERROR event
  (or an HTTP 410 with ``gone_as_http``); :meth:`expire_watches` sends a 410 ERROR event to
  open watches; :meth:`break_watches` drops open streams mid-chunk; :meth:`fail` makes the
  next requests answer 403/500/...; :meth:`stop`/:meth:`start` take the server down and up
  again on the same port, keeping its pods (as etcd would).

Plain HTTP by default; ``tls=(certfile, keyfile)`` serves HTTPS and ``token`` requires
``Authorization: Bearer <token>`` (for in-cluster style clients).
"""

from __future__ import annotations

import copy
import json
import re
import ssl
import threading
import time
import uuid
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from tests.conftest import reserve_port

_PODS_PATH = re.compile(r"^/api/v1/namespaces/([^/]+)/pods$")
_SET_TERM = re.compile(r"^\s*([^\s!=(),]+)\s+(in|notin)\s+\(([^)]*)\)\s*$")
_CMP_TERM = re.compile(r"^\s*([^\s!=(),]+)\s*(==|=|!=)\s*([^\s!=(),]*)\s*$")
_EXISTS_TERM = re.compile(r"^\s*(!?)([^\s!=(),]+)\s*$")

Selector = Callable[[dict[str, str]], bool]


def parse_selector(text: str) -> Selector:
    """A predicate over a label dict; ValueError for a selector the API would reject."""
    terms: list[Selector] = []
    for raw in re.split(r",(?![^()]*\))", text or ""):
        if not raw.strip():
            continue
        terms.append(_parse_term(raw))
    return lambda labels: all(t(labels) for t in terms)


def _parse_term(raw: str) -> Selector:
    if m := _SET_TERM.match(raw):
        key, op, values = m.group(1), m.group(2), {v.strip() for v in m.group(3).split(",")}
        if op == "in":
            return lambda lb: lb.get(key) in values
        return lambda lb: lb.get(key) not in values
    if m := _CMP_TERM.match(raw):
        key, op, value = m.groups()
        if op == "!=":
            return lambda lb: lb.get(key) != value
        return lambda lb: lb.get(key) == value
    if m := _EXISTS_TERM.match(raw):
        neg, key = m.group(1) == "!", m.group(2)
        return lambda lb: (key in lb) != neg
    raise ValueError(f"unable to parse requirement: {raw!r}")


def make_pod(
    name: str,
    ip: str | None = "10.0.0.1",
    labels: dict[str, str] | None = None,
    *,
    ready: bool = True,
    phase: str = "Running",
    ports: dict[str, int] | None = None,
    restarts: int = 0,
    started_at: str = "2024-01-01T00:00:00Z",
    container: str = "vllm",
    namespace: str = "default",
) -> dict[str, Any]:
    """A pod as the API serves it (uid and resourceVersion are set by the server)."""
    port_list = [
        {"name": n, "containerPort": p, "protocol": "TCP"} for n, p in (ports or {}).items()
    ]
    status: dict[str, Any] = {
        "phase": phase,
        "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        "containerStatuses": [
            {
                "name": container,
                "ready": ready,
                "restartCount": restarts,
                "image": "vllm",
                "imageID": "",
                "state": {"running": {"startedAt": started_at}},
            }
        ],
    }
    if ip:
        status["podIP"] = ip
    return {
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": dict(labels or {}),
            "creationTimestamp": "2024-01-01T00:00:00Z",
        },
        "spec": {"containers": [{"name": container, "image": "vllm", "ports": port_list}]},
        "status": status,
    }


class FakeKube:
    """The fake API server. Change pods with add/modify/delete; inject failures with the rest."""

    def __init__(
        self,
        port: int | None = None,
        *,
        token: str | None = None,
        tls: tuple[str, str] | None = None,
    ) -> None:
        self.port = port or reserve_port()
        self.token, self.tls = token, tls
        self.gone_as_http = False
        self.requests: list[str] = []
        self._cond = threading.Condition()
        self._pods: dict[tuple[str, str], dict[str, Any]] = {}
        self._history: list[tuple[int, str, dict[str, Any] | None, dict[str, Any] | None]] = []
        self._rv = 100
        self._min_rv = 0
        self._break_gen = 0
        self._expire_gen = 0
        self._failures: list[tuple[int, str]] = []  # (status, "list"|"watch"|"any")
        self._server: ThreadingHTTPServer | None = None

    # -- lifecycle -------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"

    def start(self) -> FakeKube:
        handler = type("Handler", (_Handler,), {"kube": self})
        server = ThreadingHTTPServer(("127.0.0.1", self.port), handler)
        server.daemon_threads = True
        if self.tls:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(*self.tls)
            server.socket = ctx.wrap_socket(server.socket, server_side=True)
        self._server = server
        threading.Thread(
            target=server.serve_forever, args=(0.05,), name="fake-kube", daemon=True
        ).start()
        return self

    def stop(self) -> None:
        """Go away: close the port and drop every open watch (state is kept)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        self.break_watches()

    def write_kubeconfig(self, path: Path, namespace: str = "default") -> Path:
        cluster: dict[str, Any] = {"server": self.url}
        if self.tls:
            cluster["certificate-authority"] = self.tls[0]
        user = {"token": self.token} if self.token else {}
        path.write_text(
            json.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "current-context": "fake",
                    "clusters": [{"name": "fake", "cluster": cluster}],
                    "users": [{"name": "fake", "user": user}],
                    "contexts": [
                        {
                            "name": "fake",
                            "context": {"cluster": "fake", "user": "fake", "namespace": namespace},
                        }
                    ],
                }
            )
        )
        return path

    # -- pods --------------------------------------------------------------------------

    def add_pod(self, pod: dict[str, Any]) -> dict[str, Any]:
        pod = copy.deepcopy(pod)
        meta = pod["metadata"]
        meta.setdefault("uid", str(uuid.uuid4()))
        meta.setdefault("namespace", "default")
        with self._cond:
            key = (meta["namespace"], meta["name"])
            assert key not in self._pods, f"pod {key} exists"
            self._record("ADDED", None, pod)
            self._pods[key] = pod
        return copy.deepcopy(pod)

    def modify_pod(
        self, name: str, change: Callable[[dict[str, Any]], None], namespace: str = "default"
    ) -> dict[str, Any]:
        with self._cond:
            old = self._pods[(namespace, name)]
            new = copy.deepcopy(old)
            change(new)
            self._record("MODIFIED", old, new)
            self._pods[(namespace, name)] = new
            return copy.deepcopy(new)

    def delete_pod(self, name: str, namespace: str = "default") -> None:
        with self._cond:
            old = self._pods.pop((namespace, name))
            self._record("DELETED", old, None)

    def _record(self, kind: str, old: dict[str, Any] | None, new: dict[str, Any] | None) -> None:
        self._rv += 1
        for obj in (old, new):
            if obj is not None:
                obj["metadata"]["resourceVersion"] = str(self._rv)
        self._history.append((self._rv, kind, copy.deepcopy(old), copy.deepcopy(new)))
        self._cond.notify_all()

    # -- failure injection -------------------------------------------------------------

    def fail(self, status: int, times: int = 1, what: str = "any") -> None:
        """The next ``times`` requests (lists, watches or any) answer HTTP ``status``."""
        with self._cond:
            self._failures += [(status, what)] * times

    def clear_failures(self) -> None:
        with self._cond:
            self._failures.clear()

    def break_watches(self) -> None:
        """Drop every open watch stream mid-way (no terminating chunk)."""
        with self._cond:
            self._break_gen += 1
            self._cond.notify_all()

    def expire_watches(self) -> None:
        """Send a 410 Gone ERROR event to every open watch, then end it."""
        with self._cond:
            self._expire_gen += 1
            self._cond.notify_all()

    def compact(self) -> None:
        """Forget history: a watch from any older resourceVersion gets 410 Gone."""
        with self._cond:
            self._rv += 1
            self._min_rv = self._rv
            self._history.clear()

    def _nothing_after(self, rv: int) -> bool:
        """True while no recorded change is newer than ``rv`` (caller holds the lock)."""
        return not self._history or self._history[-1][0] <= rv

    def watch_count(self) -> int:
        return sum(1 for r in self.requests if "watch=true" in r)

    def list_count(self) -> int:
        return sum(1 for r in self.requests if "watch=true" not in r)

    def _take_failure(self, is_watch: bool) -> int | None:
        with self._cond:
            for i, (status, what) in enumerate(self._failures):
                if what == "any" or (what == "watch") == is_watch:
                    del self._failures[i]
                    return status
        return None


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


class _Handler(BaseHTTPRequestHandler):
    kube: FakeKube
    protocol_version = "HTTP/1.1"

    def log_message(self, *_args: Any) -> None:
        pass

    def do_GET(self) -> None:
        k = self.kube
        k.requests.append(self.path)
        url = urlsplit(self.path)
        q = {key: v[0] for key, v in parse_qs(url.query).items()}
        m = _PODS_PATH.match(url.path)
        scheme, _, token = self.headers.get("Authorization", "").partition(" ")
        if k.token and (scheme.lower() != "bearer" or token != k.token):  # scheme: any case
            return self._json(401, _status(401, "Unauthorized", "bad token"))
        if not m:
            return self._json(404, _status(404, "NotFound", f"no route {url.path}"))
        is_watch = q.get("watch") in ("true", "1")
        failure = k._take_failure(is_watch)
        if failure is not None:
            return self._json(failure, _status(failure, "Injected", f"injected {failure}"))
        try:
            selector = parse_selector(q.get("labelSelector", ""))
        except ValueError as exc:
            return self._json(400, _status(400, "BadRequest", str(exc)))
        if is_watch:
            return self._watch(m.group(1), selector, q)
        with k._cond:
            items = [
                copy.deepcopy(p)
                for (ns, _), p in sorted(k._pods.items())
                if ns == m.group(1) and selector(p["metadata"].get("labels") or {})
            ]
            rv = k._rv
        self._json(
            200,
            {
                "kind": "PodList",
                "apiVersion": "v1",
                "metadata": {"resourceVersion": str(rv)},
                "items": items,
            },
        )

    def _json(self, code: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)
        self.close_connection = True

    def _chunk(self, event: dict[str, Any]) -> None:
        data = json.dumps(event).encode() + b"\n"
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def _watch(self, ns: str, selector: Selector, q: dict[str, str]) -> None:
        k = self.kube
        since = int(q["resourceVersion"]) if q.get("resourceVersion") else None
        deadline = time.monotonic() + float(q.get("timeoutSeconds", "1800"))
        with k._cond:
            too_old = since is not None and since < k._min_rv
            if too_old and k.gone_as_http:
                return self._json(410, _status(410, "Expired", "too old resource version"))
            breaks, expires = k._break_gen, k._expire_gen
            start = [
                (p, "ADDED")
                for (pns, _), p in sorted(k._pods.items())
                if since is None and pns == ns and selector(p["metadata"]["labels"])
            ]
            cursor = k._rv if since is None else since
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self.close_connection = True
        try:
            if too_old:
                self._chunk(
                    {
                        "type": "ERROR",
                        "object": _status(
                            410, "Expired", f"too old resource version: {since} ({k._min_rv})"
                        ),
                    }
                )
                return self._end()
            for pod, kind in start:
                self._chunk({"type": kind, "object": pod})
            self._stream(ns, selector, cursor, deadline, breaks, expires)
        except (BrokenPipeError, ConnectionResetError, ssl.SSLError, OSError):
            pass

    def _stream(
        self, ns: str, selector: Selector, cursor: int, deadline: float, breaks: int, expires: int
    ) -> None:
        k = self.kube
        while True:
            with k._cond:
                while (
                    k._nothing_after(cursor)
                    and k._break_gen == breaks
                    and k._expire_gen == expires
                    and time.monotonic() < deadline
                ):
                    k._cond.wait(max(0.0, deadline - time.monotonic()))
                pending = [h for h in k._history if h[0] > cursor]
                cursor = max([cursor] + [h[0] for h in pending])
                broken, expired = k._break_gen != breaks, k._expire_gen != expires
            if broken:  # drop the connection without the terminating chunk
                self.wfile.write(b'5\r\n{"ty')
                self.wfile.flush()
                return
            for _, kind, old, new in pending:
                event = _event(ns, selector, kind, old, new)
                if event is not None:
                    self._chunk(event)
            if expired:
                self._chunk(
                    {
                        "type": "ERROR",
                        "object": _status(
                            410, "Expired", "The resourceVersion for the provided watch is too old."
                        ),
                    }
                )
                return self._end()
            if time.monotonic() >= deadline:
                return self._end()

    def _end(self) -> None:
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()


def _event(
    ns: str, selector: Selector, kind: str, old: dict[str, Any] | None, new: dict[str, Any] | None
) -> dict[str, Any] | None:
    """The event a selector-filtered watch sees for one change (None: not visible)."""
    obj = new if new is not None else old
    assert obj is not None
    if obj["metadata"].get("namespace", "default") != ns:
        return None
    was = old is not None and selector(old["metadata"].get("labels") or {})
    now = new is not None and selector(new["metadata"].get("labels") or {})
    if was and now:
        return {"type": "MODIFIED", "object": new}
    if now:
        return {"type": "ADDED", "object": new}
    if was:
        return {"type": "DELETED", "object": new if new is not None else old}
    return None
