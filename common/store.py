"""Every Redis read and write of cache-indexer, over an explicitly passed client.

The key layout is documented in :mod:`common.keys`. Writes that must be atomic (copy
counts together with set membership, generation / owner fencing, registry changes that
drop an instance's data) run as Lua scripts from :mod:`common.store_lua`, registered once
per :class:`Store`. Reads on the API's hot path are one non-transactional pipeline.
Each process types against the narrow role it uses (a ``Protocol`` in its service); the
reads only tests make are in ``tests/store_oracle.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import redis

from common import keys, store_lua
from common.redis_client import Client, text, text_dict

_WRITE_BYTES = 1 << 20
"""Bytes of packed commands built at a time for one pipelined read."""

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


class BatchStatus(StrEnum):
    """What the store did with one fenced batch write (its values are metric label values)."""

    APPLIED = "applied"
    DUPLICATE = "duplicate"
    """The sequence is not above the last applied one: nothing changed."""
    STALE_GEN = "stale_gen"
    """Refused: the instance is no longer the generation the writer follows."""
    NOT_OWNER = "not_owner"
    """Refused: another ingester holds the instance's lease."""
    GROUPS_CHANGED = "groups_changed"
    """Refused: a KV-cache group's kind or window changed; the store reset the instance (new
    generation, ``reset_reason`` in its state hash) and the ingester re-syncs it."""
    CURSOR_MOVED = "cursor_moved"
    """Refused: the rank's stored cursor is not the one the writer follows (:class:`StoredCursor`;
    what the ingester does then: ``services/l1_ingest/stream.py``)."""


class RegistryChange(StrEnum):
    """What :meth:`Store.upsert_instance` did (its values are metric label values)."""

    ADDED = "added"
    REPLACED = "replaced"
    """A new pod UID on this IP: the old pod's data was dropped."""
    RESTARTED = "restarted"
    """The container restarted: its L1 data was dropped."""
    UPDATED = "updated"
    UNCHANGED = "unchanged"


@dataclass
class ApplyResult:
    """What one fenced batch write did (the fields of ``store_lua.APPLY_BATCH_REPLY``)."""

    status: BatchStatus
    unknown_removes: int = 0


@dataclass(frozen=True)
class StoredCursor:
    """What the l1 state hash says was applied last on one rank: ``seq:<rank>`` (None = no
    field: nothing applied, or reset) and ``dig:<rank>``, the digest of that batch's payload
    (hex; ``""`` = none recorded): what :meth:`Store.apply_batch`'s ``follows`` names."""

    seq: int | None = None
    digest: str = ""

    def fence(self) -> list[str]:
        """The cursor as ``APPLY_BATCH`` compares it (no field is the same as ``-1``)."""
        seq = -1 if self.seq is None or self.seq < 0 else self.seq
        return [str(seq), self.digest if seq >= 0 else ""]

    def same(self, other: StoredCursor) -> bool:
        return self.fence() == other.fence()


Op = tuple[str, str, int, list[Any]]
"""One write of a batch: (op, tier, KV-cache group, values); see ``APPLY_BATCH``."""


@dataclass
class TierOps:
    """The writes of one ZMQ batch for one rank, in event order: (op, tier, group, values).

    ``describe`` records a group's descriptor as a ``BlockStored`` carries it, ``settings``
    the ingester's per-instance settings and ``lookahead`` the engine's lookahead L; the store
    checks and writes them before any hash.
    """

    ops: list[Op] = field(default_factory=list)

    def store(self, tier: str, hashes: Iterable[int], group: int = 0) -> None:
        self.ops.append(("S", tier, group, list(hashes)))

    def remove(self, tier: str, hashes: Iterable[int], group: int = 0) -> None:
        self.ops.append(("R", tier, group, list(hashes)))

    def clear(self, tier: str) -> None:
        self.ops.append(("C", tier, 0, []))

    def describe(self, group: int, kind: str | None, block_size: int, window: int | None) -> None:
        self.ops.append(
            ("D", "", group, [kind or "-", int(block_size), "" if window is None else int(window)])
        )

    def settings(self, hash_unit: int, chunk: int, dp_size: int) -> None:
        self.ops.append(("H", "", 0, [int(hash_unit), int(chunk), int(dp_size)]))

    def lookahead(self, tokens: int) -> None:
        """The instance's speculative-decoding lookahead L as its events show it (spec
        vllm-extra-keys.md §5); a different L than the one stored resets the instance."""
        self.ops.append(("A", "", 0, [int(tokens)]))

    def argv(self) -> list[str | int]:
        out: list[str | int] = []
        for op, tier, group, values in self.ops:
            out += [op, tier, group, len(values)]
            out += values
        return out


@dataclass
class L1Status:
    """One instance's status write: fields to set and counters to increment (l1 state hash)."""

    ip: str
    gen: int
    owner: str
    fields: dict[str, str]
    incr: dict[str, int] = field(default_factory=dict)


_STATUS = {
    1: BatchStatus.APPLIED,
    0: BatchStatus.DUPLICATE,
    -1: BatchStatus.STALE_GEN,
    -2: BatchStatus.NOT_OWNER,
    -3: BatchStatus.GROUPS_CHANGED,
    -4: BatchStatus.CURSOR_MOVED,
}


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
        argv = [
            *_rank_prefixes(ip),
            gen,
            owner,
            int(rank),
            int(seq),
            "1" if reset else "0",
            "1" if gap else "0",
            *(follows.fence() if follows is not None else ["*", ""]),
            digest,
            *ops.argv(),
        ]
        reply = _named(store_lua.APPLY_BATCH_REPLY, self._apply(keys=_instance_keys(ip), args=argv))
        counts = {name: int(value) for name, value in reply.items()}
        result = ApplyResult(_STATUS[counts.pop("status")], **counts)
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
        """Send every queued read in one pipelined round trip; replies in queue order
        (HGETALL as a ``dict[str, str]``, HGET as ``str | None``, SMISMEMBER as 0/1 ints).

        redis-py's pipeline costs tens of microseconds of Python per command, more than the
        whole request of a short prompt; so on a single server the commands are written as
        packed RESP in pieces of about 1 MiB, each SMISMEMBER's members encoded once per
        request (:meth:`Reads.members`), all before the first reply is read. One retry on a
        broken connection (a pooled socket gone stale across a Redis restart), as the
        client's own ``Retry`` would do. A cluster goes through its pipeline (routed by slot).
        """
        if not reads.cmds:
            return []
        if not isinstance(self.r, redis.Redis):
            return _normalise(reads, self._execute_cluster(reads))
        pool = self.r.connection_pool
        for attempt in (1, 2):
            conn: Any = pool.get_connection()  # redis-py leaves its methods untyped
            try:
                conn.send_packed_command(reads.payload())
                return _normalise(reads, [conn.read_response() for _ in reads.cmds])
            except (redis.ConnectionError, redis.TimeoutError):
                conn.disconnect()
                if attempt == 2:
                    raise
            except BaseException:
                conn.disconnect()  # unread replies must not reach the next user of the socket
                raise
            finally:
                pool.release(conn)
        raise AssertionError("unreachable")  # pragma: no cover

    def _execute_cluster(self, reads: Reads) -> list[Any]:
        pipe: Any = self.r.pipeline(transaction=False)
        for cmd in reads.cmds:
            if cmd[0] == _SMIS:
                pipe.smismember(cmd[1], list(reads.blobs[cmd[2]].members))
            elif cmd[0] == _HGETALL:
                pipe.hgetall(cmd[1])
            else:
                pipe.hget(cmd[1], cmd[2])
        return list(pipe.execute())


_SMIS, _HGETALL, _HGET = "SMISMEMBER", "HGETALL", "HGET"


def encode_members(members: Sequence[bytes]) -> bytes:
    """Members as the RESP bulk strings of a command's arguments."""
    return b"".join([b"$%d\r\n%b\r\n" % (len(m), m) for m in members])


@dataclass
class MemberBlob:
    """Members of SMISMEMBER commands, encoded once per request and shared by every set."""

    members: Sequence[bytes]
    encoded: bytes


@dataclass
class Reads:
    """Reads for one pipelined round trip (:meth:`Store.execute`), queued in order."""

    cmds: list[tuple[str, str, Any]] = field(default_factory=list)
    blobs: list[MemberBlob] = field(default_factory=list)

    def members(self, members: Sequence[bytes], encoded: bytes | None = None) -> int:
        """Register members for SMISMEMBER; returns the handle to pass to it. ``encoded``:
        the members as RESP bulk strings (:func:`encode_members`), when the caller has them."""
        if encoded is None:
            encoded = encode_members(members)
        self.blobs.append(MemberBlob(members, encoded))
        return len(self.blobs) - 1

    def smismember(self, key: str, blob: int) -> int:
        self.cmds.append((_SMIS, key, blob))
        return len(self.cmds) - 1

    def hgetall(self, key: str) -> int:
        self.cmds.append((_HGETALL, key, None))
        return len(self.cmds) - 1

    def hget(self, key: str, name: str) -> int:
        self.cmds.append((_HGET, key, name))
        return len(self.cmds) - 1

    def payload(self) -> Iterator[bytes]:
        """The commands as packed RESP, in pieces of about ``_WRITE_BYTES``."""
        out: list[bytes] = []
        size = 0
        for op, key, arg in self.cmds:
            k = key.encode()
            if op == _SMIS:
                blob = self.blobs[arg]
                piece = b"*%d\r\n$10\r\nSMISMEMBER\r\n$%d\r\n%b\r\n%b" % (
                    len(blob.members) + 2,
                    len(k),
                    k,
                    blob.encoded,
                )
            elif op == _HGETALL:
                piece = b"*2\r\n$7\r\nHGETALL\r\n$%d\r\n%b\r\n" % (len(k), k)
            else:
                f = arg.encode()
                piece = b"*3\r\n$4\r\nHGET\r\n$%d\r\n%b\r\n$%d\r\n%b\r\n" % (len(k), k, len(f), f)
            out.append(piece)
            size += len(piece)
            if size >= _WRITE_BYTES:
                yield b"".join(out)
                out, size = [], 0
        if out:
            yield b"".join(out)


def _normalise(reads: Reads, replies: list[Any]) -> list[Any]:
    """Raw (RESP2/RESP3) or callback-parsed replies to the forms :meth:`Store.execute` says."""
    for i, (op, _, _) in enumerate(reads.cmds):
        reply = replies[i]
        if op == _HGETALL:
            if isinstance(reply, list):
                reply = dict(zip(reply[::2], reply[1::2]))
            replies[i] = text_dict(reply or {})
        elif op == _HGET:
            replies[i] = None if reply is None else text(reply)
    return replies
