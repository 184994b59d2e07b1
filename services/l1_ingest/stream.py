"""One subscribed (instance, DP rank): its sequence cursor, replays, and fenced writes.

The subscriber hands every live batch of the rank to :meth:`RankStream.on_live`. A batch
that follows the last applied one is written at once (one ``Store.apply_batch`` = one Lua
round trip). A gap starts a replay (when the instance has a replay endpoint); the live batch
that revealed it waits, and the subscriber stops reading the rank's SUB socket (ZMQ queues
the rest) until :meth:`finish_replay` has written the replayed batches and then that one.
What replay cannot cover is handled by ``ingest.l1.onUnrecoverableGap``: ``keep`` writes the
next batch with ``gap=True`` (the store counts it), ``clear`` with ``reset=True``. A live
sequence that goes backwards (:class:`~services.l1_ingest.apply.Verdict`) is a publisher
restart: the rank is reset and replayed from 0.

A write the store refuses for another reason than a moved cursor (``stale_gen``,
``not_owner``, ``groups_changed``: :class:`~common.store.BatchStatus`) raises
:class:`~common.errors.FencedError` and ends the session (the subscriber's docstring says
what follows); a moved cursor re-syncs the rank instead (below).

A payload that is not an EventBatch is dropped and counted, but its sequence is still
recorded (an empty write): vLLM sent it, replaying it would return the same bytes, and
treating it as a gap would clear or flag the index for nothing.

**Continuity.** Every replay asks from the last applied sequence itself (not the one after)
and the store keeps a short digest of the payload applied there (``dig:<rank>``, written with
``seq:<rank>`` by the same script). A publisher always buffers its newest batch, so the one
we followed still holds that sequence: a reply that lacks it, or holds different bytes at it,
shows the publisher restarted (vLLM does not persist its sequence, and every payload
carries a timestamp): the rank is reset and replayed from 0. Because the digest is in Redis,
this holds after an ingester restart too. A replay that starts above the sequence asked for
(trimmed buffer, spec §1.3), a first join from 0 included, is an unrecoverable gap. Without a
replay endpoint nothing can verify a lifetime, so the first live batch after a (re)connect
(a session's first included) that is past the cursor (a gap) is taken for a **possible
restart** and resets the rank (whatever the gap policy, which still applies to a gap while
connected, e.g. a full HWM): the index then under-reports until the engine stores its blocks
again, but never credits the instance with a dead lifetime's blocks.

**Cursor fence.** Every write names the cursor (seq, digest) it follows
(:class:`~common.store.StoredCursor`); the store refuses it (``CURSOR_MOVED``) if the stored
one differs, e.g. a Redis failover lost acknowledged writes or emptied the state hash. The
stream then re-syncs (:meth:`RankStream.resync`): it re-reads the stored cursor and replays
from there, which the continuity check above verifies; what replay cannot cover (no endpoint,
trimmed buffer, nothing stored) resets the rank. The subscriber's periodic check of the
stored cursors (its docstring) re-syncs a quiet rank the same way.

A replay endpoint ZMQ cannot connect to (``tcp://*:port``, no port) makes replay unavailable
for the session: logged once, and every gap is handled by the policy above; the other
instances are never held up. Static discovery already skips such entries
(``services/discovery/endpoints.py``).
"""

from __future__ import annotations

import logging
import time

import zmq

from common.config import GapPolicy
from common.errors import FencedError
from common.lifecycle import StateLog
from common.store import ApplyResult, BatchStatus, Instance, StoredCursor, TierOps
from services.l1_ingest.apply import Cursor, GroupSettings, Step, Verdict, classify, plan_run
from services.l1_ingest.batch import (
    BatchWriter,
    count_applied,
    decode_plan,
    digest_of,
    payload_digest,
    show_cursor,
)
from services.l1_ingest.metrics import IngestMetrics
from services.l1_ingest.replay import ReplayEndpoint, ReplayRequest
from services.l1_ingest.status import InstanceStatus

logger = logging.getLogger(__name__)

__all__ = ["BatchWriter", "RankStream", "payload_digest", "rank_endpoint"]


def rank_endpoint(endpoint: str, rank: int) -> str:
    """vLLM's per-DP-rank endpoint: tcp port + rank, inproc ``_dp<rank>``; rank 0 unchanged."""
    if not endpoint or rank == 0:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{rank}"
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        if port.isdigit():
            return f"{base}:{int(port) + rank}"
    return endpoint


class RankStream:
    """Sequence state and writes of one instance rank for one subscription session."""

    def __init__(
        self,
        inst: Instance,
        rank: int,
        store: BatchWriter,
        ctx: zmq.Context[zmq.Socket[bytes]],
        *,
        owner: str,
        gap_policy: GapPolicy,
        replay_timeout: float,
        metrics: IngestMetrics,
        last_digest: tuple[int, bytes] | None = None,
        status: InstanceStatus | None = None,
        groups: GroupSettings | None = None,
    ) -> None:
        self.inst, self.rank, self.store, self.ctx = inst, rank, store, ctx
        self.groups = groups or GroupSettings(dp_size=max(1, inst.dp_size))
        self.owner, self.gap_policy, self.replay_timeout = owner, gap_policy, replay_timeout
        self.metrics, self.status = metrics, status
        self.name = f"{inst.ip}/r{rank}"
        self.replay_endpoint = rank_endpoint(inst.replay_endpoint, rank)
        self.stored = store.cursor(inst.ip, rank)
        """The cursor this stream believes is stored: what every write is fenced by."""
        self.cursor = Cursor(applied=self.stored.seq)
        # (seq, payload digest) of the last batch applied: the store's, or (data written
        # before digests were stored) a previous session's if it is still the store's seq
        self.digest = digest_of(self.stored)
        if self.digest is None and last_digest and last_digest[0] == self.cursor.applied:
            self.digest = last_digest
        self.replay: ReplayRequest | None = None
        self.pending: list[tuple[int, bytes]] = []
        self.resyncing = ""
        """Why the rank is being re-synced after its stored cursor moved ("" = it is not)."""
        self._unverified = True
        """No batch seen since the last (re)connect and no replay to verify the lifetime."""
        self._replay_state = StateLog(logger, f"{self.name}: replay at {self.replay_endpoint!r}")
        self._replay_state.state = ReplayEndpoint.AVAILABLE  # only a change from here is logged

    @property
    def paused(self) -> bool:
        """True while live batches must wait (a replay is in flight)."""
        return self.replay is not None

    # -- events from the subscriber --------------------------------------------------------

    def on_connected(self) -> None:
        """(Re)connected: catch up through a replay from the last applied sequence itself
        (the module docstring, "Continuity", says why)."""
        self._unverified = True
        if not self.paused:
            self._start_replay(self._replay_start(), [])

    def on_live(self, seq: int, payload: bytes) -> None:
        if self.status is not None:
            self.status.batches += 1
        verdict = classify(self.cursor, seq)
        if verdict is Verdict.RESTART:
            logger.warning(
                "%s: sequence went back from %s to %d: publisher restarted, "
                "dropping the rank's index",
                self.name,
                self.cursor.applied,
                seq,
            )
            self.metrics.restarts.inc()
            self.cursor.mark_restart()
            self.digest = None
            verdict = Verdict.APPLY if seq == 0 else Verdict.GAP
        live_max = self.cursor.live_max
        self.cursor.live_max = seq if live_max is None else max(seq, live_max)
        if verdict is Verdict.DUPLICATE:
            self.metrics.batches.inc(result=BatchStatus.DUPLICATE)
            return
        unverified, self._unverified = self._unverified, False
        if verdict is Verdict.GAP and self._start_replay(self._replay_start(), [(seq, payload)]):
            logger.info(
                "%s: gap before seq %d (last applied %s): replaying",
                self.name,
                seq,
                self.cursor.applied,
            )
            return
        if verdict is Verdict.GAP and unverified and self.cursor.applied not in (None, -1):
            self._restart(
                f"possible restart: seq {seq} follows seq {self.cursor.applied} right after a "
                "(re)connect, and no replay can verify the lifetime",
                [(seq, payload)],
            )
            return
        self._write_run([(seq, payload)], counting_gap=verdict is Verdict.GAP)

    def resync(self, why: str, held: list[tuple[int, bytes]]) -> None:
        """The stored cursor is not the one this stream follows (a write was refused, or the
        periodic check saw it): re-read it and re-sync from it, then write ``held``."""
        stored = self.store.cursor(self.inst.ip, self.rank)
        theirs, ours = show_cursor(stored), show_cursor(self.stored)
        self.resyncing = f"{why}; stored cursor {theirs}, ours {ours}"
        logger.warning("%s: %s: re-syncing", self.name, self.resyncing)
        self.metrics.resyncs.inc()
        if self.status is not None:
            self.status.resynced(self.resyncing)
        self.close()
        self.stored, self.cursor, self.digest = stored, Cursor(stored.seq), digest_of(stored)
        held = sorted(held)
        if self.digest is None:
            self._reset(f"{why}: nothing to verify a replay against", held)
        elif not self._start_replay(self.digest[0], held):
            self._reset(f"{why}: no replay to re-sync from", held)

    def finish_replay(self) -> None:
        """The replay ended (end marker or deadline): write its batches, then the held one."""
        replay, self.replay = self.replay, None
        if replay is None:
            return
        self.metrics.replays.inc(result="complete" if replay.complete else "timeout")
        batches = sorted(replay.batches, key=lambda b: b[0])
        if self.status is not None:
            self.status.batches += len(batches)
        held, self.pending = self.pending, []
        logger.info(
            "%s: replay from %d returned %d batches%s",
            self.name,
            replay.start_seq,
            len(batches),
            "" if replay.complete else " before timing out",
        )
        if self._other_bytes_at_applied(replay.start_seq, batches):
            self._restart(f"replay: its batch {replay.start_seq} is not the one applied", held)
            return
        if not held and replay.complete and not batches and not self._empty_catch_up():
            return
        if self.cursor.applied is None and batches and batches[0][0] > replay.start_seq:
            self.cursor.applied = replay.start_seq - 1  # joined a trimmed buffer: a gap
        if self._write_run(batches + held, counting_gap=bool(held)):
            self.resyncing = ""

    def close(self) -> None:
        if self.replay is not None:
            self.replay.close()
            self.replay = None

    # -- internals -------------------------------------------------------------------------

    def _replay_start(self) -> int:
        """Replays start at the last applied sequence (a continuity check), or at 0."""
        applied = self.cursor.applied
        return applied if applied is not None and applied >= 0 else 0

    def _other_bytes_at_applied(self, start: int, batches: list[tuple[int, bytes]]) -> bool:
        """True if the replay holds our last applied sequence with a payload we did not apply."""
        if self.digest is None or not batches or self.digest[0] != start:
            return False
        seq, payload = batches[0]
        return seq == start and payload_digest(payload) != self.digest[1]

    def _empty_catch_up(self) -> bool:
        """A connect-time replay found nothing at or after where we stand; False if that
        reset the rank (the publisher restarted)."""
        applied = self.cursor.applied
        if applied is None:
            # Nothing was published yet: the stream starts at 0, so if the first live batch
            # is lost (slow joiner, spec §1.2) the next one shows up as a gap.
            self.cursor.applied = -1
        elif applied >= 0:
            self._restart(f"replay: it no longer has seq {applied}", [])
            return False
        return True

    def _restart(self, why: str, held: list[tuple[int, bytes]]) -> None:
        """The publisher restarted while we were away: reset the rank, replay from 0."""
        logger.warning(
            "%s: publisher restarted (%s): dropping the rank's index and replaying from 0",
            self.name,
            why,
        )
        self.metrics.restarts.inc()
        if self.status is not None:
            self.status.restarted(f"r{self.rank}: {why}")
        self._reset(why, held)

    def _reset(self, why: str, held: list[tuple[int, bytes]]) -> None:
        """Drop the rank's index (one fenced write, not fenced by the cursor) and rebuild it
        from 0: replay, or else the held batches (with a gap before them)."""
        self.cursor.mark_restart()
        self.digest = None
        result = self.store.apply_batch(
            self.inst.ip, self.inst.gen, self.rank, -1, TierOps(), owner=self.owner, reset=True
        )
        if result.status is not BatchStatus.APPLIED:
            raise self._refused(result, f"the reset ({why})")
        self.stored = StoredCursor(-1)
        self.cursor.mark_applied(-1)
        if self._start_replay(0, held):
            return
        # whatever it sent so far; without a replay no gap is recovered (an unfilled one
        # is counted by the write after it)
        if self._write_run(held, counting_gap=False):
            self.resyncing = ""

    def _start_replay(self, start: int, held: list[tuple[int, bytes]]) -> bool:
        """Ask for a replay from ``start`` holding ``held``; False if replay is unavailable."""
        if not self.replay_endpoint:
            return False
        try:
            replay = ReplayRequest(
                self.ctx,
                self.replay_endpoint,
                start,
                self.replay_timeout,
                on_malformed=self._count_malformed,
            )
        except zmq.ZMQError as exc:
            why = f"{exc}; gaps cannot be filled"
            self._replay_state.set(ReplayEndpoint.UNAVAILABLE, why, logging.ERROR)
            return False
        self._replay_state.set(ReplayEndpoint.AVAILABLE)
        self.pending, self.replay = held, replay
        return True

    def _count_malformed(self, reason: str) -> None:
        self.metrics.malformed_frames.inc(reason=reason)

    def _write_run(self, batches: list[tuple[int, bytes]], *, counting_gap: bool) -> bool:
        """Write batches in sequence order; count the gap (if one was seen) by its outcome.
        False if the stored cursor moved meanwhile (the stream is re-syncing)."""
        steps, dropped = plan_run(self.cursor.applied, batches)
        if dropped:
            self.metrics.batches.inc(dropped, result=BatchStatus.DUPLICATE)
        unfilled = any(step.gap_before for step in steps)
        if counting_gap and not unfilled:
            self.metrics.gaps.inc(outcome="recovered")
        for i, step in enumerate(steps):
            # FencedError ends the run: the rest would be refused too
            if not self._write(step):
                rest = [(s.seq, s.payload) for s in steps[i:]]
                self.resync(f"the write of seq {step.seq} was refused", rest)
                return False
        return True

    def _write(self, step: Step) -> bool:
        """Write one batch; False if the stored cursor moved (raise if it was fenced)."""
        plan, events = decode_plan(self.name, step, self.groups, self.metrics)
        reset, gap = self._gap_flags(step)
        digest = payload_digest(step.payload)
        stored = StoredCursor(step.seq, digest.hex())
        started = time.perf_counter()
        result = self.store.apply_batch(
            self.inst.ip,
            self.inst.gen,
            self.rank,
            step.seq,
            plan.ops,
            owner=self.owner,
            reset=reset,
            gap=gap,
            follows=self.stored,
            digest=stored.digest,
        )
        self.metrics.apply_seconds.observe(time.perf_counter() - started)
        self.metrics.batches.inc(result=result.status)
        if result.status is BatchStatus.APPLIED:
            self.cursor.mark_applied(step.seq)
            self.digest = (step.seq, digest)
            self.stored = stored
            count_applied(self.metrics, plan, result)
            if self.status is not None and self.status.checker is not None:
                self.status.checker.offer(events)
        elif result.status is BatchStatus.DUPLICATE:
            self.stored = self.store.cursor(self.inst.ip, self.rank)
            self.cursor.applied = self.stored.seq
        elif result.status is BatchStatus.CURSOR_MOVED:
            return False
        else:
            raise self._refused(result, f"the write of seq {step.seq}")
        return True

    def _gap_flags(self, step: Step) -> tuple[bool, bool]:
        """(reset, gap) of the write of ``step``: what a gap before it does to the rank."""
        reset = self.cursor.reset_pending
        if not step.gap_before:
            return reset, False
        if self.resyncing:
            # writes the store lost that replay cannot give back: what they removed may
            # still be in the index, so rebuild the rank rather than keep it
            logger.error(
                "%s: batches %s..%d are lost and not replayable: resetting the rank",
                self.name,
                self.cursor.expected(),
                step.seq - 1,
            )
            return True, False
        self.metrics.gaps.inc(outcome="unrecoverable")
        logger.error(
            "%s: batches %s..%d are lost (no replay covers them): %s the index",
            self.name,
            self.cursor.expected(),
            step.seq - 1,
            "clearing" if self.gap_policy == "clear" else "keeping (flagged)",
        )
        return reset or self.gap_policy == "clear", self.gap_policy != "clear"

    def _refused(self, result: ApplyResult, what: str) -> FencedError:
        logger.error(
            "%s: %s was refused (%s): stopping this subscription", self.name, what, result.status
        )
        return FencedError(f"{self.name}: {what} was refused ({result.status})", result.status)
