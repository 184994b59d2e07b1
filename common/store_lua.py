"""Lua sources of the store's atomic operations (loaded once per client by common.store).

Every instance script receives the same KEYS bundle (see ``common.store._instance_keys``)
and, as ARGV[1] and ARGV[2], the prefixes of the per-rank count hashes of tiers l1 and l2
(``…:l1:r`` and ``…:l2:r``) so that the rank number can be appended here without this
file spelling a key. KEYS: 1 meta, 2 gen, 3 l1 state, 4 l1 owner, 5 l1 set, 6 l1 counts,
7 l2 set, 8 l2 counts, 9 l3 set, 10 l3 staging, 11 l3 state.
"""

from __future__ import annotations

_COMMON = r"""
local function tier_keys(tier)
  if tier == 'l2' then return KEYS[7], KEYS[8], ARGV[2] end
  return KEYS[5], KEYS[6], ARGV[1]
end

local function clear_rank(tier, rank)
  local set, cnt, rprefix = tier_keys(tier)
  local rkey = rprefix .. rank
  local flat = redis.call('HGETALL', rkey)
  for i = 1, #flat, 2 do
    local left = redis.call('HINCRBY', cnt, flat[i], -tonumber(flat[i + 1]))
    if left <= 0 then
      redis.call('HDEL', cnt, flat[i])
      redis.call('SREM', set, flat[i])
    end
  end
  redis.call('UNLINK', rkey)
  return #flat / 2
end

local function known_ranks()
  local ranks = {}
  for _, field in ipairs(redis.call('HKEYS', KEYS[3])) do
    local r = string.match(field, '^seq:(%d+)$')
    if r then ranks[#ranks + 1] = r end
  end
  return ranks
end

local function drop_event_tiers()
  for _, r in ipairs(known_ranks()) do
    redis.call('UNLINK', ARGV[1] .. r, ARGV[2] .. r)
  end
  redis.call('UNLINK', KEYS[3], KEYS[5], KEYS[6], KEYS[7], KEYS[8])
end

-- A new generation: above the last one and never below the server's clock in ms, so a
-- Redis that lost its data (restart without persistence) still never repeats a generation
-- that a running ingester may hold.
local function next_gen()
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  local gen = math.max(tonumber(redis.call('GET', KEYS[2]) or '0') + 1, now)
  gen = string.format('%d', gen)
  redis.call('SET', KEYS[2], gen)
  return gen
end

local function drop_all()
  drop_event_tiers()
  redis.call('UNLINK', KEYS[4], KEYS[9], KEYS[10], KEYS[11])
end
"""

UPSERT_INSTANCE = _COMMON + r"""
-- ARGV[3] uid, ARGV[4] restart token, ARGV[5..] field, value pairs for the meta hash
local uid, restarts = ARGV[3], ARGV[4]
local cur_uid = redis.call('HGET', KEYS[1], 'uid')
local result
if not cur_uid then
  drop_all()
  result = 'added'
elseif cur_uid ~= uid then
  drop_all()
  redis.call('DEL', KEYS[1])
  result = 'replaced'
elseif redis.call('HGET', KEYS[1], 'restarts') ~= restarts then
  drop_event_tiers()
  result = 'restarted'
else
  result = 'unchanged'
  for i = 5, #ARGV, 2 do
    if redis.call('HGET', KEYS[1], ARGV[i]) ~= ARGV[i + 1] then result = 'updated' end
  end
end
local gen
if result == 'unchanged' or result == 'updated' then
  gen = redis.call('HGET', KEYS[1], 'gen')
else
  gen = next_gen()
end
local fields = {'uid', uid, 'restarts', restarts, 'gen', gen}
for i = 5, #ARGV do fields[#fields + 1] = ARGV[i] end
redis.call('HSET', KEYS[1], unpack(fields))
return {result, tonumber(gen)}
"""

REMOVE_INSTANCE = _COMMON + r"""
local existed = redis.call('EXISTS', KEYS[1])
drop_all()
redis.call('DEL', KEYS[1])
next_gen()
return existed
"""

APPLY_BATCH = _COMMON + r"""
-- ARGV[3] gen, ARGV[4] owner ('' = unchecked), ARGV[5] rank, ARGV[6] seq,
-- ARGV[7] '1' = clear this rank first (publisher restart / gap policy clear),
-- ARGV[8] '1' = count an unrecoverable gap, ARGV[9..] ops: op, tier, n, hash * n
-- (op S = stored, R = removed, C = all cleared with n = 0).
-- Returns {status, stored, removed, unknown_removes, cleared}; status 1 applied,
-- 0 duplicate/old sequence, -1 stale generation, -2 not the owner.
if redis.call('HGET', KEYS[1], 'gen') ~= ARGV[3] then return {-1, 0, 0, 0, 0} end
if ARGV[4] ~= '' and redis.call('GET', KEYS[4]) ~= ARGV[4] then return {-2, 0, 0, 0, 0} end
local rank, seq = ARGV[5], tonumber(ARGV[6])
local seqf = 'seq:' .. rank
local cleared = 0
if ARGV[7] == '1' then
  cleared = clear_rank('l1', rank) + clear_rank('l2', rank)
  redis.call('HDEL', KEYS[3], seqf)
end
local last = redis.call('HGET', KEYS[3], seqf)
if last and seq <= tonumber(last) then return {0, 0, 0, 0, cleared} end
if ARGV[8] == '1' then redis.call('HINCRBY', KEYS[3], 'gap:' .. rank, 1) end
local stored, removed, unknown = 0, 0, 0
local i = 9
while i <= #ARGV do
  local op, tier, n = ARGV[i], ARGV[i + 1], tonumber(ARGV[i + 2])
  local set, cnt, rprefix = tier_keys(tier)
  local rkey = rprefix .. rank
  if op == 'C' then
    cleared = cleared + clear_rank(tier, rank)
  end
  for j = i + 3, i + 2 + n do
    local h = ARGV[j]
    if op == 'S' then
      redis.call('HINCRBY', rkey, h, 1)
      if redis.call('HINCRBY', cnt, h, 1) == 1 then redis.call('SADD', set, h) end
      stored = stored + 1
    else
      local c = tonumber(redis.call('HGET', rkey, h) or '0')
      if c > 0 then
        if c == 1 then redis.call('HDEL', rkey, h) else redis.call('HINCRBY', rkey, h, -1) end
        if redis.call('HINCRBY', cnt, h, -1) <= 0 then
          redis.call('HDEL', cnt, h)
          redis.call('SREM', set, h)
        end
        removed = removed + 1
      else
        unknown = unknown + 1
      end
    end
  end
  i = i + 3 + n
end
redis.call('HSET', KEYS[3], seqf, ARGV[6])
return {1, stored, removed, unknown, cleared}
"""

L1_STATUS = r"""
-- KEYS as above; ARGV[3] gen, ARGV[4] owner ('' = unchecked), ARGV[5] number of field,
-- value pairs to set, then those pairs, then field, increment pairs (counters).
-- The ingester's status of the instance (connection, replay, hash self-check) lives in the
-- l1 state hash next to seq:<rank>; fenced like apply_batch. 1 written, 0 refused.
if redis.call('HGET', KEYS[1], 'gen') ~= ARGV[3] then return 0 end
if ARGV[4] ~= '' and redis.call('GET', KEYS[4]) ~= ARGV[4] then return 0 end
local n = tonumber(ARGV[5])
if n > 0 then redis.call('HSET', KEYS[3], unpack(ARGV, 6, 5 + 2 * n)) end
for i = 6 + 2 * n, #ARGV, 2 do redis.call('HINCRBY', KEYS[3], ARGV[i], ARGV[i + 1]) end
return 1
"""

REPLACE_L3 = r"""
-- KEYS as above; ARGV[3] the generation the data was computed for ('' = any registered),
-- ARGV[4..] field, value pairs for the l3 state hash.
-- The staging set was filled by the caller in the same pipeline.
if redis.call('EXISTS', KEYS[1]) == 0
   or (ARGV[3] ~= '' and redis.call('HGET', KEYS[1], 'gen') ~= ARGV[3]) then
  redis.call('DEL', KEYS[10])
  return 0
end
if redis.call('EXISTS', KEYS[10]) == 1 then
  redis.call('RENAME', KEYS[10], KEYS[9])
else
  redis.call('UNLINK', KEYS[9])
end
if #ARGV > 3 then redis.call('HSET', KEYS[11], unpack(ARGV, 4)) end
return 1
"""

TOUCH_L3 = r"""
-- KEYS as above; ARGV[3] generation, ARGV[4..] field, value pairs for the l3 state hash.
-- Refreshes the state of an unchanged L3 set (e.g. updated_ms) without rewriting it.
if redis.call('HGET', KEYS[1], 'gen') ~= ARGV[3] then return 0 end
redis.call('HSET', KEYS[11], unpack(ARGV, 4))
return 1
"""

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
