"""The audit's first half: what ``POST /kv-cache/hit-rate`` answered, kept under the caller's
``request_id`` so that an outcome report (:mod:`services.api.audit_outcome`) can compare it
with what vLLM then reused.

A hit-rate request names its id in the body's top-level ``request_id`` or in the
``X-Request-Id`` header (the body wins): 1 to 128 printable ASCII characters, anything else
is a 400. Without an id nothing is recorded and the answer is unchanged byte for byte.

Recording never slows the answer nor fails it: the request thread only appends the hits it
computed anyway to a bounded in-memory buffer (:class:`Recorder`); a writer thread per API
worker wakes every 20 ms, builds the JSON and sends the buffer to Redis in pipelined
batches (a worker that stops loses at most its last 20 ms of records). What happens to every offered
record is counted (``cache_indexer_api_audit_records_total{result}``): ``recorded``,
``rate_limited`` (more than ``audit.maxRecordsPerSecond`` in this worker), ``queue_full``
(Redis slower than the requests, ``audit.queueSize``) or ``redis_error`` (logged). So the
audit's Redis memory is bounded by workers × maxRecordsPerSecond × ``audit.ttl`` records.

The record (the string ``ci:audit:{<rid>}``, :mod:`common.keys`), per distinct candidate:
``l1``/``l3`` the predicted hit tokens of each tier (the ``?detail=1`` ``*_hit_tokens``) and
``r1``/``r3`` why each is only a lower bound (empty: exact); for the whole question ``t``
(ms since the epoch), ``n`` prompt tokens, ``bs`` block size, ``salt`` (a salt was given),
``fp`` (block 0's member key: the race check's prefix), ``k`` (member keys at the block
index where a candidate's prediction stops: the outcome's "does the index now hold the
block we said was missing" check) and ``kh`` (the same per hybrid candidate, at its hash
unit: group 0's next block, :func:`hybrid_stops`). The writer also adds the id to
``ci:audit:prefix:{fp}``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import orjson
import redis

from common import keys
from common.config import Audit
from common.errors import RequestError
from services.api.api_metrics import ApiMetrics
from services.api.scoring import Chain, ViewCache

logger = logging.getLogger(__name__)

HEADER = "X-Request-Id"
MAX_ID_LENGTH = 128
PREFIX_MEMBERS = 64
"""Questions kept per prompt prefix for the race check (the latest ones)."""
_BATCH = 256
FLUSH_INTERVAL = 0.02
"""Seconds between the writer's rounds: how late a record may reach Redis at most (plus
its round trip) when the worker is idle."""


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


_Hits = Mapping[str, tuple["HitLike", "HitLike"]]
_Pending = tuple[str, int, int, int, bool, _Hits, bytes, dict[int, bytes], dict[str, bytes]]
"""What the request thread hands over: id, time (ms), prompt tokens, block size, salted, the
hits, block 0's member key, the member keys where predictions stop (by block index) and,
per hybrid candidate, group 0's member key of the block after its prediction."""


def hybrid_stops(hits: _Hits, views: ViewCache, chain: Chain) -> dict[str, bytes]:
    """Per hybrid candidate, the member key (at its hash unit) of group 0's block right after
    its predicted hit: what the outcome's "does the index now hold it" check reads in
    ``ci:{ip}:l1`` / ``ci:{ip}:l3`` (group 0's sets). Single-group candidates: none (their
    block at the request's block size is in the record's ``k``)."""
    out: dict[str, bytes] = {}
    for ip, (l1, l3) in hits.items():
        view = views.get(ip)
        if view.rule is None or 0 not in view.l1_groups:
            continue
        unit = view.rule.hash_unit
        b0 = view.rule.groups[view.l1_groups.index(0)].block_size
        idx = (max(l1.tokens, l3.tokens) + b0) // unit - 1
        members = chain(unit)
        if idx < len(members):
            out[ip] = members[idx]
    return out


def build_record(pending: _Pending) -> bytes:
    """The record's JSON (built in the writer thread, not in the request's)."""
    _, now_ms, num_tokens, block_size, salted, hits, fp, stops, hybrid = pending
    cands = {
        ip: {"l1": l1.tokens, "l3": l3.tokens, "r1": list(l1.reasons), "r3": list(l3.reasons)}
        for ip, (l1, l3) in hits.items()
    }
    doc = {
        "t": now_ms,
        "n": num_tokens,
        "bs": block_size,
        "salt": salted,
        "fp": fp.decode(),
        "c": cands,
        "k": {str(i): key.decode() for i, key in stops.items()},
    }
    if hybrid:
        doc["kh"] = {ip: key.decode() for ip, key in hybrid.items()}
    return orjson.dumps(doc)


class Recorder:
    """A bounded buffer of answers to record and the thread that writes them (one per API
    worker). The thread wakes every ``FLUSH_INTERVAL`` rather than on every answer: a
    request costs a deque append, not a thread switch, and a busy worker's records go to
    Redis in few round trips."""

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
        self._pending: deque[_Pending] = deque()
        self._inflight = 0
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
        hybrid: dict[str, bytes] | None = None,
    ) -> None:
        """Hand one answer to the writer (never blocks, never raises for Redis)."""
        now = self.clock()
        if not self._admit(int(now)):
            self.metrics.audit_records.inc(result="rate_limited")
            return
        if len(self._pending) >= self.settings.queue_size:
            self.metrics.audit_records.inc(result="queue_full")
            return
        n = min(num_tokens // block_size, len(members))
        stops: dict[int, bytes] = {}
        if n:
            for l1, l3 in hits.values():
                stop = max(l1.tokens, l3.tokens) // block_size
                if stop < n and stop not in stops:
                    stops[stop] = members[stop]
        fp = members[0] if n else b""
        self._ensure_thread()
        now_ms = int(now * 1000)
        item = (request_id, now_ms, num_tokens, block_size, salted, hits, fp, stops, hybrid or {})
        self._pending.append(item)

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
        while not self._stop.wait(FLUSH_INTERVAL):
            while self._pending:
                batch: list[_Pending] = []
                while self._pending and len(batch) < _BATCH:
                    batch.append(self._pending.popleft())
                self._inflight = len(batch)
                try:
                    self._write(batch)
                except Exception:  # the writer must survive anything; answers never wait on it
                    self._log_failure("audit: writing %d records failed", len(batch), True)
                finally:
                    self._inflight = 0

    def _commands(self, batch: list[_Pending]) -> list[tuple[Any, ...]]:
        """A SET per record, three commands per distinct prefix (under load a batch holds
        many questions about one hot prefix)."""
        cmds: list[tuple[Any, ...]] = []
        prefixes: dict[str, dict[str, int]] = {}
        for pending in batch:
            rid, now_ms, fp = pending[0], pending[1], pending[6].decode()
            cmds.append(("SET", keys.audit_question(rid), build_record(pending), "EX", self.ttl))
            if fp:
                prefixes.setdefault(fp, {})[rid] = now_ms
        for fp, asked in prefixes.items():
            pk = keys.audit_prefix(fp)
            zadd: list[Any] = ["ZADD", pk]
            for rid, score in asked.items():
                zadd += [score, rid]
            cmds.append(tuple(zadd))
            cmds.append(("ZREMRANGEBYRANK", pk, 0, -(PREFIX_MEMBERS + 1)))
            cmds.append(("EXPIRE", pk, self.prefix_ttl))
        return cmds

    def _send(self, cmds: list[tuple[Any, ...]]) -> None:
        """One round trip. On a single server as packed RESP on a pooled connection (redis-py's
        pipeline costs tens of microseconds of Python per command, taken from the request
        threads of this worker); a cluster through its pipeline, routed by slot."""
        if not isinstance(self.client, redis.Redis):
            pipe = self.client.pipeline(transaction=False)
            for cmd in cmds:
                pipe.execute_command(*cmd)
            pipe.execute()
            return
        pool = self.client.connection_pool
        conn: Any = pool.get_connection()
        try:
            conn.send_packed_command([b"".join(_pack(cmd) for cmd in cmds)])
            for _ in cmds:
                reply = conn.read_response(disable_decoding=True)
                if isinstance(reply, redis.ResponseError):
                    raise reply
        except BaseException:
            conn.disconnect()  # unread replies must not reach the next user of the socket
            raise
        finally:
            pool.release(conn)

    def _write(self, batch: list[_Pending]) -> None:
        try:
            self._send(self._commands(batch))
        except redis.RedisError as exc:
            self.metrics.audit_records.inc(len(batch), result="redis_error")
            self.metrics.redis_errors.inc(op="audit_record")
            self._log_failure("audit: %d records lost, Redis failed: %s", len(batch), exc)
            return
        self.metrics.audit_records.inc(len(batch), result="recorded")

    def _log_failure(self, message: str, count: int, detail: object) -> None:
        now = time.monotonic()
        if now - self._last_error_log > 10:  # one line per 10 s, not one per batch
            self._last_error_log = now
            logger.warning(message, count, detail, exc_info=detail is True)

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every handed record has been written or failed (tests, shutdown)."""
        deadline = time.monotonic() + timeout
        while self._pending or self._inflight:
            if time.monotonic() > deadline:
                return False
            self._stop.wait(0.005)
        return True

    def stop(self) -> None:
        self._stop.set()


def _pack(cmd: tuple[Any, ...]) -> bytes:
    """One command as RESP."""
    parts = [b"*%d\r\n" % len(cmd)]
    for arg in cmd:
        raw = arg if isinstance(arg, bytes) else str(arg).encode()
        parts.append(b"$%d\r\n%b\r\n" % (len(raw), raw))
    return b"".join(parts)
