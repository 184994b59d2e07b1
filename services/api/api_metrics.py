"""The API's Prometheus metrics, summed over all gunicorn workers of one server.

Each worker counts into its own :class:`~common.metrics.Registry`. Workers cannot see each
other's memory, so when the gunicorn master exports a shared directory (env
``CACHE_INDEXER_METRICS_DIR``, created in its ``on_starting`` hook) every worker writes its
snapshot there as ``worker-<pid>.json`` — at least once a second and on every scrape — and
``GET /metrics`` merges all files with :func:`~common.metrics.merge_snapshots`.

A dead worker's counts must not vanish (a Prometheus counter must not go down), so the
master folds its last file into ``retired.json`` in ``child_exit`` (:func:`retire_worker`).
While it folds, ``retired.json`` names the pid being retired and readers skip that pid's file,
so a scrape racing the fold never counts a worker twice. Files are replaced atomically
(write + rename).
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Any

import orjson

from common.metrics import Registry, merge_snapshots, render

logger = logging.getLogger(__name__)

METRICS_DIR_ENV = "CACHE_INDEXER_METRICS_DIR"
FLUSH_INTERVAL = 1.0
_RETIRED = "retired.json"
_LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class ApiMetrics:
    """The metrics one API worker records, and the text ``GET /metrics`` answers with."""

    def __init__(self, shared_dir: str | os.PathLike[str] | None = None) -> None:
        self.registry = Registry()
        r = self.registry
        self.requests = r.counter(
            "cache_indexer_api_requests_total", "HTTP requests answered, by route and status.",
            ("path", "status"))
        self.latency = r.histogram(
            "cache_indexer_api_request_duration_seconds", "Time to answer an HTTP request.",
            ("path",), _LATENCY_BUCKETS)
        self.redis_errors = r.counter(
            "cache_indexer_api_redis_errors_total", "Redis calls that failed, by operation.",
            ("op",))
        self.hashed_blocks = r.counter(
            "cache_indexer_api_hashed_blocks_total", "Prompt blocks hashed for hit-rate requests.")
        self.shared = SnapshotDir(shared_dir) if shared_dir else None
        self._stop = threading.Event()

    def render(self) -> str:
        """Prometheus text: this worker's own metrics, or the sum over all workers."""
        if self.shared is None:
            return self.registry.render()
        self.flush()
        return render(merge_snapshots(self.shared.read_all()))

    def flush(self) -> None:
        if self.shared is not None:
            self.shared.write(os.getpid(), self.registry.snapshot())

    def start_flusher(self, interval: float = FLUSH_INTERVAL) -> None:
        """Write this worker's snapshot every ``interval`` seconds from a daemon thread."""
        if self.shared is None:
            return
        self.flush()
        _ACTIVE.append(self)
        threading.Thread(target=self._flush_loop, args=(interval,), name="metrics-flush",
                         daemon=True).start()

    def stop(self) -> None:
        self._stop.set()
        self.flush()

    def _flush_loop(self, interval: float) -> None:
        while not self._stop.wait(interval):
            try:
                self.flush()
            except OSError as exc:  # a full or removed temp dir must not kill the worker
                logger.warning("cannot write the metrics snapshot: %s", exc)


_ACTIVE: list[ApiMetrics] = []


def flush_active() -> None:
    """Stop the flushers of this process after a last write (gunicorn ``worker_exit``)."""
    for metrics in _ACTIVE:
        metrics.stop()


class SnapshotDir:
    """A directory of per-worker metric snapshots (JSON) plus the retired workers' sum."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    def _file(self, pid: int) -> Path:
        return self.path / f"worker-{pid}.json"

    def write(self, pid: int, snapshot: dict[str, Any]) -> None:
        _write_atomic(self._file(pid), orjson.dumps(snapshot))

    def read_all(self) -> list[dict[str, Any]]:
        """The retired sum and every live worker's latest snapshot."""
        retired = _read(self.path / _RETIRED) or {"pids": [], "snapshot": {}}
        gone = {f"worker-{pid}.json" for pid in retired["pids"]}
        snaps = [retired["snapshot"]]
        for path in sorted(self.path.glob("worker-*.json")):
            if path.name not in gone:
                snap = _read(path)
                if snap is not None:
                    snaps.append(snap)
        return snaps

    def retire(self, pid: int) -> None:
        """Fold a dead worker's last snapshot into the retired sum, then drop its file."""
        path = self._file(pid)
        last = _read(path)
        if last is None:
            return
        retired = _read(self.path / _RETIRED) or {"pids": [], "snapshot": {}}
        total = merge_snapshots([retired["snapshot"], last])
        # Readers skip the listed pid's file until it is gone; the list is then emptied so
        # that a later worker reusing the pid is counted.
        _write_atomic(self.path / _RETIRED, orjson.dumps({"pids": [pid], "snapshot": total}))
        path.unlink(missing_ok=True)
        _write_atomic(self.path / _RETIRED, orjson.dumps({"pids": [], "snapshot": total}))


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _read(path: Path) -> Any:
    try:
        return orjson.loads(path.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, orjson.JSONDecodeError) as exc:
        logger.warning("ignoring unreadable metrics snapshot %s: %s", path.name, exc)
        return None
