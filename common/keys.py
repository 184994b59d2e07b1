"""Every Redis key this project uses, and the only module allowed to spell one.

All keys of one instance share the hash tag ``{<ip>}`` so that they live in one Redis
Cluster slot and the Lua scripts in :mod:`common.store` can touch them atomically.
The instance is named by its pod IP because that is what callers send as ``server_ip``:
the API can then read an instance's sets without a lookup (one round trip per request).
A new pod on a reused IP never sees the old pod's blocks because discovery drops the
old data and bumps the instance generation before it registers the new pod, and every
ingester write is fenced by that generation.

Block hashes are stored as ASCII decimal of vLLM's 64-bit event integer
(``int.from_bytes(digest[-8:], "big")``), e.g. ``11738959596286628545``.

| key                          | type   | writer            | readers                  | lifetime |
|------------------------------|--------|-------------------|--------------------------|----------|
| ci:instances                 | SET    | discovery         | ingesters, poller, API   | members = registered pod IPs |
| ci:{ip}:inst                 | HASH   | discovery         | ingesters, poller, tools | while registered (uid, pod, gen, zmq, replay, dp, role, …) |
| ci:{ip}:gen                  | STRING | discovery         | store scripts            | forever: generation counter, survives drops so it never repeats |
| ci:{ip}:l1                   | SET    | L1 ingester       | API (SMISMEMBER)         | GPU block hashes with ≥1 copy on any DP rank |
| ci:{ip}:l1:cnt               | HASH   | L1 ingester       | tools                    | hash → copies over all ranks (vLLM stores a hash twice) |
| ci:{ip}:l1:r<rank>           | HASH   | L1 ingester       | L1 ingester              | hash → copies on one DP rank (for AllBlocksCleared of that rank) |
| ci:{ip}:l2 (…:cnt, …:r<n>)   | as l1  | L1 ingester       | tools                    | same, for non-GPU media in the event stream (CPU / STORAGE offload) |
| ci:{ip}:l1:state             | HASH   | L1 ingester       | L1 ingester, API, tools  | seq:<rank> last applied sequence; gap:<rank> unrecoverable gaps; ingester status: ingester, status_ms, subscribed_ms, last_event_ms, conn, conn_detail, replaying, hash_check, hash_check_ok, hash_check_mismatch, hash_check_detail |
| ci:{ip}:l1:owner             | STRING | L1 ingester       | store scripts, API       | lease (PX): id of the ingester that may write this instance |
| ci:{ip}:l3                   | SET    | L3 poller         | API (SMISMEMBER)         | block hashes held in Mooncake, replaced whole per poll |
| ci:{ip}:l3:new               | SET    | L3 poller         | –                        | staging for the next ``ci:{ip}:l3``; renamed over it |
| ci:{ip}:l3:state             | HASH   | L3 poller         | API, tools               | master, updated_ms, blocks, stale |
| ci:masters                   | HASH   | discovery         | L3 poller, API           | master URL → JSON (pod, ip, rpc) |
| ci:master:{<url>}:state      | HASH   | L3 poller         | API, tools               | per master: keys, keys_unparsed, sample_unparsed, blocks, updated_ms, stale, error |
| ci:lease:<name>              | STRING | discovery         | discovery                | lease (PX) so one discovery process writes at a time |
| ci:ingesters                 | ZSET   | L1 ingesters      | L1 ingesters, API        | live ingester id → heartbeat expiry (ms since epoch) |
"""

from __future__ import annotations

PREFIX = "ci"

INSTANCES = f"{PREFIX}:instances"
MASTERS = f"{PREFIX}:masters"
INGESTERS = f"{PREFIX}:ingesters"

TIERS = ("l1", "l2")
"""Event-fed tiers: ``l1`` = GPU medium, ``l2`` = other media (CPU, STORAGE)."""


def _tag(ip: str) -> str:
    return f"{PREFIX}:{{{ip}}}"


def instance_meta(ip: str) -> str:
    return f"{_tag(ip)}:inst"


def instance_gen(ip: str) -> str:
    return f"{_tag(ip)}:gen"


def tier_set(ip: str, tier: str = "l1") -> str:
    return f"{_tag(ip)}:{tier}"


def tier_counts(ip: str, tier: str = "l1") -> str:
    return f"{_tag(ip)}:{tier}:cnt"


def tier_rank_counts(ip: str, rank: int, tier: str = "l1") -> str:
    return f"{_tag(ip)}:{tier}:r{int(rank)}"


def l1_state(ip: str) -> str:
    return f"{_tag(ip)}:l1:state"


def l1_owner(ip: str) -> str:
    return f"{_tag(ip)}:l1:owner"


def l3_set(ip: str) -> str:
    return f"{_tag(ip)}:l3"


def l3_staging(ip: str) -> str:
    return f"{_tag(ip)}:l3:new"


def l3_state(ip: str) -> str:
    return f"{_tag(ip)}:l3:state"


def master_state(url: str) -> str:
    """Per-master poll status (what the L3 poller saw in the master's key listing)."""
    return f"{PREFIX}:master:{{{url}}}:state"


def lease(name: str) -> str:
    return f"{PREFIX}:lease:{name}"
