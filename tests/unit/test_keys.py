"""common/keys.py is the only module that spells a Redis key."""

from __future__ import annotations

import re
from pathlib import Path

from common import keys

ROOT = Path(__file__).resolve().parents[2]
# A quoted string starting with the key prefix, e.g. "ci:instances" or f"ci:{ip}".
SPELLED = re.compile(r"""["'](?:ci:|ci\{)""")


def test_no_module_but_keys_spells_a_key() -> None:
    offenders = []
    for path in [*ROOT.joinpath("common").rglob("*.py"), *ROOT.joinpath("services").rglob("*.py")]:
        if path.name == "keys.py" and path.parent.name == "common":
            continue
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if SPELLED.search(line) or f'"{keys.PREFIX}:' in line:
                offenders.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not offenders, "Redis keys spelled outside common/keys.py:\n" + "\n".join(offenders)


def test_instance_keys_share_one_cluster_slot() -> None:
    ip = "10.1.2.3"
    names = [
        keys.instance_meta(ip),
        keys.instance_gen(ip),
        keys.tier_set(ip, "l1"),
        keys.tier_counts(ip, "l2"),
        keys.tier_rank_counts(ip, 3),
        keys.l1_state(ip),
        keys.l1_owner(ip),
        keys.l3_set(ip),
        keys.l3_staging(ip),
        keys.l3_state(ip),
    ]
    tags = {re.search(r"\{([^}]*)\}", n).group(1) for n in names}  # type: ignore[union-attr]
    assert tags == {ip}
    assert len(set(names)) == len(names)


def test_ipv6_instance_keys_are_distinct_and_tagged() -> None:
    assert keys.tier_set("fd00::1") == "ci:{fd00::1}:l1"
    assert keys.tier_set("fd00::1") != keys.tier_set("fd00::2")
