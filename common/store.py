"""Every Redis read and write of cache-indexer, over an explicitly passed client.

The key layout is documented in :mod:`common.keys`. Writes that must be atomic (copy
counts together with set membership, generation / owner fencing, registry changes that
drop an instance's data) run as Lua scripts from :mod:`common.store_lua`, registered once
per :class:`Store`. Reads on the API's hot path are one non-transactional pipeline
(:mod:`common.store_reads`); the words of an L1 batch write are in :mod:`common.store_batch`.
Each process types against the narrow role it uses (a ``Protocol`` in its service); the
reads only tests make are in ``tests/store_oracle.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import redis

from common import keys, store_lua
from common.redis_client import Client, text, text_dict
from common.store_batch import ApplyResult as ApplyResult
from common.store_batch import BatchStatus as BatchStatus
from common.store_batch import L1Status as L1Status
from common.store_batch import Op as Op
from common.store_batch import BATCH_STATUS_CODES
from common.store_batch import StoredCursor as StoredCursor
from common.store_batch import TierOps as TierOps
from common.store_reads import Reads, execute

L3_CHUNK = 10_000
"""Members per SADD when a staging set is filled (bounded command size)."""


@dataclass(frozen=True)
class Instance:
    """One vLLM instance as discovery registers it (``ip`` is the callers' ``server_ip``)."""

    ip: str
    uid: str
    pod: str = ""
    zmq_endpoint: str = ""
    replay_endpoint: str = ""
    dp_size: int = 1
    role: str = ""
    restarts: str = "0"
    gen: int = 0
    model: str = ""
    """The served model, when discovery knows it (matched against ``ingest.l1.models``)."""
    http_endpoint: str = ""
    """``http://host:port`` of the instance's OpenAI-compatible server ('' = unknown)."""

    def meta_fields(self) -> list[str]:
        return [
            "pod",
            self.pod,
            "zmq",
            self.zmq_endpoint,
            "replay",
            self.replay_endpoint,
            "dp",
            str(self.dp_size),
            "role",
            self.role,
            "model",
            self.model,
            "http",
            self.http_endpoint,
        ]

    @classmethod
    def from_meta(cls, ip: str, meta: dict[str, str]) -> Instance:
        return cls(
            ip=ip,
            uid=meta.get("uid", ""),
            pod=meta.get("pod", ""),
            zmq_endpoint=meta.get("zmq", ""),
            replay_endpoint=meta.get("replay", ""),
            dp_size=int(meta.get("dp", "1") or 1),
            role=meta.get("role", ""),
            restarts=meta.get("restarts", "0"),
            gen=int(meta.get("gen", "0") or 0),
            model=meta.get("model", ""),
            http_endpoint=meta.get("http", ""),
        )


class RegistryChange(StrEnum):
    """What :meth:`Store.upsert_instance` did (its values are metric label values)."""

    ADDED = "added"
    REPLACED = "replaced"
    """A new pod UID on this IP: the old pod's data was dropped."""
    RESTARTED = "restarted"
    """The container restarted: its L1 data was dropped."""
    UPDATED = "updated"
    UNCHANGED = "unchanged"


_INSTANCE_KEY: dict[str, Callable[[str], str]] = {
    "meta": keys.instance_meta,
    "gen": keys.instance_gen,
    "l1_state": keys.l1_state,
    "l1_owner": keys.l1_owner,
    "l1_set": lambda ip: keys.tier_set(ip, "l1"),
    "l1_copies": lambda ip: keys.tier_copies(ip, "l1"),
    "l2_set": lambda ip: keys.tier_set(ip, "l2"),
    "l2_copies": lambda ip: keys.tier_copies(ip, "l2"),
    "l3_set": keys.l3_set,
    "l3_staging": keys.l3_staging,
    "l3_state": keys.l3_state,
    "legacy_l1_counts": lambda ip: keys.tier_counts(ip, "l1"),  # legacy layout, dropped
    "legacy_l2_counts": lambda ip: keys.tier_counts(ip, "l2"),
    "l1_groups": keys.l1_groups,
}
"""Each name of :data:`common.store_lua.INSTANCE_KEYS` → its key (the order is the table's)."""


def _instance_keys(ip: str) -> list[str]:
    return [_INSTANCE_KEY[name](ip) for name in store_lua.INSTANCE_KEYS]


def _rank_prefixes(ip: str) -> list[str]:
    # Legacy per-rank hashes (dropped on sight): tier_rank_counts(ip, 0) ends in "r0"; the
    # scripts append the rank themselves. ARGV[1..2] of the scripts that drop L1/L2 only.
    return [keys.tier_rank_counts(ip, 0, t)[:-1] for t in ("l1", "l2")]


def _batch_argv(
    ip: str,
    gen: int,
    owner: str,
    rank: int,
    seq: int,
    reset: bool,
    gap: bool,
    follows: StoredCursor | None,
    digest: str,
) -> dict[str, str | int]:
    """APPLY_BATCH's fixed ARGV by name (``store_lua.APPLY_BATCH_ARGV``)."""
    legacy_l1, legacy_l2 = _rank_prefixes(ip)
    follows_seq, follows_digest = follows.fence() if follows is not None else ["*", ""]
    return {
        "legacy_l1_prefix": legacy_l1,
        "legacy_l2_prefix": legacy_l2,
        "gen": gen,
        "owner": owner,
        "rank": int(rank),
        "seq": int(seq),
        "reset": "1" if reset else "0",
        "gap": "1" if gap else "0",
        "follows_seq": follows_seq,
        "follows_digest": follows_digest,
        "digest": digest,
    }


def _named(names: tuple[str, ...], reply: Sequence[Any]) -> dict[str, Any]:
    """A script's reply (a Lua table) by the field names written next to the script."""
    return dict(zip(names, reply, strict=True))


class Store:
    """Redis access for one process. Create one per client; scripts load lazily."""

    def __init__(self, client: Client) -> None:
        self.r = client
        self._upsert = client.register_script(store_lua.UPSERT_INSTANCE)
        self._remove = client.register_script(store_lua.REMOVE_INSTANCE)
        self._apply = client.register_script(store_lua.APPLY_BATCH)
        self._upgrade = client.register_script(store_lua.UPGRADE_LAYOUT)
        self._layout_checked: set[str] = set()  # instances UPGRADE_LAYOUT found current
        self._replace_l3 = client.register_script(store_lua.REPLACE_L3)
        self._touch_l3 = client.register_script(store_lua.TOUCH_L3)
        self._l1_status = client.register_script(store_lua.L1_STATUS)
        self._claim = client.register_script(store_lua.CLAIM_LEASE)
        self._release = client.register_script(store_lua.RELEASE_LEASE)
        self._heartbeat = client.register_script(store_lua.HEARTBEAT)

    # -- registry (discovery) -------------------------------------------------------

    def upsert_instance(self, inst: Instance) -> tuple[RegistryChange, int]:
        """Register or refresh an instance. Returns (what happened, generation). Idempotent."""
        argv = [*_rank_prefixes(inst.ip), inst.uid, inst.restarts, *inst.meta_fields()]
        # Index first, then the instance: a failure in between leaves an indexed IP that the
        # next reconcile upserts or removes, never instance data that nothing lists.
        self.r.sadd(keys.INSTANCES, inst.ip)
        reply = _named(
            store_lua.UPSERT_INSTANCE_REPLY, self._upsert(keys=_instance_keys(inst.ip), args=argv)
        )
        return RegistryChange(text(reply["change"])), int(reply["gen"])

    def remove_instance(self, ip: str) -> bool:
        """Forget an instance and drop its L1/L2/L3 data (O(its own keys)); bumps its gen."""
        existed = bool(self._remove(keys=_instance_keys(ip), args=_rank_prefixes(ip)))
        self.r.srem(keys.INSTANCES, ip)  # only once the data is gone (see upsert_instance)
        return existed

    def instance_ips(self) -> set[str]:
        return {text(m) for m in self.r.smembers(keys.INSTANCES)}

    def list_instances(self) -> list[Instance]:
        ips = sorted(self.instance_ips())
        pipe = self.r.pipeline(transaction=False)
        for ip in ips:
            pipe.hgetall(keys.instance_meta(ip))
        return [Instance.from_meta(ip, text_dict(m)) for ip, m in zip(ips, pipe.execute()) if m]

    def set_masters(self, masters: dict[str, str]) -> None:
        """Replace the Mooncake master registry: URL → JSON description."""
        pipe = self.r.pipeline(transaction=True)
        pipe.delete(keys.MASTERS)
        if masters:
            pipe.hset(keys.MASTERS, mapping=dict(masters))  # type: ignore[arg-type]
        pipe.execute()

    def list_masters(self) -> dict[str, str]:
        return text_dict(self.r.hgetall(keys.MASTERS))

    def set_master_state(self, url: str, state: dict[str, str]) -> None:
        """Write a master's poll status (``keys.master_state``; the L3 poller, every poll)."""
        self.r.hset(keys.master_state(url), mapping=dict(state))  # type: ignore[arg-type]

    def drop_master_state(self, url: str) -> None:
        self.r.delete(keys.master_state(url))

    # -- leases -----------------------------------------------------------------------

    def _claim_lease(self, key: str, holder: str, ttl_ms: int) -> bool:
        """Take or renew a lease key; False while another holder has it."""
        return bool(self._claim(keys=[key], args=[holder, int(ttl_ms)]))

    def _release_lease(self, key: str, holder: str) -> bool:
        return bool(self._release(keys=[key], args=[holder]))

    def claim_discovery_lease(self, holder: str, ttl_ms: int) -> bool:
        return self._claim_lease(keys.lease("discovery"), holder, ttl_ms)

    def release_discovery_lease(self, holder: str) -> bool:
        return self._release_lease(keys.lease("discovery"), holder)

    def claim_instance(self, ip: str, holder: str, ttl_ms: int) -> bool:
        """Become (or stay) the one L1 ingester allowed to write ``ip``."""
        return self._claim_lease(keys.l1_owner(ip), holder, ttl_ms)

    def release_instance(self, ip: str, holder: str) -> bool:
        return self._release_lease(keys.l1_owner(ip), holder)

    def heartbeat_ingester(self, ingester_id: str, ttl_ms: int) -> list[str]:
        """Record this ingester as alive; return the ids of all live ingesters, sorted."""
        live = self._heartbeat(keys=[keys.INGESTERS], args=[ingester_id, int(ttl_ms)])
        return sorted(text(m) for m in live)

    def leave_ingesters(self, ingester_id: str) -> None:
        self.r.zrem(keys.INGESTERS, ingester_id)

    # -- L1 / L2 (event-fed tiers) ----------------------------------------------------

    def apply_batch(
        self,
        ip: str,
        gen: int,
        rank: int,
        seq: int,
        ops: TierOps,
        *,
        owner: str = "",
        reset: bool = False,
        gap: bool = False,
        follows: StoredCursor | None = None,
        digest: str = "",
    ) -> ApplyResult:
        """Apply one batch atomically, fenced by generation (and owner when given).

        The batch's sequence (and ``digest``, its payload's) is recorded in the same script;
        a sequence not above the last applied one is a duplicate and changes nothing (unless
        ``reset``). With ``follows``, the write is also fenced by the rank's cursor: refused
        (``CURSOR_MOVED``) unless the stored one is exactly ``follows`` (not checked on a reset).

        The instance's layout is checked (``UPGRADE_LAYOUT``) before this Store's first write
        of it and again after any refused write: an index of an older layout is reset and the
        answer is ``STALE_GEN``, with its ``reset_reason``.
        """
        if ip not in self._layout_checked:
            if int(self._upgrade(keys=_instance_keys(ip), args=_rank_prefixes(ip))):
                return ApplyResult(BatchStatus.STALE_GEN)
            self._layout_checked.add(ip)
        fixed = _batch_argv(ip, gen, owner, rank, seq, reset, gap, follows, digest)
        argv = [fixed[name] for name in store_lua.APPLY_BATCH_ARGV] + ops.argv()
        reply = _named(store_lua.APPLY_BATCH_REPLY, self._apply(keys=_instance_keys(ip), args=argv))
        counts = {name: int(value) for name, value in reply.items()}
        result = ApplyResult(BATCH_STATUS_CODES[counts.pop("status")], **counts)
        if result.status not in (BatchStatus.APPLIED, BatchStatus.DUPLICATE):
            self._layout_checked.discard(ip)  # refused: whoever wrote since is checked again
        return result

    def write_l1_status(self, updates: Sequence[L1Status]) -> list[bool]:
        """Write the ingester's status of several instances in one pipeline, each fenced by
        generation and owner like :meth:`apply_batch`; False where it was refused. A Redis
        Cluster refuses scripts in pipelines (redis-py): there, one call per instance."""
        cluster = not isinstance(self.r, redis.Redis)
        pipe: Any = None if cluster else self.r.pipeline(transaction=False)
        done: list[Any] = []
        for u in updates:
            argv: list[Any] = [u.gen, u.owner, len(u.fields)]
            for pairs in (u.fields, u.incr):
                for k, v in pairs.items():
                    argv += [k, v]
            done.append(self._l1_status(keys=_instance_keys(u.ip), args=argv, client=pipe))
        replies = done if cluster else (pipe.execute() if updates else [])
        return [bool(int(r)) for r in replies]

    def cursor(self, ip: str, rank: int) -> StoredCursor:
        """The rank's stored cursor (one HMGET)."""
        return self.cursors([(ip, rank)])[0]

    def cursors(self, ranks: Sequence[tuple[str, int]]) -> list[StoredCursor]:
        """The stored cursors of several (ip, rank) in one pipelined round trip (the
        ingester's periodic check that no failover took its writes back)."""
        if not ranks:
            return []
        pipe = self.r.pipeline(transaction=False)
        for ip, rank in ranks:
            pipe.hmget(keys.l1_state(ip), [f"seq:{int(rank)}", f"dig:{int(rank)}"])
        out = []
        for seq, digest in pipe.execute():
            out.append(
                StoredCursor(
                    None if seq is None else int(seq), "" if digest is None else text(digest)
                )
            )
        return out

    # -- L3 ---------------------------------------------------------------------------

    def replace_l3(
        self,
        ip: str,
        hashes: Iterable[int] | Mapping[int, Iterable[int]],
        state: dict[str, str] | None = None,
        gen: int | None = None,
    ) -> bool:
        """Atomically replace the instance's L3 sets. ``hashes`` is group 0's blocks, or a
        mapping KV-cache group → its blocks (groups not in it are deleted; the l3 state's
        ``groups`` lists those written). False, and nothing written, if the instance is not
        registered or (with ``gen``) is no longer that generation: data computed for a pod
        never lands on the new pod that took over its IP."""
        by_group = dict(hashes) if isinstance(hashes, Mapping) else {0: hashes}
        if not by_group:
            by_group = {0: ()}
        pipe = self.r.pipeline(transaction=False)
        for group in sorted(by_group):
            staging = keys.l3_group_staging(ip, group)
            pipe.delete(staging)
            chunk: list[int] = []
            for h in by_group[group]:
                chunk.append(h)
                if len(chunk) >= L3_CHUNK:
                    pipe.sadd(staging, *chunk)
                    chunk = []
            if chunk:
                pipe.sadd(staging, *chunk)
        pipe.execute()
        argv: list[Any] = [
            "" if gen is None else int(gen),
            ",".join(str(int(g)) for g in sorted(by_group)),
        ]
        for k, v in (state or {}).items():
            argv += [k, v]
        return bool(self._replace_l3(keys=_instance_keys(ip), args=argv))

    def touch_l3_state(self, ip: str, state: dict[str, str], gen: int, written: str = "") -> bool:
        """Update the state hash of an unchanged L3 set; False if ``gen`` is not current or,
        with ``written`` (the ``written`` field the caller's last :meth:`replace_l3` put in
        the state hash), if the stored set is not that one any more: a write Redis lost, e.g.
        acknowledged by a master that died before its replica had it."""
        argv: list[Any] = [int(gen), written]
        for k, v in state.items():
            argv += [k, v]
        if not state and not written:
            return False
        return bool(self._touch_l3(keys=_instance_keys(ip), args=argv))

    # -- API hot path -----------------------------------------------------------------

    def execute(self, reads: Reads) -> list[Any]:
        """Every queued read in one pipelined round trip (:func:`common.store_reads.execute`)."""
        return execute(self.r, reads)
