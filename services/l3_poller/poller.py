"""The L3 poll loops: one thread per Mooncake master, and a supervisor that follows the
master registry (``Store.list_masters``) and starts or stops those threads.

One poll of a master: list its segments (``discovery.segmentsFetchTimeout``), stream
``/get_all_keys`` into its :class:`MasterIndex`, locate only the keys the index does not
know yet (or whose segment went away) with ``/batch_query_keys`` in runs of
``ingest.l3.batchSize`` (``/query_key`` one by one on masters without it), then publish the
result to the :class:`L3Writer`. Scope ``pool`` needs no locations, so it queries nothing.

A failed poll (master down, slow, 503, garbage, cut body) changes nothing: the last good
state stays in Redis while the thread retries with capped, jittered backoff. Once
``ingest.l3.staleAfter`` has passed since the last good poll, the master's contribution is
dropped and its instances are flagged ``stale=1``; the next good poll restores them.

After every poll attempt the master's status goes to ``ci:master:{url}:state`` (fields
:data:`.status.STATE_FIELDS`); keys that parse as no known family are counted there, in the
``_keys_unparsed`` gauge and logged once (with a sample) when they appear.
"""

from __future__ import annotations

import logging
import threading
import time
from array import array
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import redis

from common.health import Health, Heartbeat
from common.lifecycle import Backoff, StateLog
from common.settings import L3PollerSettings
from services.l3_poller.client import (
    MAX_URL_BYTES,
    Churn,
    MasterClient,
    MasterError,
    NoBatchEndpoint,
    Replicas,
)
from services.l3_poller.completeness import pins_by_model
from services.l3_poller.index import Blocks, MasterIndex, PollStats, SegmentMap
from services.l3_poller.metrics import PollerMetrics
from services.l3_poller.status import master_state, note_unmappable, note_unparsed
from services.l3_poller.writer import L3Writer, L3Writes, MasterView

logger = logging.getLogger(__name__)


class L3Store(L3Writes, Protocol):
    """The poller's role of :class:`common.store.Store`: its writer's, and the master list."""

    def list_masters(self) -> dict[str, str]: ...


ClientFactory = Callable[[str], MasterClient]
_IN_FLIGHT = 2
"""Locate requests in flight per master: one answered while the next is being served."""


class _Stopped(Exception):
    """The poller was asked to stop in the middle of a poll."""


@dataclass
class _Pending:
    """Keys to locate, kept as joined batches (≈ key bytes + 8 per key), not one str each."""

    size: int
    batches: list[tuple[bytes, list[int]]]
    _keys: list[bytes]
    _ids: list[int]
    _bytes: int = 0

    def add(self, key: bytes, key_id: int) -> None:
        if self._keys and (
            len(self._keys) >= self.size or self._bytes + len(key) + 1 > MAX_URL_BYTES
        ):
            self.flush()
        self._keys.append(key)
        self._ids.append(key_id)
        self._bytes += len(key) + 1

    def flush(self) -> None:
        if self._keys:
            self.batches.append((b",".join(self._keys), self._ids))
            self._keys, self._ids, self._bytes = [], [], 0


class MasterPoller:
    """Polls one master until ``stop`` is set; publishes every good poll to the writer."""

    def __init__(
        self,
        url: str,
        cfg: L3PollerSettings,
        client: MasterClient,
        writer: L3Writer,
        metrics: PollerMetrics,
        stop: threading.Event,
        beat: Heartbeat | None = None,
    ) -> None:
        self.url, self.cfg, self.client, self.writer = url, cfg, client, writer
        self.metrics, self.stop = metrics, stop
        self.beat = beat or Health().heartbeat(f"master {url}")
        self.index = MasterIndex(
            locate=cfg.scope == "segment",
            ns_memory=cfg.stale_after,
            formats=tuple(cfg.key_formats),
            pins=pins_by_model((m.name, m.heads, m.pp_ranks, m.layers) for m in cfg.models),
        )
        self.has_batch = True
        self._removals: Churn | None = None
        """The master's removal counts before the last committed listing (None = unknown)."""
        self.view: MasterView | None = None
        self.last_stats: PollStats | None = None
        self.error = ""
        self._log = StateLog(logger, f"master {url}")

    def run(self) -> None:
        interval, stale_after = self.cfg.poll_interval, self.cfg.stale_after
        backoff = Backoff(interval, 4 * interval)
        last_ok, dropped = time.monotonic(), False
        while not self.stop.is_set():
            started = time.monotonic()
            if not self._poll_safely():
                delay = backoff.next_delay()
                left = last_ok + stale_after - time.monotonic()
                if not dropped and left <= 0:
                    self._drop()
                    dropped = True
                elif not dropped:
                    delay = min(delay, left)
            else:
                last_ok, dropped = time.monotonic(), False
                backoff.reset()
                delay = interval - (last_ok - started)
            if not self.stop.is_set():
                self._report()
            self.beat.wait(self.stop, delay)
        self.beat.close()
        self.client.close()

    def _poll_safely(self) -> bool:
        try:
            view = self.poll_once()
        except _Stopped:
            return False
        except MasterError as exc:
            self.metrics.errors.inc(master=self.url, reason=exc.reason)
            self._log.set(f"failing ({exc.reason})", str(exc), logging.WARNING)
            self.error = f"{exc.reason}: {exc}"
            return False
        except Exception as exc:
            logger.exception("master %s: poll failed", self.url)
            self.metrics.errors.inc(master=self.url, reason=type(exc).__name__)
            self.error = f"{type(exc).__name__}: {exc}"
            return False
        self.view, self.error = view, ""
        self._note_unparsed(self.index.stats)
        self._log.set("polling", f"{view.blocks.complete} blocks")
        self.metrics.master_stale.set(0, master=self.url)
        self.writer.publish(self.url, view, owner=self)
        return True

    def _note_unparsed(self, stats: PollStats) -> None:
        last = self.last_stats
        self.last_stats = stats
        note_unparsed(
            self.url,
            last.skipped["unparsed"] if last else 0,
            stats,
            self.cfg.key_formats,
            self.metrics,
        )
        note_unmappable(self.url, last.unmappable_group if last else 0, stats, self.metrics)

    def state(self) -> dict[str, str]:
        """This master's status hash (:data:`.status.STATE_FIELDS`)."""
        return master_state(self.last_stats, self.view, self.error)

    def _report(self) -> None:
        self.writer.report(self.url, self.state(), owner=self)

    def _drop(self) -> None:
        view = self.view or MasterView(Blocks({}, array("Q"), 0), frozenset(), 0)
        self.view = view.dropped()
        self._log.set("stale: state dropped", f"after {self.cfg.stale_after:g}s", logging.ERROR)
        self.metrics.master_stale.set(1, master=self.url)
        self.writer.publish(self.url, self.view, owner=self)

    def poll_once(self) -> MasterView:
        """One poll; raises :class:`MasterError` and leaves the index unchanged on failure."""
        started = time.monotonic()
        gens = self.writer.generations()  # before listing: data never outlives its pod
        segmap = self._segments()
        removals = self.client.removals() if self.index.locate else None
        # Counts unknown (no /metrics, or none before): every key is located again at once.
        blind = self.index.locate and bool(self.index.keys)
        blind = blind and (removals is None or self._removals is None)
        deadline = started + max(4 * self.cfg.http_timeout, 2 * self.cfg.poll_interval)
        self.index.begin(segmap, relocate=blind)
        try:
            pending = self._list(deadline)
            if not blind and self._some_key_may_have_moved():
                self.index.abort()
                self.index.begin(segmap, relocate=True)
                pending = self._list(deadline)
            self._locate(pending.batches)
            if self.index.unresolved:  # a segment mounted after we listed them
                self.index.remap(self._segments())
            stats = self.index.commit()
            self._removals = removals
        except BaseException:
            self.index.abort()
            raise
        blocks = self.index.blocks(self.cfg.scope)
        m, url = self.metrics, self.url
        m.keys_seen.inc(stats.seen, master=url)
        m.keys_parsed.inc(stats.parsed, master=url)
        for reason, n in stats.skipped.items():
            m.keys_skipped.inc(n, master=url, reason=reason)
        m.master_keys.set(len(self.index.keys), master=url)
        m.master_blocks.set(blocks.complete, master=url)
        m.poll_seconds.observe(time.monotonic() - started, master=url)
        return MasterView(blocks, frozenset(segmap.attached), int(time.time() * 1000), gens=gens)

    def _list(self, deadline: float) -> _Pending:
        """Stream the listing into the index; the keys it says must be located."""
        pending = _Pending(self.cfg.batch_size, [], [], [])
        for lines in self.client.iter_keys(deadline, self.index.stats.skipped):
            self.beat.beat()
            for key, key_id in self.index.feed(lines):
                pending.add(key, key_id)
            if self.stop.is_set():
                raise _Stopped
        pending.flush()
        return pending

    def _some_key_may_have_moved(self) -> bool:
        """True unless the master's counters prove that no key of the last listing was
        removed and put again before this one (read now, after this listing).

        A key changes holder only by being removed and put again. Every removal of a key
        between its two listings happened between the counts read before the last listing
        and now, so if the per-key removals in that window are no more than the known keys
        that vanished from the listing, none of the keys still listed was removed. Any
        other churn counter moving (batch removes, drains, promotions) cannot be counted
        per key: then some key may have moved."""
        if not self.index.locate or not self.index.keys:
            return False
        prev, now = self._removals, self.client.removals()
        if prev is None or now is None or now.other != prev.other:
            return True
        removed = now.per_key - prev.per_key
        return removed < 0 or removed > self.index.gone()

    def _segments(self) -> SegmentMap:
        return SegmentMap(self.client.segments(), self.client.segments_detail())

    def _locate(self, batches: list[tuple[bytes, list[int]]]) -> None:
        """Query the batches with one request in flight while the previous answer is
        applied (the wait for the master overlaps with our parsing)."""
        inflight: deque[tuple[Future[dict[str, Replicas | None]], list[bytes], list[int]]]
        inflight = deque()
        with ThreadPoolExecutor(max_workers=_IN_FLIGHT, thread_name_prefix="l3-locate") as ex:
            for blob, ids in batches:
                self.beat.beat()
                if self.stop.is_set():
                    raise _Stopped
                keys = blob.split(b",")
                inflight.append((ex.submit(self._query, keys), keys, ids))
                if len(inflight) >= _IN_FLIGHT:
                    self._apply(*inflight.popleft())
            while inflight:
                self._apply(*inflight.popleft())

    def _query(self, keys: list[bytes]) -> dict[str, Replicas | None]:
        if self.has_batch:
            try:
                found = self.client.batch_query(keys)
                self.metrics.locate_calls.inc(master=self.url, endpoint="batch_query_keys")
                return found
            except NoBatchEndpoint:
                if self.has_batch:
                    logger.info("master %s has no /batch_query_keys: using /query_key", self.url)
                self.has_batch = False
        self.metrics.locate_calls.inc(len(keys), master=self.url, endpoint="query_key")
        return {k.decode(): self.client.query_key(k) for k in keys}

    def _apply(
        self, future: Future[dict[str, Replicas | None]], keys: list[bytes], ids: list[int]
    ) -> None:
        found = future.result()
        self.metrics.keys_located.inc(len(keys), master=self.url)
        for key, key_id in zip(keys, ids):
            text = key.decode()
            if text in found:
                self.index.located(key_id, found[text])


class L3Poller:
    """Follows the master registry; one :class:`MasterPoller` thread per master URL."""

    def __init__(
        self,
        cfg: L3PollerSettings,
        store: L3Store,
        metrics: PollerMetrics,
        client_factory: ClientFactory | None = None,
        health: Health | None = None,
    ) -> None:
        self.cfg, self.store, self.metrics = cfg, store, metrics
        self.health = health or Health()
        self._ready = self.health.condition("redis")
        self.writer = L3Writer(store, cfg.scope, metrics)
        self._factory = client_factory or (
            lambda url: MasterClient(url, cfg.http_timeout, cfg.segments_timeout)
        )
        self.pollers: dict[str, tuple[MasterPoller, threading.Thread]] = {}
        self._log = StateLog(logger, "master registry")

    def run(self, stop: threading.Event) -> None:
        """Re-read the registry every ``pollInterval`` until ``stop``; then stop all threads."""
        beat = self.health.heartbeat("master registry loop")
        try:
            while not stop.is_set():
                beat.beat()
                self.reconcile()
                beat.wait(stop, min(self.cfg.poll_interval, 5.0))
        finally:
            beat.close()
            for url in list(self.pollers):
                self._stop_master(url, publish=False)

    def reconcile(self) -> None:
        try:
            masters = {self._url(u) for u in self.store.list_masters()}
        except redis.RedisError as exc:
            self._log.set("unreadable", repr(exc), logging.WARNING)
            self._ready.set(False, f"cannot read the master registry: {exc!r}")
            return
        self._log.set("read", f"{len(masters)} masters")
        self._ready.set(True)
        for url in sorted(masters - self.pollers.keys()):
            poller = MasterPoller(
                url,
                self.cfg,
                self._factory(url),
                self.writer,
                self.metrics,
                threading.Event(),
                self.health.heartbeat(f"master {url}"),
            )
            self.writer.enroll(url, poller)
            thread = threading.Thread(target=poller.run, name=f"l3 {url}", daemon=True)
            self.pollers[url] = (poller, thread)
            thread.start()
            logger.info("polling master %s every %gs", url, self.cfg.poll_interval)
        for url in sorted(self.pollers.keys() - masters):
            logger.info("master %s left the registry", url)
            self._stop_master(url, publish=True)

    def _url(self, url: str) -> str:
        return url if "://" in url else f"{self.cfg.scheme}://{url}"

    def _stop_master(self, url: str, publish: bool) -> None:
        poller, thread = self.pollers.pop(url)
        poller.stop.set()
        if publish:
            self.writer.retire(url)
        thread.join(timeout=self.cfg.http_timeout * 2 + 1)
