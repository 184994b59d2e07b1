"""Static discovery (``discovery.mode: static``): instances and masters listed in the config file.

For docker-compose and bare metal. The file is read about once a second; when the SHA-256
of its bytes changed and is the same at the next poll (so a half-written file is never
applied), it is re-validated whole (:func:`common.config.load_config`). The
content hash decides, not the mtime: a same-size rewrite within the filesystem's timestamp
granularity keeps the mtime, and a ConfigMap's symlink swap may not change it; the file is
small, so reading it each second costs nothing. A file that no longer validates, is
missing, or is no longer in static mode (an empty file is valid but means "kubernetes") is
logged and ignored — the last good lists stay. Add/remove semantics are those of
Kubernetes mode: an entry that disappears is removed from the registry with its data.

An entry's uid is ``static:<ip>|<zmqEndpoint>|<replayEndpoint>``, so changing an entry's
endpoints registers a new instance (old data dropped) while changing its name, role, DP
size or ``httpEndpoint`` (the OpenAI-compatible server the audit probes use) only updates
it. ``ip`` may be left out; it is then the host of ``zmqEndpoint``.

An entry whose ZMQ or replay endpoint an ingester cannot connect to (a wildcard host such as
vLLM's own ``tcp://*:5557``, a tcp endpoint without a port: see
:func:`services.discovery.endpoints.endpoint_problem`) is logged and left out; the other
entries are applied. Entries that do not parse at all make the whole file invalid.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from urllib.parse import urlsplit

from common.config import Static, load_config
from common.errors import ConfigError
from common.settings import DiscoverySettings
from common.store import Instance
from services.discovery.endpoints import endpoint_problem
from services.discovery.metrics import DiscoveryMetrics
from services.discovery.pods import master_json
from services.discovery.reconcile import Desired

logger = logging.getLogger(__name__)


def static_uid(ip: str, zmq_endpoint: str, replay_endpoint: str) -> str:
    return f"static:{ip}|{zmq_endpoint}|{replay_endpoint}"


def desired_from(static: Static) -> Desired:
    """The registry the static lists describe; ConfigError naming every bad entry."""
    problems: list[str] = []
    instances: dict[str, Instance] = {}
    for i, e in enumerate(static.vllm):
        where = f"discovery.static.vllm[{i}]"
        ip = e.ip or (_host(e.zmq_endpoint) or "")
        if "://" not in e.zmq_endpoint:
            problems.append(f"{where}.zmqEndpoint: {e.zmq_endpoint!r} is not like tcp://host:port")
        if e.replay_endpoint and "://" not in e.replay_endpoint:
            problems.append(f"{where}.replayEndpoint: {e.replay_endpoint!r} is not an endpoint")
        if e.http_endpoint and not _is_http_url(e.http_endpoint):
            problems.append(
                f"{where}.httpEndpoint: {e.http_endpoint!r} is not like http://host:port"
            )
        if not ip:
            problems.append(f"{where}.ip: missing")
        elif ip in instances:
            problems.append(f"{where}.ip: {ip} is listed twice")
        if e.data_parallel_size < 1:
            problems.append(f"{where}.dataParallelSize: must be >= 1")
        if _unconnectable(where, e.zmq_endpoint, e.replay_endpoint):
            continue
        instances[ip] = Instance(
            ip=ip,
            uid=static_uid(ip, e.zmq_endpoint, e.replay_endpoint),
            pod=e.name,
            zmq_endpoint=e.zmq_endpoint,
            replay_endpoint=e.replay_endpoint,
            dp_size=e.data_parallel_size,
            role=e.role,
            restarts="0",
            model=e.model,
            http_endpoint=e.http_endpoint.rstrip("/"),
        )
    masters: dict[str, str] = {}
    for i, m in enumerate(static.mooncake_masters):
        host = _host(m.url)
        if urlsplit(m.url).scheme not in ("http", "https") or not host:
            problems.append(
                f"discovery.static.mooncakeMasters[{i}].url: {m.url!r} is not http(s)://host:port"
            )
        masters[m.url] = master_json(m.name, host or "", 0)
    if problems:
        raise ConfigError("invalid static discovery: " + "; ".join(problems))
    return Desired(instances=instances, masters=masters)


def _unconnectable(where: str, zmq_endpoint: str, replay_endpoint: str) -> bool:
    """Log and return True when an ingester could not connect to one of the endpoints."""
    skip = False
    for field, endpoint in (("zmqEndpoint", zmq_endpoint), ("replayEndpoint", replay_endpoint)):
        problem = endpoint_problem(endpoint) if endpoint and "://" in endpoint else None
        if problem:
            logger.error(
                "static discovery: %s.%s %r %s; entry skipped", where, field, endpoint, problem
            )
            skip = True
    return skip


def _is_http_url(url: str) -> bool:
    try:
        parts = urlsplit(url)
        return parts.scheme in ("http", "https") and bool(parts.hostname) and bool(parts.port)
    except ValueError:
        return False


def _host(url: str) -> str | None:
    try:
        return urlsplit(url).hostname
    except ValueError:
        return None


class StaticSource:
    """The static lists, reloaded from ``path`` (None: never reloaded) by a poller thread."""

    def __init__(
        self,
        path: str | None,
        d: DiscoverySettings,
        metrics: DiscoveryMetrics,
        poll_interval: float = 1.0,
    ) -> None:
        self.changed = threading.Event()
        self._path, self._metrics, self._poll = path, metrics, poll_interval
        self._desired = desired_from(d.static)  # bad entries: exit 2 at startup
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._thread: threading.Thread | None = None
        self._digest = ""  # applied content; the first polls read the file (it may have changed)
        self._pending = ""  # content seen once: applied when the next poll sees it unchanged

    def start(self) -> None:
        self.changed.set()
        if self._path:
            self._thread = threading.Thread(target=self._loop, name="static-reload", daemon=True)
            self._thread.start()

    def desired(self) -> Desired:
        with self._lock:
            return self._desired

    def close(self) -> None:
        self._closing.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _loop(self) -> None:
        while not self._closing.wait(self._poll):
            try:
                self.poll_once()
            except Exception:  # top of the loop: keep the last good lists
                logger.exception("static reload failed")
                self._metrics.errors.inc(kind="internal")

    def poll_once(self) -> bool:
        """Reload if the file changed; True when the desired set was replaced."""
        data, digest = self._read_digest()
        if digest == self._digest:
            self._pending = ""
            return False
        if digest != self._pending:  # changed since the last poll: let a writer finish
            self._pending = digest
            return False
        self._digest, self._pending = digest, ""
        try:
            d = DiscoverySettings.from_config(load_config(self._path))
            if d.mode != "static":
                raise ConfigError(
                    f"discovery.mode is {d.mode!r}, not 'static' "
                    "(changing the mode needs a restart)"
                )
            desired = desired_from(d.static)
        except ConfigError as exc:
            logger.error(
                "static discovery: %s changed but is invalid, keeping the last good lists: %s",
                self._path,
                exc,
            )
            self._metrics.reloads.inc(result="invalid")
            self._metrics.errors.inc(kind="config")
            return False
        if desired == self.desired():
            return False
        with self._lock:
            self._desired = desired
        self._metrics.reloads.inc(result="ok")
        logger.info(
            "static discovery reloaded from %s (%d bytes): %d instances, %d masters",
            self._path,
            len(data),
            len(desired.instances or {}),
            len(desired.masters or {}),
        )
        self.changed.set()
        return True

    def _read_digest(self) -> tuple[bytes, str]:
        try:
            with open(self._path or "", "rb") as f:
                data = f.read()
        except OSError:
            return b"", ""
        return data, hashlib.sha256(data).hexdigest()
