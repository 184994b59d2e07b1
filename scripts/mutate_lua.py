"""Hand-made mutants of the store's Lua scripts (common/store_lua.py), for docs/testing.md.

mutmut mutates Python only; the scripts that fence generations and count copies are Lua
strings. This applies each mutant below, one at a time, to a throwaway copy of the
repository, runs the store tests against it, and prints whether the tests killed it::

    python scripts/mutate_lua.py [pytest paths; default the store test files and test_l3_writer.py]
    ONLY='CLAIM: renewal does not extend' python scripts/mutate_lua.py

The working tree is never modified. Exit status 1 if a mutant not marked equivalent survived.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EQUIVALENT: set[str] = {
    # The reset moved the generation on, so the batch script that then runs refuses the
    # write as stale_gen all the same: the 1 only saves that round trip.
    "UPGRADE: a reset answered as a current layout",
}

M: list[tuple[str, str, str]] = [  # name, original text, mutated text
    (
        "APPLY: generation checked only without an owner",
        "if redis.call('HGET', K.meta, 'gen') ~= ARGV[3] then return {-1, 0} end",
        "if ARGV[4] == '' and redis.call('HGET', K.meta, 'gen') ~= ARGV[3] then return {-1, 0} end",
    ),
    (
        "APPLY: owner never checked",
        "if ARGV[4] ~= '' and redis.call('GET', K.l1_owner) ~= ARGV[4] then return {-2, 0} end",
        "if false and redis.call('GET', K.l1_owner) ~= ARGV[4] then return {-2, 0} end",
    ),
    (
        "clear_rank takes one copy, not all of the rank's",
        "      t[ri] = 0\n      if ri > 1",
        "      t[ri] = t[ri] - 1\n      if ri > 1",
    ),
    (
        "clear_rank of rank 0 keeps the set",
        "    redis.call('UNLINK', set)\n    for i = 1, #keep",
        "    for i = 1, #keep",
    ),
    (
        "clear_rank of rank 0 puts back a hash with no copy left",
        "      if v == '' then\n        redis.call('HDEL', x, h)\n      else",
        "      if false then\n      else",
    ),
    (
        "APPLY: equal sequence applied again (< instead of <=)",
        "if last and seq <= tonumber(last) then",
        "if last and seq < tonumber(last) then",
    ),
    (
        "APPLY: reset keeps the old sequence",
        "  redis.call('HDEL', K.l1_state, seqf, digf)\nend",
        "  redis.call('HDEL', K.l1_state, digf)\nend",
    ),
    (
        "APPLY: cursor fence ignores the sequence",
        "if (cur[1] or '-1') ~= ARGV[9] or",
        "if false or",
    ),
    (
        "APPLY: cursor fence ignores the digest",
        "or (cur[2] or '') ~= ARGV[10] then return {-4,",
        "or false then return {-4,",
    ),
    (
        "APPLY: cursor fence never checked",
        "if ARGV[7] ~= '1' and ARGV[9] ~= '*' then",
        "if false then",
    ),
    (
        "APPLY: cursor fence also checked on a reset",
        "if ARGV[7] ~= '1' and ARGV[9] ~= '*' then",
        "if ARGV[9] ~= '*' then",
    ),
    (
        "APPLY: a missing cursor is not the same as -1",
        "if (cur[1] or '-1') ~= ARGV[9]",
        "if (cur[1] or '') ~= ARGV[9]",
    ),
    (
        "APPLY: digest not recorded",
        "if ARGV[11] ~= '' then redis.call('HSET', K.l1_state, digf, ARGV[11])",
        "if false then redis.call('HSET', K.l1_state, digf, ARGV[11])",
    ),
    (
        "APPLY: an empty digest keeps the previous one",
        "else redis.call('HDEL', K.l1_state, digf) end",
        "end",
    ),
    (
        "APPLY: reset does not clear L2",
        "  clear_rank('l1', rank)\n  clear_rank('l2', rank)\n",
        "  clear_rank('l1', rank)\n",
    ),
    (
        "APPLY: AllBlocksCleared clears tier l1 whatever the tier",
        "if op == 'C' then\n    clear_rank(tier, rank)",
        "if op == 'C' then\n    clear_rank('l1', rank)",
    ),
    (
        "APPLY: gap not counted",
        "if ARGV[8] == '1' then redis.call('HINCRBY', K.l1_state, 'gap:' .. rank, 1) end",
        "",
    ),
    (
        "APPLY: a first copy on rank > 0 recorded as on rank 0",
        "    if ri > 1 then\n      local t = {}",
        "    if false then\n      local t = {}",
    ),
    (
        "APPLY: a further copy not counted",
        "  t[ri] = t[ri] + 1\n",
        "  t[ri] = math.max(t[ri], 1)\n",
    ),
    (
        "APPLY: remove keeps a zero entry in the copies hash",
        "  if v == '' then\n    redis.call('HDEL', x, h)\n    redis.call('SREM', set, h)",
        "  if v == '' then\n    redis.call('HSET', x, h, '0')\n    redis.call('SREM', set, h)",
    ),
    (
        "APPLY: remove keeps a member with no copy left",
        "    redis.call('SREM', set, h)\n  elseif",
        "  elseif",
    ),
    (
        "APPLY: one copy on rank 0 kept in the copies hash (not sparse)",
        "  elseif v == '1' then",
        "  elseif false then",
    ),
    ("APPLY: remove of an unknown hash not counted", "then unknown = unknown + 1 end", "then end"),
    (
        "APPLY: sequence not recorded",
        "redis.call('HSET', K.l1_state, seqf, ARGV[6])\nif ARGV[11]",
        "if ARGV[11]",
    ),
    (
        "UPSERT: container restart keeps L1",
        "elseif redis.call('HGET', K.meta, 'restarts') ~= restarts then\n  drop_event_tiers()",
        "elseif redis.call('HGET', K.meta, 'restarts') ~= restarts then\n  local _ = 0",
    ),
    (
        "UPSERT: new pod keeps L3",
        "elseif cur_uid ~= uid then\n  drop_all()",
        "elseif cur_uid ~= uid then\n  drop_event_tiers()",
    ),
    (
        "UPSERT: new pod keeps the generation",
        "if result == 'unchanged' or result == 'updated' then",
        "if result ~= 'added' then",
    ),
    (
        "UPSERT: a changed field reported unchanged",
        "if redis.call('HGET', K.meta, ARGV[i]) ~= ARGV[i + 1] then result = 'updated' end",
        "",
    ),
    (
        "next_gen ignores the clock (repeats after data loss)",
        "local gen = math.max(tonumber(redis.call('GET', K.gen) or '0') + 1, now)",
        "local gen = tonumber(redis.call('GET', K.gen) or '0') + 1",
    ),
    (
        "next_gen ignores the last generation",
        "local gen = math.max(tonumber(redis.call('GET', K.gen) or '0') + 1, now)",
        "local gen = now",
    ),
    (
        "REMOVE: generation not bumped",
        "redis.call('DEL', K.meta)\nnext_gen()\nreturn existed",
        "redis.call('DEL', K.meta)\nreturn existed",
    ),
    (
        "drop_event_tiers keeps the per-rank hashes",
        "    redis.call('UNLINK', ARGV[1] .. r, ARGV[2] .. r)\n",
        "",
    ),
    (
        "drop_all keeps the owner lease",
        "  drop_l3()\n  redis.call('UNLINK', K.l1_owner)\nend",
        "  drop_l3()\nend",
    ),
    (
        "REPLACE_L3: generation not checked",
        "   or (ARGV[1] ~= '' and redis.call('HGET', K.meta, 'gen') ~= ARGV[1]) then",
        "   or false then",
    ),
    (
        "REPLACE_L3: unregistered instance written",
        "if redis.call('EXISTS', K.meta) == 0\n   or",
        "if false\n   or",
    ),
    (
        "REPLACE_L3: empty set keeps the old one",
        "  else\n    redis.call('UNLINK', set)\n  end",
        "  end",
    ),
    (
        "REPLACE_L3: a group absent from the new data is kept",
        "  if not keep[g] then redis.call('UNLINK', (l3_keys(g))) end\n",
        "",
    ),
    (
        "drop_all keeps the L3 group sets",
        "        redis.call('UNLINK', K.l3_set .. ':g' .. g, K.l3_set .. ':g' .. g .. ':new')\n",
        "",
    ),
    (
        "groups: every group written to group 0",
        "  if g == nil or g == '0' then return set, x end",
        "  if true then return set, x end",
    ),
    (
        "groups: AllBlocksCleared clears group 0 only",
        "  for _, g in ipairs(event_groups()) do clear_rank_group(tier, g, rank) end",
        "  clear_rank_group(tier, '0', rank)",
    ),
    (
        "groups: drop_event_tiers keeps the group sets",
        "      redis.call('UNLINK', s1, x1, s2, x2)\n",
        "",
    ),
    (
        "groups: a changed kind is not a conflict",
        "    if kind ~= '-' and ck ~= '-' and (kind ~= ck or w ~= cw) then",
        "    if false then",
    ),
    (
        "groups: a changed window is not a conflict",
        "(kind ~= ck or w ~= cw) then",
        "(kind ~= ck) then",
    ),
    (
        "UPGRADE: the layout without descriptors is trusted",
        "        or (redis.call('EXISTS', K.l1_groups) == 0\n"
        "            and redis.call('EXISTS', K.l1_set, K.l2_set) > 0)) then",
        "        or false) then",
    ),
    (
        "UPGRADE: the per-rank count hashes are trusted",
        "   and (redis.call('EXISTS', K.legacy_l1_counts, K.legacy_l2_counts) > 0\n",
        "   and (false\n",
    ),
    (
        "UPGRADE: an unregistered instance is reset (an instance hash made up)",
        "if redis.call('EXISTS', K.meta) == 1\n   and (",
        "if true\n   and (",
    ),
    (
        "UPGRADE: a reset answered as a current layout",
        "  reset_instance('the index was written in an older layout')\n  return 1\n",
        "  reset_instance('the index was written in an older layout')\n  return 0\n",
    ),
    (
        "groups: the last block size seen kept, not the largest",
        "    if b > cb then cb = b end",
        "    if b > 0 then cb = b end",
    ),
    (
        "groups: a store without descriptor leaves no field",
        "    learned[g] = redis.call('HGET', K.l1_groups, g) or '-,0,,0'",
        "    learned[g] = redis.call('HGET', K.l1_groups, g)",
    ),
    (
        "TOUCH_L3: generation not checked",
        "if redis.call('HGET', K.meta, 'gen') ~= ARGV[1] then return 0 end\nif ARGV[2] ~= '' and "
        "redis.call('HGET', K.l3_state",
        "if ARGV[2] ~= '' and redis.call('HGET', K.l3_state",
    ),
    (
        "TOUCH_L3: the written token not checked (a lost L3 write kept for REWRITE_AFTER)",
        "if ARGV[2] ~= '' and redis.call('HGET', K.l3_state, 'written') ~= ARGV[2] then return 0"
        " end\n",
        "",
    ),
    ("CLAIM: renewal does not extend", "  redis.call('PEXPIRE', KEYS[1], ARGV[2])\n", ""),
    (
        "CLAIM: another holder's lease taken",
        "if not cur then\n  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])\n  return 1\nend\nre"
        "turn 0",
        "redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])\nreturn 1",
    ),
    (
        "HEARTBEAT: expired ingesters not pruned",
        "redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', string.format('%d', now))\n",
        "",
    ),
    (
        "RELEASE: another holder's lease released",
        "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end",
        "return redis.call('DEL', KEYS[1])",
    ),
]


def run(tests: list[str]) -> int:
    only = set(filter(None, os.environ.get("ONLY", "").split("|")))
    bad = 0
    with tempfile.TemporaryDirectory(prefix="lua-mutants-") as tmp:
        copy = Path(tmp) / "repo"
        shutil.copytree(
            ROOT,
            copy,
            ignore=shutil.ignore_patterns(
                ".git", "mutants", "__pycache__", ".pytest_cache", ".local-stack"
            ),
        )
        target = copy / "common" / "store_lua.py"
        original = target.read_text()
        env = {**os.environ, "PYTHONPATH": str(copy)}
        for name, old, new in M:
            if only and name not in only:
                continue
            if original.count(old) != 1:
                print(f"{name}: STALE (the original text is not found once)")
                bad += 1
                continue
            target.write_text(original.replace(old, new))
            proc = subprocess.run(
                [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests],
                cwd=copy,
                env=env,
                capture_output=True,
                text=True,
                timeout=900,
                check=False,
            )
            target.write_text(original)
            killer = next((ln for ln in proc.stdout.splitlines() if ln.startswith("FAILED")), "")
            if proc.returncode != 0:
                print(f"{name}: killed ({killer[7:].split(' - ')[0]})", flush=True)
            else:
                equivalent = name in EQUIVALENT
                bad += not equivalent
                print(f"{name}: SURVIVED{' (equivalent)' if equivalent else ''}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(
        run(
            sys.argv[1:]
            or [
                "tests/unit/test_store.py",
                "tests/unit/test_store_copies.py",
                "tests/unit/test_store_groups.py",
                "tests/services/test_l3_writer.py",  # the TOUCH_L3 written-token fence
            ]
        )
    )
