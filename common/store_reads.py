"""The API's hot-path reads: one pipelined round trip of SMISMEMBER/HGETALL/HGET.

Owned by the store (:meth:`common.store.Store.execute` calls :func:`execute`); the API queues
its reads in a :class:`Reads` (``services/api/read_plan.py``) and never writes RESP itself.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis

from common import keys
from common.redis_client import Client, text, text_dict
from common.tiers import Tier

_WRITE_BYTES = 1 << 20
"""Bytes of packed commands built at a time for one pipelined read."""


def execute(r: Client, reads: Reads) -> list[Any]:
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
    if not isinstance(r, redis.Redis):
        return _normalise(reads, _execute_cluster(r, reads))
    pool = r.connection_pool
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


def _execute_cluster(r: Client, reads: Reads) -> list[Any]:
    pipe: Any = r.pipeline(transaction=False)
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


def queue_descriptors(reads: Reads, ip: str) -> tuple[int, int]:
    """Queue the reads of an instance's KV-cache group descriptors (its ``l1:groups`` hash,
    its l3 state's ``groups`` field); their positions in the round trip's replies."""
    return reads.hgetall(keys.l1_groups(ip)), reads.hget(keys.l3_state(ip), "groups")


def queue_hash_check(reads: Reads, ip: str) -> int:
    """Queue the read of the instance's hash self-check verdict (its l1 state's field)."""
    return reads.hget(keys.l1_state(ip), "hash_check")


def group_sets(ip: str, tier: Tier, groups: Sequence[int]) -> list[str]:
    """The set keys of ``groups`` of an instance in tier ``l1`` (or else ``l3``) that the
    hit-rate read probes (group 0 is the tier's plain set)."""
    if tier == "l1":
        return [keys.tier_group_set(ip, "l1", g) for g in groups]
    return [keys.l3_group_set(ip, g) for g in groups]
