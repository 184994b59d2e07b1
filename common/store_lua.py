"""Lua sources of the store's atomic operations (loaded once per client by common.store).

Every instance script receives the same KEYS bundle, in the order of :data:`INSTANCE_KEYS`,
the one place that order is written: ``common.store._instance_keys`` builds the bundle from
it, and every script reads it through the table ``K`` that :data:`_KEYS` (generated from it)
binds, ``K.meta``, ``K.l1_state``, … (``tests/unit/test_store_lua_keys.py`` checks that no
instance script spells ``KEYS[n]`` and that every ``K.<name>`` is in the table). The
scripts that drop L1/L2 (UPSERT_INSTANCE, REMOVE_INSTANCE, UPGRADE_LAYOUT, APPLY_BATCH, through
``drop_event_tiers``) also receive, as ARGV[1] and ARGV[2], the prefixes of the *legacy*
per-rank count hashes of tiers l1 and l2 (``…:l1:r`` and ``…:l2:r``, layout before the
copies hash) so that they can remove them without this file spelling a key; the other
scripts' ARGV start at 1.

**KV-cache groups.** ``K.l1_set`` … ``K.l3_staging`` are group 0's. Group g >= 1 of a tier
lives in the group-0 key followed by ``:g<g>`` (its copies hash by ``:copies`` after that,
its L3 staging by ``:new``), the one rule :func:`common.keys.tier_group_set` also spells (a
test checks the two agree). The groups that exist are the numeric fields of ``K.l1_groups``
(l1/l2) and the l3 state's ``groups`` field (l3).

**Copies** (the encoding, written here only; ``encode`` and ``put`` below keep it): a hash
in a tier set that has no field in the tier's copies hash holds exactly one copy, on DP rank
0. Any other distribution is the copies hash's value: per-rank counts from rank 0 on,
comma-separated, trailing zeros trimmed (``"2"`` = two copies on rank 0, ``"0,1"`` = one on
rank 1, ``"1,0,3"``). Invariant: every field of the copies hash is a member of the set, and
no value is ``""`` or ``"1"``.
"""

from __future__ import annotations

INSTANCE_KEYS = (
    "meta",
    "gen",
    "l1_state",
    "l1_owner",
    "l1_set",
    "l1_copies",
    "l2_set",
    "l2_copies",
    "l3_set",
    "l3_staging",
    "l3_state",
    "legacy_l1_counts",
    "legacy_l2_counts",
    "l1_groups",
)
"""The KEYS bundle of every instance script, in order (the names are ``common.keys``')."""

_KEYS = (
    "local K = {"
    + ", ".join(f"{name} = KEYS[{i}]" for i, name in enumerate(INSTANCE_KEYS, 1))
    + "}\n"
)

_COMMON = (
    _KEYS
    + r"""
local function tier_keys(tier, g)
  local set, x = K.l1_set, K.l1_copies
  if tier == 'l2' then set, x = K.l2_set, K.l2_copies end
  if g == nil or g == '0' then return set, x end
  set = set .. ':g' .. g
  return set, set .. ':copies'
end

-- The KV-cache groups of the event-fed tiers: '0' and every numeric field of K.l1_groups.
local function event_groups()
  local gs = {'0'}
  for _, f in ipairs(redis.call('HKEYS', K.l1_groups)) do
    if string.match(f, '^%d+$') and f ~= '0' then gs[#gs + 1] = f end
  end
  return gs
end

local function decode(v)
  local t = {}
  for c in string.gmatch(v, '[^,]+') do t[#t + 1] = tonumber(c) end
  return t
end

local function encode(t)
  local n = #t
  while n > 0 and (t[n] or 0) == 0 do n = n - 1 end
  local parts = {}
  for i = 1, n do parts[i] = string.format('%d', t[i] or 0) end
  return table.concat(parts, ',')
end

-- Write the per-rank counts t of hash h (set membership and copies field together).
local function put(set, x, h, t)
  local v = encode(t)
  if v == '' then
    redis.call('HDEL', x, h)
    redis.call('SREM', set, h)
  elseif v == '1' then
    redis.call('HDEL', x, h)
  else
    redis.call('HSET', x, h, v)
  end
end

-- One stored copy of h on rank index ri (rank + 1). The common case is one SADD.
local function store_copy(set, x, h, ri)
  if redis.call('SADD', set, h) == 1 then
    if ri > 1 then
      local t = {}
      for k = 1, ri - 1 do t[k] = 0 end
      t[ri] = 1
      redis.call('HSET', x, h, encode(t))
    end
    return
  end
  local v = redis.call('HGET', x, h)
  local t = v and decode(v) or {1}
  for k = #t + 1, ri do t[k] = 0 end
  t[ri] = t[ri] + 1
  redis.call('HSET', x, h, encode(t))
end

-- One removed copy of h on rank index ri; false when that rank holds no copy of h.
local function remove_copy(set, x, h, ri)
  local v = redis.call('HGET', x, h)
  if v then
    local t = decode(v)
    if (t[ri] or 0) == 0 then return false end
    t[ri] = t[ri] - 1
    put(set, x, h, t)
    return true
  end
  return ri == 1 and redis.call('SREM', set, h) == 1
end

-- AllBlocksCleared of one rank in one group.
-- Rank 0: the set is dropped and the hashes with copies on other ranks are put back
-- (O(set) to free, O(copies hash) to rebuild). Other ranks: O(copies hash) only.
local function clear_rank_group(tier, g, rank)
  local set, x = tier_keys(tier, g)
  local ri = tonumber(rank) + 1
  local flat = redis.call('HGETALL', x)
  local keep = {}
  for i = 1, #flat, 2 do
    local h, t = flat[i], decode(flat[i + 1])
    if (t[ri] or 0) > 0 then
      t[ri] = 0
      if ri > 1 then put(set, x, h, t) end
    end
    if ri == 1 then
      local v = encode(t)
      if v == '' then
        redis.call('HDEL', x, h)
      else
        if v ~= flat[i + 1] then redis.call('HSET', x, h, v) end
        keep[#keep + 1] = h
      end
    end
  end
  if ri == 1 then
    redis.call('UNLINK', set)
    for i = 1, #keep, 1000 do
      redis.call('SADD', set, unpack(keep, i, math.min(i + 999, #keep)))
    end
  end
end

-- AllBlocksCleared of one rank: every group of the tier.
local function clear_rank(tier, rank)
  for _, g in ipairs(event_groups()) do clear_rank_group(tier, g, rank) end
end

local function known_ranks()
  local ranks = {}
  for _, field in ipairs(redis.call('HKEYS', K.l1_state)) do
    local r = string.match(field, '^seq:(%d+)$')
    if r then ranks[#ranks + 1] = r end
  end
  return ranks
end

local function drop_event_tiers()
  for _, r in ipairs(known_ranks()) do
    redis.call('UNLINK', ARGV[1] .. r, ARGV[2] .. r)
  end
  for _, g in ipairs(event_groups()) do
    if g ~= '0' then
      local s1, x1 = tier_keys('l1', g)
      local s2, x2 = tier_keys('l2', g)
      redis.call('UNLINK', s1, x1, s2, x2)
    end
  end
  redis.call('UNLINK', K.l1_state, K.l1_set, K.l1_copies, K.l2_set, K.l2_copies,
             K.legacy_l1_counts, K.legacy_l2_counts, K.l1_groups)
end

-- The L3 group sets (and stagings) named by the l3 state's 'groups', group 0 included.
local function drop_l3()
  local gs = redis.call('HGET', K.l3_state, 'groups')
  if gs then
    for g in string.gmatch(gs, '[^,]+') do
      if g ~= '0' then
        redis.call('UNLINK', K.l3_set .. ':g' .. g, K.l3_set .. ':g' .. g .. ':new')
      end
    end
  end
  redis.call('UNLINK', K.l3_set, K.l3_staging, K.l3_state)
end

-- A new generation: above the last one and never below the server's clock in ms, so a
-- Redis that lost its data (restart without persistence) still never repeats a generation
-- that a running ingester may hold.
local function next_gen()
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  local gen = math.max(tonumber(redis.call('GET', K.gen) or '0') + 1, now)
  gen = string.format('%d', gen)
  redis.call('SET', K.gen, gen)
  return gen
end

local function drop_all()
  drop_event_tiers()
  drop_l3()
  redis.call('UNLINK', K.l1_owner)
end

-- A reset the store decides itself (old layout, a group's descriptor changed): drop L1/L2,
-- move the generation on (the ingester's next write is refused, it reloads and re-syncs)
-- and say why in the new state hash.
local function reset_instance(why)
  drop_event_tiers()
  redis.call('HSET', K.meta, 'gen', next_gen())
  redis.call('HSET', K.l1_state, 'reset_reason', why)
end
"""
)

UPSERT_INSTANCE_REPLY = ("change", "gen")
"""The fields of UPSERT_INSTANCE's reply, in order (the change is a ``RegistryChange``)."""

UPSERT_INSTANCE = (
    _COMMON
    + r"""
-- ARGV[3] uid, ARGV[4] restart token, ARGV[5..] field, value pairs for the meta hash
local uid, restarts = ARGV[3], ARGV[4]
local cur_uid = redis.call('HGET', K.meta, 'uid')
local result
if not cur_uid then
  drop_all()
  result = 'added'
elseif cur_uid ~= uid then
  drop_all()
  redis.call('DEL', K.meta)
  result = 'replaced'
elseif redis.call('HGET', K.meta, 'restarts') ~= restarts then
  drop_event_tiers()
  result = 'restarted'
else
  result = 'unchanged'
  for i = 5, #ARGV, 2 do
    if redis.call('HGET', K.meta, ARGV[i]) ~= ARGV[i + 1] then result = 'updated' end
  end
end
local gen
if result == 'unchanged' or result == 'updated' then
  gen = redis.call('HGET', K.meta, 'gen')
else
  gen = next_gen()
end
local fields = {'uid', uid, 'restarts', restarts, 'gen', gen}
for i = 5, #ARGV do fields[#fields + 1] = ARGV[i] end
redis.call('HSET', K.meta, unpack(fields))
return {result, tonumber(gen)}
"""
)

REMOVE_INSTANCE = (
    _COMMON
    + r"""
local existed = redis.call('EXISTS', K.meta)
drop_all()
redis.call('DEL', K.meta)
next_gen()
return existed
"""
)

UPGRADE_LAYOUT = (
    _COMMON
    + r"""
-- Run by common.store.Store before its first APPLY_BATCH of an instance (and again after a
-- refused one), never on the hot path. Returns 1 if the instance was reset, else 0.
-- An index written in an older layout (per-rank count hashes, or sets without group
-- descriptors) cannot be trusted: drop L1/L2 and move the generation on, as for a vLLM
-- restart; the ingester sees stale_gen, reloads and re-syncs from the replay buffer. An
-- unregistered instance is left to APPLY_BATCH's generation fence.
if redis.call('EXISTS', K.meta) == 1
   and (redis.call('EXISTS', K.legacy_l1_counts, K.legacy_l2_counts) > 0
        or (redis.call('EXISTS', K.l1_groups) == 0
            and redis.call('EXISTS', K.l1_set, K.l2_set) > 0)) then
  reset_instance('the index was written in an older layout')
  return 1
end
return 0
"""
)

APPLY_BATCH_REPLY = ("status", "unknown_removes")
"""The fields of APPLY_BATCH's reply, in order (``common.store.ApplyResult``'s, a test checks
that they and every ``return {…}`` of the script agree)."""

APPLY_BATCH_ARGV = (
    "legacy_l1_prefix",
    "legacy_l2_prefix",
    "gen",
    "owner",
    "rank",
    "seq",
    "reset",
    "gap",
    "follows_seq",
    "follows_digest",
    "digest",
)
"""APPLY_BATCH's fixed ARGV, in order (``common.store`` builds them by name; the script reads
them as ``A.<name>``); the batch's ops follow, from ARGV[OPS]."""

APPLY_BATCH_OPS = {
    "stored": "S",
    "removed": "R",
    "cleared": "C",
    "describe": "D",
    "settings": "H",
    "lookahead": "A",
}
"""The op codes of an APPLY_BATCH op (``common.store_batch.TierOps`` writes them; the script
reads them as ``OP.<name>``)."""

APPLY_BATCH_STATUS = {
    "applied": 1,
    "duplicate": 0,
    "stale_gen": -1,
    "not_owner": -2,
    "groups_changed": -3,
    "cursor_moved": -4,
}
"""The status codes of APPLY_BATCH's reply by ``common.store_batch.BatchStatus`` value (the
script returns them as ``STATUS.<name>``)."""


def _lua_table(name: str, fields: dict[str, str]) -> str:
    return f"local {name} = {{" + ", ".join(f"{k} = {v}" for k, v in fields.items()) + "}\n"


_APPLY_NAMES = (
    _lua_table("A", {n: f"ARGV[{i}]" for i, n in enumerate(APPLY_BATCH_ARGV, 1)})
    + f"local OPS = {len(APPLY_BATCH_ARGV) + 1}\n"
    + _lua_table("OP", {k: f"'{v}'" for k, v in APPLY_BATCH_OPS.items()})
    + _lua_table("STATUS", {k: str(v) for k, v in APPLY_BATCH_STATUS.items()})
)

APPLY_BATCH = (
    _COMMON
    + _APPLY_NAMES
    + r"""
-- A.gen, A.owner ('' = unchecked), A.rank, A.seq,
-- A.reset '1' = clear this rank first (publisher restart / gap policy clear),
-- A.gap '1' = count an unrecoverable gap, A.follows_seq the rank's cursor seq the writer
-- believes is stored ('-1' = none, '*' = unchecked), A.follows_digest that cursor's payload
-- digest ('' = none), A.digest the digest of this batch's payload, ARGV[OPS..] ops: op, tier,
-- group, n, value * n
-- (op S = stored, R = removed: n hashes; C = all cleared, n = 0, every group;
-- D = a group's descriptor as seen on a BlockStored: n = 3, kind ('-' = not sent), block
-- size, window ('' = none); H = the ingester's settings for the instance: n = 3, h_cfg
-- (0 = derive), chunk (0 = unknown), dp size; A = the engine's speculative-decoding
-- lookahead L as a GPU BlockStored shows it: n = 1, field 'la').
-- Returns APPLY_BATCH_REPLY: {status, unknown_removes}; status STATUS.applied, .duplicate
-- (old sequence), .stale_gen, .not_owner, .groups_changed (a group's descriptor or the
-- lookahead L changed: the instance was reset, new generation, reset_reason in the state
-- hash), .cursor_moved (the stored cursor seq:<rank>, dig:<rank> is not the one the writer
-- follows: a failover lost acknowledged writes, the state hash was emptied, another session
-- wrote): nothing changed but on applied (and the reset of groups_changed).
if redis.call('HGET', K.meta, 'gen') ~= A.gen then return {STATUS.stale_gen, 0} end
if A.owner ~= '' and redis.call('GET', K.l1_owner) ~= A.owner then
  return {STATUS.not_owner, 0}
end
local rank, seq = A.rank, tonumber(A.seq)
local seqf, digf = 'seq:' .. rank, 'dig:' .. rank
-- The cursor fence: a batch follows the batch the writer applied last, so it is refused if
-- the store no longer holds exactly that one (a reset does not depend on what is stored).
if A.reset ~= '1' and A.follows_seq ~= '*' then
  local cur = redis.call('HMGET', K.l1_state, seqf, digf)
  if (cur[1] or '-1') ~= A.follows_seq or (cur[2] or '') ~= A.follows_digest then
    return {STATUS.cursor_moved, 0}
  end
end
if A.reset == '1' then
  clear_rank('l1', rank)
  clear_rank('l2', rank)
  redis.call('HDEL', K.l1_state, seqf, digf)
end
local last = redis.call('HGET', K.l1_state, seqf)
if last and seq <= tonumber(last) then return {STATUS.duplicate, 0} end
-- Descriptors first, before any write: a kind or window that changed within a generation
-- means the engine is not the one indexed (or the index is wrong): reset, never mix.
local learned = {}
local i = OPS
while i <= #ARGV do
  local op, g, n = ARGV[i], ARGV[i + 2], tonumber(ARGV[i + 3])
  if op == OP.describe then
    local kind, b, w = ARGV[i + 4], tonumber(ARGV[i + 5]), ARGV[i + 6]
    local cur = learned[g] or redis.call('HGET', K.l1_groups, g)
    local ck, cb, cw, cm = '-', 0, '', 0
    if cur then ck, cb, cw, cm = string.match(cur, '^([^,]*),(%d+),([^,]*),(%d+)$') end
    cb, cm = tonumber(cb), tonumber(cm)
    if kind ~= '-' and ck ~= '-' and (kind ~= ck or w ~= cw) then
      reset_instance(string.format('KV-cache group %s changed from %s to %s,%d,%s', g,
                                   cur, kind, b, w))
      return {STATUS.groups_changed, 0}
    end
    if ck == '-' then ck, cw = kind, w end
    if b > 0 and (cm == 0 or b < cm) then cm = b end
    if b > cb then cb = b end
    learned[g] = string.format('%s,%d,%s,%d', ck, cb, cw, cm)
  elseif op == OP.settings then
    learned['h_cfg'], learned['chunk'], learned['dp'] = ARGV[i + 4], ARGV[i + 5], ARGV[i + 6]
  elseif op == OP.lookahead then
    -- Hashes made with another L never equal this engine's: a new L within a generation is
    -- another engine configuration, so reset rather than keep blocks no chain can match.
    local cur = learned['la'] or redis.call('HGET', K.l1_groups, 'la')
    if cur and cur ~= ARGV[i + 4] then
      reset_instance(string.format(
        'the speculative-decoding lookahead changed from %s to %s tokens', cur, ARGV[i + 4]))
      return {STATUS.groups_changed, 0}
    end
    learned['la'] = ARGV[i + 4]
  elseif op == OP.stored and not learned[g] then  -- a set never exists without its group's field
    learned[g] = redis.call('HGET', K.l1_groups, g) or '-,0,,0'
  end
  i = i + 4 + n
end
for f, v in pairs(learned) do
  if redis.call('HGET', K.l1_groups, f) ~= v then redis.call('HSET', K.l1_groups, f, v) end
end
if A.gap == '1' then redis.call('HINCRBY', K.l1_state, 'gap:' .. rank, 1) end
local unknown = 0
local ri = tonumber(rank) + 1
i = OPS
while i <= #ARGV do
  local op, tier, g, n = ARGV[i], ARGV[i + 1], ARGV[i + 2], tonumber(ARGV[i + 3])
  if op == OP.cleared then
    clear_rank(tier, rank)
  elseif op == OP.stored then
    local set, x = tier_keys(tier, g)
    for j = i + 4, i + 3 + n do store_copy(set, x, ARGV[j], ri) end
  elseif op == OP.removed then
    local set, x = tier_keys(tier, g)
    for j = i + 4, i + 3 + n do
      if not remove_copy(set, x, ARGV[j], ri) then unknown = unknown + 1 end
    end
  end
  i = i + 4 + n
end
redis.call('HSET', K.l1_state, seqf, A.seq)
if A.digest ~= '' then redis.call('HSET', K.l1_state, digf, A.digest)
else redis.call('HDEL', K.l1_state, digf) end
return {STATUS.applied, unknown}
"""
)

L1_STATUS = (
    _KEYS
    + r"""
-- K as above; ARGV[1] gen, ARGV[2] owner ('' = unchecked), ARGV[3] number of field,
-- value pairs to set, then those pairs, then field, increment pairs (counters).
-- The ingester's status of the instance (connection, replay, hash self-check) lives in the
-- l1 state hash next to seq:<rank>; fenced like apply_batch. 1 written, 0 refused.
if redis.call('HGET', K.meta, 'gen') ~= ARGV[1] then return 0 end
if ARGV[2] ~= '' and redis.call('GET', K.l1_owner) ~= ARGV[2] then return 0 end
local n = tonumber(ARGV[3])
if n > 0 then redis.call('HSET', K.l1_state, unpack(ARGV, 4, 3 + 2 * n)) end
for i = 4 + 2 * n, #ARGV, 2 do redis.call('HINCRBY', K.l1_state, ARGV[i], ARGV[i + 1]) end
return 1
"""
)

REPLACE_L3 = (
    _KEYS
    + r"""
-- K as above; ARGV[1] the generation the data was computed for ('' = any registered),
-- ARGV[2] the groups of the new data, comma-separated ("0", "0,1,3"); ARGV[3..] field,
-- value pairs for the l3 state hash.
-- The staging sets (one per group; none for a group without blocks) were filled by the
-- caller's pipeline, sent before this script as a separate call (Store.replace_l3).
local new = {}
for g in string.gmatch(ARGV[2], '[^,]+') do new[#new + 1] = g end
local function l3_keys(g)
  if g == '0' then return K.l3_set, K.l3_staging end
  return K.l3_set .. ':g' .. g, K.l3_set .. ':g' .. g .. ':new'
end
if redis.call('EXISTS', K.meta) == 0
   or (ARGV[1] ~= '' and redis.call('HGET', K.meta, 'gen') ~= ARGV[1]) then
  for _, g in ipairs(new) do
    local _, staging = l3_keys(g)
    redis.call('DEL', staging)
  end
  return 0
end
local keep = {}
for _, g in ipairs(new) do
  keep[g] = true
  local set, staging = l3_keys(g)
  if redis.call('EXISTS', staging) == 1 then
    redis.call('RENAME', staging, set)
  else
    redis.call('UNLINK', set)
  end
end
local old = redis.call('HGET', K.l3_state, 'groups') or '0'
for g in string.gmatch(old, '[^,]+') do
  if not keep[g] then redis.call('UNLINK', (l3_keys(g))) end
end
redis.call('HSET', K.l3_state, 'groups', ARGV[2])
if #ARGV > 2 then redis.call('HSET', K.l3_state, unpack(ARGV, 3)) end
return 1
"""
)

TOUCH_L3 = (
    _KEYS
    + r"""
-- K as above; ARGV[1] generation, ARGV[2] the token of the set the writer last wrote
-- ('' = not checked), ARGV[3..] field, value pairs for the l3 state hash.
-- Refreshes the state of an unchanged L3 set (e.g. updated_ms) without rewriting it. 0 when
-- the generation moved or the stored set is not the one the writer wrote (its token is not
-- in the state hash: the write was lost, e.g. by a failover): the writer rewrites it.
if redis.call('HGET', K.meta, 'gen') ~= ARGV[1] then return 0 end
if ARGV[2] ~= '' and redis.call('HGET', K.l3_state, 'written') ~= ARGV[2] then return 0 end
if #ARGV > 2 then redis.call('HSET', K.l3_state, unpack(ARGV, 3)) end
return 1
"""
)

CLAIM_LEASE = r"""
-- KEYS[1] lease key; ARGV[1] holder, ARGV[2] ttl ms. 1 = held by holder now, 0 = held by another.
local cur = redis.call('GET', KEYS[1])
if cur == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
if not cur then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
return 0
"""

HEARTBEAT = r"""
-- KEYS[1] live-ingester zset; ARGV[1] id, ARGV[2] ttl ms. Uses the server's clock, so
-- ingesters on hosts with skewed clocks agree on who is alive. Returns the live ids.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', KEYS[1], string.format('%d', now + tonumber(ARGV[2])), ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', string.format('%d', now))
return redis.call('ZRANGE', KEYS[1], 0, -1)
"""

RELEASE_LEASE = r"""
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
