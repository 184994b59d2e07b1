"""The L1 ingester's ZMQ side: one SUB socket per instance rank, all in one poll loop.

One thread owns every socket (ZMQ sockets are not thread-safe) and runs a ``zmq.Poller``
with a 250 ms timeout, so a stop request or a new instance set is noticed quickly. Per
instance rank there are a SUB socket and its socket monitor
(:class:`~services.l1_ingest.rank_conn.RankConn`, which says how they reconnect and what
they accept) and, while a replay is in flight, that replay's DEALER. Each batch goes to the
rank's :class:`~services.l1_ingest.stream.RankStream`.
Instances come from :meth:`Subscriber.set_instances` (called by the assignment loop in
another thread); a changed generation or endpoint resubscribes with fresh state. A Redis or
ZMQ failure or a refused (fenced) write closes the instance's sockets and retries with
backoff, without holding up the other instances. With no socket to poll (nothing assigned
yet, every instance waiting to retry) the loop waits on the stop event instead, because
``zmq.Poller.poll`` returns at once when it has nothing to watch.

Every ``VERIFY_INTERVAL`` seconds one pipelined read compares the stored cursor (seq and
digest) of every rank not replaying with the one its stream applied; a rank whose cursor moved
(a Redis failover lost writes, the state hash was emptied) re-syncs at once, so a quiet
instance heals within seconds, not at its next batch.

What survives a session of a rank (resubscribing after a failure, losing and regaining its
lease) is the digest of the last payload applied there, kept per (ip, rank, generation), so
the next session can tell a restarted vLLM from the one it followed (see ``stream``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Protocol

import redis
import zmq

from common.errors import FencedError
from common.health import Health
from common.lifecycle import Backoff
from common.settings import L1IngestSettings
from common.status_report import ConnState
from common.store import Instance, StoredCursor
from services.l1_ingest.apply import GroupSettings
from services.l1_ingest.metrics import IngestMetrics
from services.l1_ingest.status import ConnRound, StatusBoard, StatusWriter, worst
from services.l1_ingest.batch import BatchWriter
from services.l1_ingest.rank_conn import RankConn, SocketKind
from services.l1_ingest.stream import RankStream

logger = logging.getLogger(__name__)


class L1Store(BatchWriter, StatusWriter, Protocol):
    """The subscriber's role of :class:`common.store.Store`: its streams' and its board's,
    and the periodic check of the stored cursors."""

    def cursors(self, ranks: Sequence[tuple[str, int]]) -> list[StoredCursor]: ...


POLL_MS = 250
STATUS_INTERVAL = 1.0
"""Seconds between two writes of the instances' status (at most; see heartbeatInterval)."""
VERIFY_INTERVAL = 2.0
"""Seconds between two checks of the stored cursors against the streams' (lost writes)."""


def _same(a: Instance, b: Instance) -> bool:
    return (a.gen, a.zmq_endpoint, a.replay_endpoint, a.dp_size) == (
        b.gen,
        b.zmq_endpoint,
        b.replay_endpoint,
        b.dp_size,
    )


class Subscriber:
    """All subscriptions of one ingester process; :meth:`run` is its thread."""

    def __init__(
        self,
        store: L1Store,
        cfg: L1IngestSettings,
        metrics: IngestMetrics,
        *,
        owner: str = "",
        ctx: zmq.Context[zmq.Socket[bytes]] | None = None,
        health: Health | None = None,
        ingester: str = "",
    ) -> None:
        self.store, self.cfg, self.metrics, self.owner = store, cfg, metrics, owner
        self._beat = (health or Health()).heartbeat("subscriber loop")
        self.ctx = ctx or zmq.Context.instance()
        self._lock = threading.Lock()
        self._incoming: dict[str, Instance] | None = None
        self._wanted: dict[str, Instance] = {}
        self._active: dict[str, Instance] = {}
        self._conns: dict[tuple[str, int], RankConn] = {}
        self._by_socket: dict[zmq.Socket[bytes], tuple[SocketKind, RankConn]] = {}
        self._retry: dict[str, tuple[float, Backoff]] = {}
        self._digests: dict[tuple[str, int], tuple[int, int, bytes]] = {}
        """(ip, rank) → (gen, seq, digest) of the last payload applied by a closed session."""
        self.board = StatusBoard(
            store, cfg, metrics, owner=owner, ingester=ingester or owner or "unnamed"
        )
        self._status_due = 0.0
        self._verify_due = time.monotonic() + VERIFY_INTERVAL
        self._poller = zmq.Poller()
        self._dirty = True
        self._idle = threading.Event()  # waited on when run_once is not given a stop event

    def set_instances(self, instances: dict[str, Instance]) -> None:
        """Thread-safe: the instances (ip → registry entry) this process must follow."""
        with self._lock:
            self._incoming = dict(instances)

    def run(self, stop: threading.Event) -> None:
        logger.info("subscriber started (topic %r)", self.cfg.topic)
        try:
            while not stop.is_set():
                self._beat.beat()
                try:
                    self.run_once(stop=stop)
                except Exception:  # the top of the loop: log, keep serving other instances
                    logger.exception("subscriber loop error")
                    stop.wait(0.1)
        finally:
            if stop.is_set():  # a thread that died otherwise must keep failing /healthz
                self._beat.close()
            self.close()

    def run_once(self, timeout_ms: int = POLL_MS, stop: threading.Event | None = None) -> None:
        self._reconcile()
        if self._dirty:
            self._sync_poller()
        if time.monotonic() >= self._verify_due:
            self._verify_cursors()
        if time.monotonic() >= self._status_due:
            self._write_status()
        if not self._poller.sockets:  # poll() would return at once: wait, don't spin
            (stop or self._idle).wait(self._idle_seconds(timeout_ms))
            return
        for sock, _ in self._poller.poll(timeout_ms):
            if sock in self._by_socket:
                self._dispatch(sock)
        for conn in list(self._conns.values()):
            replay = conn.stream.replay
            if replay is not None and replay.expired():
                self._guarded(conn, conn.stream.finish_replay)

    def close(self) -> None:
        for ip in list(self._active):
            self._drop(ip)

    def _idle_seconds(self, timeout_ms: int) -> float:
        """The poll timeout, or less if an instance is due to be retried sooner."""
        wait = timeout_ms / 1000
        if self._retry:
            due = min(at for at, _ in self._retry.values())
            wait = min(wait, max(0.0, due - time.monotonic()))
        return wait

    # -- instance set ----------------------------------------------------------------------

    def _reconcile(self) -> None:
        with self._lock:
            incoming, self._incoming = self._incoming, None
        if incoming is not None:
            for ip, inst in incoming.items():
                old = self._wanted.get(ip)
                if old is not None and not _same(old, inst):
                    self._retry.pop(ip, None)
            self._wanted = incoming
        elif not self._retry:
            return
        for ip, inst in list(self._active.items()):
            want = self._wanted.get(ip)
            if want is None or not _same(inst, want):
                logger.info("unsubscribing %s (%s)", ip, "gone" if want is None else "changed")
                self._drop(ip)
        now = time.monotonic()
        for ip, inst in self._wanted.items():
            if ip not in self._active and self._retry.get(ip, (0.0, None))[0] <= now:
                self._open(inst)
        self._retry = {ip: r for ip, r in self._retry.items() if ip in self._wanted}
        self.board.prune(self._wanted)
        self._digests = {k: v for k, v in self._digests.items() if k[0] in self._wanted}

    def _open(self, inst: Instance) -> None:
        if not inst.zmq_endpoint:
            self._schedule_retry(inst.ip, "no ZMQ endpoint registered")
            return
        self._active[inst.ip] = inst
        try:
            for rank in range(max(1, inst.dp_size)):
                self._open_rank(inst, rank)
        except (redis.RedisError, zmq.ZMQError) as exc:
            self._drop(inst.ip)
            self._schedule_retry(inst.ip, f"cannot subscribe: {exc}")
            return
        logger.info(
            "subscribed to %s at %s (dp %d, replay %s, gen %d)",
            inst.ip,
            inst.zmq_endpoint,
            inst.dp_size,
            inst.replay_endpoint or "none",
            inst.gen,
        )

    def _group_settings(self, inst: Instance) -> GroupSettings:
        unit = self.cfg.hybrid_settings(inst.model)
        return GroupSettings(
            unit.prefix_match_unit, unit.attention_chunk_size, max(1, inst.dp_size)
        )

    def _open_rank(self, inst: Instance, rank: int) -> None:
        gen, seq, digest = self._digests.get((inst.ip, rank), (None, None, b""))
        stream = RankStream(
            inst,
            rank,
            self.store,
            self.ctx,
            owner=self.owner,
            gap_policy=self.cfg.on_unrecoverable_gap,
            replay_timeout=self.cfg.replay_timeout,
            metrics=self.metrics,
            last_digest=(seq, digest) if gen == inst.gen and seq is not None else None,
            status=self.board.of(inst),
            groups=self._group_settings(inst),
        )
        conn = RankConn.open(stream, self.ctx, self.cfg, self.metrics)
        self._conns[(inst.ip, rank)] = conn
        self._by_socket[conn.sub] = (SocketKind.SUB, conn)
        self._by_socket[conn.monitor] = (SocketKind.MONITOR, conn)
        self._dirty = True
        conn.connect()
        self.metrics.subscribed.set(len(self._conns))

    def _drop(self, ip: str) -> None:
        inst = self._active.pop(ip, None)
        for rank in range(max(1, inst.dp_size if inst else 1)):
            conn = self._conns.pop((ip, rank), None)
            if conn is not None:
                self._close_conn(conn)
        self.metrics.subscribed.set(len(self._conns))
        self._dirty = True

    def _close_conn(self, conn: RankConn) -> None:
        for sock in (conn.sub, conn.monitor):
            self._by_socket.pop(sock, None)
        stream = conn.stream
        if stream.digest is not None:
            self._digests[(stream.inst.ip, stream.rank)] = (stream.inst.gen, *stream.digest)
        conn.close()

    # -- status ----------------------------------------------------------------------------

    def _write_status(self) -> None:
        """Write the status of every wanted instance (one pipeline, see ``status``)."""
        self._status_due = time.monotonic() + min(STATUS_INTERVAL, self.cfg.heartbeat_interval)
        by_ip: dict[str, list[RankConn]] = {}
        for (ip, _), c in self._conns.items():
            by_ip.setdefault(ip, []).append(c)
        rounds = []
        for ip, inst in self._wanted.items():
            ranks = by_ip.get(ip)
            if ip in self._active and ranks:
                conn = worst([c.state for c in ranks])
                replaying = any(c.stream.replay is not None for c in ranks)
                resyncing = any(c.stream.resyncing for c in ranks)
                rounds.append(ConnRound(inst, conn, inst.zmq_endpoint, replaying, resyncing))
            else:
                rounds.append(ConnRound(inst, ConnState.RETRYING, "", False))
        self.board.write(rounds)

    def _verify_cursors(self) -> None:
        """Compare every idle rank's stored cursor with its stream's (one pipeline); a rank
        whose cursor moved re-syncs. A Redis failure is left to the next write or check."""
        self._verify_due = time.monotonic() + VERIFY_INTERVAL
        conns = [c for c in self._conns.values() if not c.stream.paused]
        try:
            stored = self.store.cursors([(c.stream.inst.ip, c.stream.rank) for c in conns])
        except redis.RedisError as exc:
            logger.warning("cannot check the stored cursors: %s", exc)
            return
        for conn, cursor in zip(conns, stored, strict=True):
            stream = conn.stream
            if (stream.inst.ip, stream.rank) in self._conns and not cursor.same(stream.stored):
                self._guarded(conn, partial(stream.resync, "the stored cursor moved", []))

    def _schedule_retry(self, ip: str, why: str) -> None:
        _, backoff = self._retry.get(ip, (0.0, None))
        backoff = backoff or Backoff(self.cfg.backoff_initial, self.cfg.backoff_max)
        delay = backoff.next_delay()
        self._retry[ip] = (time.monotonic() + delay, backoff)
        if ip in self._wanted:
            self.board.of(self._wanted[ip]).retry_reason = why
        logger.warning("instance %s: %s; retrying in %.1fs", ip, why, delay)

    # -- poll loop -------------------------------------------------------------------------

    def _sync_poller(self) -> None:
        """Poll monitors always, SUBs unless paused, and the DEALER of each replay in flight."""
        self._poller = zmq.Poller()
        self._by_socket = {
            s: v for s, v in self._by_socket.items() if v[0] is not SocketKind.REPLAY
        }
        for conn in self._conns.values():
            self._poller.register(conn.monitor, zmq.POLLIN)
            replay = conn.stream.replay
            if replay is not None and not replay.done:
                self._poller.register(replay.socket, zmq.POLLIN)
                self._by_socket[replay.socket] = (SocketKind.REPLAY, conn)
            if not conn.stream.paused:
                self._poller.register(conn.sub, zmq.POLLIN)
        self._dirty = False

    def _dispatch(self, sock: zmq.Socket[bytes]) -> None:
        kind, conn = self._by_socket[sock]
        if kind is SocketKind.SUB:
            self._guarded(conn, conn.read_live)
        elif kind is SocketKind.MONITOR:
            self._guarded(conn, conn.read_monitor)
        else:
            self._guarded(conn, lambda: self._read_replay(conn, sock))

    def _read_replay(self, conn: RankConn, sock: zmq.Socket[bytes]) -> None:
        replay = conn.stream.replay
        if replay is not None and replay.socket is sock and replay.read():
            conn.stream.finish_replay()

    def _guarded(self, conn: RankConn, action: Callable[[], None]) -> None:
        """Run a stream action; on a Redis or ZMQ failure or fencing, close the instance and
        retry it later (never raise: the other instances keep being served)."""
        before = (conn.stream.paused, conn.stream.replay)
        ip = conn.stream.inst.ip
        try:
            action()
        except FencedError as exc:
            self._drop(ip)
            self._schedule_retry(ip, f"writes refused ({exc.status})")
            return
        except (redis.RedisError, zmq.ZMQError) as exc:
            self._drop(ip)
            what = "Redis" if isinstance(exc, redis.RedisError) else "ZMQ"
            self._schedule_retry(ip, f"{what} failed: {exc}")
            return
        if (conn.stream.paused, conn.stream.replay) != before:
            self._dirty = True
