"""Every Redis key this project uses, and the only module allowed to spell one.

All keys of one instance share the hash tag ``{<ip>}`` so that they live in one Redis
Cluster slot and the Lua scripts of :mod:`common.store_lua` can touch them atomically; no
script touches a global key (``ci:instances``, ``ci:masters``, ``ci:ingesters``,
``ci:lease:*``) together with an instance's. The instance is named by its pod IP because
that is what callers send as ``server_ip`` (no lookup). Why a reused IP never shows the old
pod's blocks (the generation fence) and the other decisions: docs/design.md "Redis schema".
Where a row's fields are listed elsewhere, the row names that one source.

Block hashes are stored as ASCII decimal of vLLM's 64-bit event integer
(``int.from_bytes(digest[-8:], "big")``), e.g. ``11738959596286628545``.

| key                          | type   | writer            | readers                  | lifetime |
|------------------------------|--------|-------------------|--------------------------|----------|
| ci:instances                 | SET    | discovery         | ingesters, poller, API   | members = registered pod IPs |
| ci:{ip}:inst                 | HASH   | discovery         | ingesters, poller, tools | while registered: uid, restarts, gen and ``common.store.Instance``'s meta fields |
| ci:{ip}:gen                  | STRING | discovery         | store scripts            | forever: generation counter, survives drops so it never repeats |
| ci:{ip}:l1                   | SET    | L1 ingester       | API (SMISMEMBER)         | GPU block hashes with ≥1 copy on any DP rank |
| ci:{ip}:l1:copies            | HASH   | L1 ingester       | tools                    | sparse per-rank copy counts (encoding: :mod:`common.store_lua`, "Copies") |
| ci:{ip}:l2 (…:copies)        | as l1  | L1 ingester       | tools                    | same, for non-GPU media in the event stream (CPU / STORAGE offload) |
| ci:{ip}:l1:g<g> (…:copies)   | as l1  | L1 ingester       | API (SMISMEMBER)         | KV-cache group g ≥ 1 of a hybrid model (group 0 is ci:{ip}:l1); same for l2 |
| ci:{ip}:l1:groups            | HASH   | L1 ingester       | API, tools               | per generation: each group's descriptor, the ingester's settings and the engine's lookahead L (format: :mod:`common.group_view`); exists whenever an l1/l2 set does |
| ci:{ip}:l1:cnt, …:l1:r<rank> | HASH   | (legacy layout)   | –                        | before the copies hash; found by the scripts, dropped, instance re-synced |
| ci:{ip}:l1:state             | HASH   | L1 ingester       | L1 ingester, API, tools  | the ranks' cursors (``common.store.StoredCursor``), gap counts and the store's reset reason (:mod:`common.store_lua`); the ingester's status (fields: ``services/l1_ingest/status.py``) |
| ci:{ip}:l1:owner             | STRING | L1 ingester       | store scripts, API       | lease (PX): id of the ingester that may write this instance |
| ci:{ip}:l3                   | SET    | L3 poller         | API (SMISMEMBER)         | block hashes held in Mooncake, replaced whole per poll |
| ci:{ip}:l3:new               | SET    | L3 poller         | –                        | staging for the next ``ci:{ip}:l3``; renamed over it |
| ci:{ip}:l3:g<g> (…:new)      | SET    | L3 poller         | API (SMISMEMBER)         | KV-cache group g ≥ 1 in Mooncake (and its staging); the groups present are the l3 state's ``groups`` |
| ci:{ip}:l3:state             | HASH   | L3 poller         | API, tools               | fields: ``services/l3_poller/writer.py``'s docstring; the store adds ``groups`` (ids of the group sets, "0,1") |
| ci:masters                   | HASH   | discovery         | L3 poller, API           | master URL → JSON (pod, ip, rpc) |
| ci:master:{<url>}:state      | HASH   | L3 poller         | API, tools               | per master: ``services/l3_poller/status.py`` ``STATE_FIELDS`` |
| ci:lease:<name>              | STRING | discovery         | discovery                | lease (PX) so one discovery process writes at a time |
| ci:ingesters                 | ZSET   | L1 ingesters      | L1 ingesters, API        | live ingester id → heartbeat expiry (ms since epoch) |
| ci:audit:{<rid>}             | STRING | API               | API                      | ``audit.ttl``: the answer given to hit-rate request id rid, JSON (``services/api/audit_record.py``) |
| ci:audit:{<rid>}:r           | HASH   | API               | API                      | ``audit.ttl`` from the first report: ``r:<ip>`` = the outcome reported for ip |
| ci:audit:prefix:{<fp>}       | ZSET   | API               | API                      | 2 × ``audit.raceWindow`` (renewed), last 64 members: request ids asked about prompts whose block 0 is fp → time asked (ms) |
| ci:audit:prefix:{<fp>}:done  | ZSET   | API               | API                      | as the above: those request ids → time their first outcome was reported (ms) |
| ci:{ip}:audit                | HASH   | API               | API, tools               | 1 day after the last report: the instance's outcome tallies (``services/api/audit_outcome.py``) |
| ci:{ip}:audit:reports        | ZSET   | API               | API                      | as the above, last 64 members: request ids reported on the instance → time reported (ms) |
| ci:audit:worst               | ZSET   | API               | API, tools               | forever, ``audit.worstInstances`` members: ip → unexplained discrepancies |
| ci:audit:recent              | LIST   | API               | API, tools               | forever, ``audit.recent`` entries: the latest discrepancies as JSON |
| ci:audit:totals              | HASH   | API               | API, tools               | forever: outcome counts by verdict and explanation, over all replicas |
"""

from __future__ import annotations

from common.tiers import EventTier

PREFIX = "ci"

INSTANCES = f"{PREFIX}:instances"
MASTERS = f"{PREFIX}:masters"
INGESTERS = f"{PREFIX}:ingesters"


def _tag(ip: str) -> str:
    return f"{PREFIX}:{{{ip}}}"


def instance_meta(ip: str) -> str:
    return f"{_tag(ip)}:inst"


def instance_gen(ip: str) -> str:
    return f"{_tag(ip)}:gen"


def tier_set(ip: str, tier: EventTier = "l1") -> str:
    return f"{_tag(ip)}:{tier}"


def tier_copies(ip: str, tier: EventTier = "l1") -> str:
    """Sparse copy counts: only hashes held other than as exactly one copy on rank 0."""
    return f"{_tag(ip)}:{tier}:copies"


GROUP_SUFFIX = ":g"
"""What follows a tier's set key for group g >= 1 (``ci:{ip}:l1:g2``); the Lua scripts of
:mod:`common.store_lua` append it to the group-0 key they get in KEYS (checked by a test)."""


def tier_group_set(ip: str, tier: EventTier, group: int) -> str:
    """The set of KV-cache group ``group`` of an event-fed tier (group 0 = :func:`tier_set`)."""
    base = tier_set(ip, tier)
    return base if group == 0 else f"{base}{GROUP_SUFFIX}{int(group)}"


def tier_group_copies(ip: str, tier: EventTier, group: int) -> str:
    """Copies of KV-cache group ``group`` (group 0 = :func:`tier_copies`)."""
    if group == 0:
        return tier_copies(ip, tier)
    return f"{tier_group_set(ip, tier, group)}:copies"


def l1_groups(ip: str) -> str:
    """Descriptors of the instance's KV-cache groups (kind, block size, window) and its hash
    unit settings, learned from the events; shared by tiers l1, l2 and l3."""
    return f"{_tag(ip)}:l1:groups"


def tier_counts(ip: str, tier: EventTier = "l1") -> str:
    """Legacy layout (copies over all ranks); only dropped now."""
    return f"{_tag(ip)}:{tier}:cnt"


def tier_rank_counts(ip: str, rank: int, tier: EventTier = "l1") -> str:
    """Legacy layout (copies on one rank); only dropped now."""
    return f"{_tag(ip)}:{tier}:r{int(rank)}"


def l1_state(ip: str) -> str:
    return f"{_tag(ip)}:l1:state"


def l1_owner(ip: str) -> str:
    return f"{_tag(ip)}:l1:owner"


def l3_set(ip: str) -> str:
    return f"{_tag(ip)}:l3"


def l3_staging(ip: str) -> str:
    return f"{_tag(ip)}:l3:new"


def l3_group_set(ip: str, group: int) -> str:
    """Mooncake blocks of KV-cache group ``group`` (group 0 = :func:`l3_set`)."""
    return l3_set(ip) if group == 0 else f"{l3_set(ip)}{GROUP_SUFFIX}{int(group)}"


def l3_group_staging(ip: str, group: int) -> str:
    return l3_staging(ip) if group == 0 else f"{l3_group_set(ip, group)}:new"


def l3_state(ip: str) -> str:
    return f"{_tag(ip)}:l3:state"


def master_state(url: str) -> str:
    """Per-master poll status (what the L3 poller saw in the master's key listing)."""
    return f"{PREFIX}:master:{{{url}}}:state"


def lease(name: str) -> str:
    return f"{PREFIX}:lease:{name}"


def audit_question(request_id: str) -> str:
    """What the API answered to hit-rate request ``request_id``, and its outcome reports."""
    return f"{PREFIX}:audit:{{{request_id}}}"


def audit_reports(request_id: str) -> str:
    """The outcomes reported for :func:`audit_question` (same slot)."""
    return f"{audit_question(request_id)}:r"


def audit_prefix(first_block: str) -> str:
    """Recent questions whose prompt's block 0 has member key ``first_block`` (race check)."""
    return f"{PREFIX}:audit:prefix:{{{first_block}}}"


def audit_prefix_done(first_block: str) -> str:
    """When the questions of :func:`audit_prefix` were first reported on (same slot)."""
    return f"{audit_prefix(first_block)}:done"


def audit_instance(ip: str) -> str:
    """One instance's outcome tallies."""
    return f"{_tag(ip)}:audit"


def audit_instance_reports(ip: str) -> str:
    """The latest outcome reports on one instance, by time (the concurrent-traffic check)."""
    return f"{_tag(ip)}:audit:reports"


AUDIT_WORST = f"{PREFIX}:audit:worst"
AUDIT_RECENT = f"{PREFIX}:audit:recent"
AUDIT_TOTALS = f"{PREFIX}:audit:totals"
