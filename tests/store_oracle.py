"""The reads of the store that only tests and benchmarks make: test oracles, kept out of
``common/store.py``, whose public methods are the ones a process calls (each service types
against the narrow role it uses, e.g. ``services.l1_ingest.stream.BatchWriter``).

:class:`OracleStore` is a :class:`common.store.Store` with these reads added; the fixtures
(``tests/conftest.py``) and the tests that build a store themselves use it.
"""

from __future__ import annotations

from collections.abc import Sequence

from common import keys
from common.redis_client import text, text_dict
from common.store import Instance, Store
from common.store_reads import Reads


class OracleStore(Store):
    """A Store that can also be asked what it holds."""

    def get_instance(self, ip: str) -> Instance | None:
        meta = self.r.hgetall(keys.instance_meta(ip))
        return Instance.from_meta(ip, text_dict(meta)) if meta else None

    def get_master_state(self, url: str) -> dict[str, str]:
        return text_dict(self.r.hgetall(keys.master_state(url)))

    def l1_state(self, ip: str) -> dict[str, str]:
        return text_dict(self.r.hgetall(keys.l1_state(ip)))

    def last_seq(self, ip: str, rank: int) -> int | None:
        """The rank's last applied sequence (``seq:<rank>`` of the l1 state hash)."""
        value = self.r.hget(keys.l1_state(ip), f"seq:{int(rank)}")
        return None if value is None else int(value)

    def groups(self, ip: str) -> dict[str, str]:
        """The instance's group descriptors and hash-unit settings (``keys.l1_groups``)."""
        return text_dict(self.r.hgetall(keys.l1_groups(ip)))

    def tier_members(self, ip: str, tier: str = "l1", group: int = 0) -> set[int]:
        return {int(m) for m in self.r.smembers(keys.tier_group_set(ip, tier, group))}

    def tier_counts(self, ip: str, tier: str = "l1", group: int = 0) -> dict[int, int]:
        """hash → copies over all DP ranks (a member without a copies field has one)."""
        return {h: sum(c) for h, c in self.tier_rank_copies(ip, tier, group).items()}

    def tier_rank_copies(self, ip: str, tier: str = "l1", group: int = 0) -> dict[int, list[int]]:
        """hash → copies per DP rank from rank 0 on (trailing zeros trimmed)."""
        pipe = self.r.pipeline(transaction=True)  # one slot: a consistent snapshot
        pipe.smembers(keys.tier_group_set(ip, tier, group))
        pipe.hgetall(keys.tier_group_copies(ip, tier, group))
        members, copies = pipe.execute()
        extra = {int(k): [int(c) for c in text(v).split(",")] for k, v in copies.items()}
        return {int(m): extra.get(int(m), [1]) for m in members}

    def l3_members(self, ip: str, group: int = 0) -> set[int]:
        return {int(m) for m in self.r.smembers(keys.l3_group_set(ip, group))}

    def l3_state(self, ip: str) -> dict[str, str]:
        return text_dict(self.r.hgetall(keys.l3_state(ip)))

    def prefix_lengths(self, ips: Sequence[str], members: Sequence[bytes]) -> list[tuple[int, int]]:
        """For each ip, the longest run from block 0 of ``members`` held in L1 and in L3
        (group 0): the single-group hit of the contract, in one pipelined round trip
        (SMISMEMBER on both tiers of every distinct candidate) through :meth:`Store.execute`,
        as the API reads. The API itself scores with ``services.api.scoring``."""
        if not members:
            return [(0, 0)] * len(ips)
        distinct = list(dict.fromkeys(ips))
        reads = Reads()
        blob = reads.members(members)
        for ip in distinct:
            reads.smismember(keys.tier_set(ip, "l1"), blob)
            reads.smismember(keys.l3_set(ip), blob)
        replies = self.execute(reads)
        by_ip = {
            ip: (_run_length(replies[2 * i]), _run_length(replies[2 * i + 1]))
            for i, ip in enumerate(distinct)
        }
        return [by_ip[ip] for ip in ips]


def _run_length(flags: list[int]) -> int:
    try:
        return flags.index(0)
    except ValueError:
        return len(flags)
