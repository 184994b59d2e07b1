"""The audit's first half: what ``POST /kv-cache/hit-rate`` answered, kept under the caller's
``request_id`` so that an outcome report (:mod:`services.api.audit_outcome`) can compare it
with what vLLM then reused.

A hit-rate request names its id in the body's top-level ``request_id`` or in the
``X-Request-Id`` header (the body wins): 1 to 128 printable ASCII characters, anything else
is a 400. Without an id nothing is recorded and the answer is unchanged byte for byte.

Recording never slows the answer nor fails it: the request thread only builds a small JSON
document and puts it on a bounded in-memory queue (:class:`Recorder`); a writer thread per
API worker sends the queue to Redis in pipelined batches. What happens to every offered
record is counted (``cache_indexer_api_audit_records_total{result}``): ``recorded``,
``rate_limited`` (more than ``audit.maxRecordsPerSecond`` in this worker), ``queue_full``
(Redis slower than the requests, ``audit.queueSize``) or ``redis_error`` (logged). So the
audit's Redis memory is bounded by workers × maxRecordsPerSecond × ``audit.ttl`` records.

The record (``ci:audit:{<rid>}`` field ``q``, :mod:`common.keys`), per distinct candidate:
``l1``/``l3`` the predicted hit tokens of each tier (the ``?detail=1`` ``*_hit_tokens``) and
``r1``/``r3`` why each is only a lower bound (empty: exact); for the whole question ``t``
(ms since the epoch), ``n`` prompt tokens, ``bs`` block size, ``salt`` (a salt was given),
``fp`` (block 0's member key: the race check's prefix), ``k`` (member keys at the block
index where a candidate's prediction stops: the outcome's "does the index now hold the
block we said was missing" check). The writer also adds the id to ``ci:audit:prefix:{fp}``.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import orjson
import redis

from common import keys
from common.config import Audit
from common.errors import RequestError
from services.api.api_metrics import ApiMetrics

logger = logging.getLogger(__name__)

HEADER = "X-Request-Id"
MAX_ID_LENGTH = 128
PREFIX_MEMBERS = 64
"""Questions kept per prompt prefix for the race check (the latest ones)."""
_BATCH = 256


def parse_request_id(value: Any, where: str = "request_id") -> str | None:
    """A request id as given (None when absent); :class:`RequestError` 400 if malformed."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise RequestError(400, f"{where} must be a string of 1 to {MAX_ID_LENGTH} characters")
    if not 0 < len(value) <= MAX_ID_LENGTH or not all(" " <= c <= "~" for c in value):
        raise RequestError(
            400,
            f"{where} must be 1 to {MAX_ID_LENGTH} printable ASCII characters, "
            f"got {len(value)} characters{'' if value.isprintable() else ' with control ones'}",
        )
    return value


class HitLike(Protocol):
    tokens: int
    reasons: tuple[str, ...]


def build_record(
    *,
    now_ms: int,
    num_tokens: int,
    block_size: int,
    salted: bool,
    hits: Mapping[str, tuple[HitLike, HitLike]],
    members: Sequence[bytes],
) -> tuple[str, bytes]:
    """(prefix fingerprint, the record's JSON) for one answered question."""
    n = num_tokens // block_size
    stops: dict[str, str] = {}
    cands: dict[str, dict[str, Any]] = {}
    for ip, (l1, l3) in hits.items():
        cands[ip] = {
            "l1": l1.tokens,
            "l3": l3.tokens,
            "r1": list(l1.reasons),
            "r3": list(l3.reasons),
        }
        stop = max(l1.tokens, l3.tokens) // block_size
        if stop < n and stop < len(members):
            stops.setdefault(str(stop), members[stop].decode())
    fp = members[0].decode() if n and members else ""
    doc = {
        "t": now_ms,
        "n": num_tokens,
        "bs": block_size,
        "salt": salted,
        "fp": fp,
        "c": cands,
        "k": stops,
    }
    return fp, orjson.dumps(doc)


class Recorder:
    """A bounded queue of records and the thread that writes them (one per API worker)."""

    def __init__(
        self,
        client: redis.Redis | Any,
        settings: Audit,
        metrics: ApiMetrics,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.client, self.settings, self.metrics, self.clock = client, settings, metrics, clock
        self.ttl = max(1, int(settings.ttl))
        self.prefix_ttl = max(1, int(2 * settings.race_window + 0.999))
        self._queue: queue.Queue[tuple[str, str, bytes, int]] = queue.Queue(settings.queue_size)
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._second, self._in_second = 0, 0
        self._last_error_log = 0.0

    def offer(
        self,
        request_id: str,
        num_tokens: int,
        block_size: int,
        salted: bool,
        hits: Mapping[str, tuple[HitLike, HitLike]],
        members: Sequence[bytes],
    ) -> None:
        """Queue one record (never blocks, never raises for Redis)."""
        now = self.clock()
        if not self._admit(int(now)):
            self.metrics.audit_records.inc(result="rate_limited")
            return
        now_ms = int(now * 1000)
        fp, doc = build_record(
            now_ms=now_ms,
            num_tokens=num_tokens,
            block_size=block_size,
            salted=salted,
            hits=hits,
            members=members,
        )
        self._ensure_thread()
        try:
            self._queue.put_nowait((request_id, fp, doc, now_ms))
        except queue.Full:
            self.metrics.audit_records.inc(result="queue_full")

    def _admit(self, second: int) -> bool:
        with self._lock:
            if second != self._second:
                self._second, self._in_second = second, 0
            if self._in_second >= self.settings.max_records_per_second:
                return False
            self._in_second += 1
            return True

    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            with self._lock:
                if self._thread is None or not self._thread.is_alive():
                    self._thread = threading.Thread(
                        target=self._run, name="audit-writer", daemon=True
                    )
                    self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                first = self._queue.get(timeout=0.25)
            except queue.Empty:
                continue
            batch = [first]
            while len(batch) < _BATCH:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            try:
                self._write(batch)
            except Exception:  # the writer must survive anything; the answers never wait on it
                logger.exception("audit: writing %d records failed", len(batch))
            finally:
                for _ in batch:
                    self._queue.task_done()

    def _write(self, batch: list[tuple[str, str, bytes, int]]) -> None:
        pipe = self.client.pipeline(transaction=False)
        for rid, fp, doc, now_ms in batch:
            key = keys.audit_question(rid)
            pipe.hset(key, "q", doc)
            pipe.expire(key, self.ttl)
            if fp:
                pk = keys.audit_prefix(fp)
                pipe.zadd(pk, {rid: now_ms})
                pipe.zremrangebyrank(pk, 0, -(PREFIX_MEMBERS + 1))
                pipe.expire(pk, self.prefix_ttl)
        try:
            pipe.execute()
        except redis.RedisError as exc:
            self.metrics.audit_records.inc(len(batch), result="redis_error")
            self.metrics.redis_errors.inc(op="audit_record")
            now = time.monotonic()
            if now - self._last_error_log > 10:  # one line per 10 s, not one per batch
                self._last_error_log = now
                logger.warning("audit: %d records lost, Redis failed: %s", len(batch), exc)
            return
        self.metrics.audit_records.inc(len(batch), result="recorded")

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every queued record has been written or failed (tests, shutdown)."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks:
            if time.monotonic() > deadline:
                return False
            self._stop.wait(0.005)
        return True

    def stop(self) -> None:
        self._stop.set()
