-- Undo an admission its router never used (StateStore.undo_admit): it timed
-- out on a Redis that only hung, which ran it when it woke. Its lease here
-- says it was admitted: give back its request and the tokens it took, hand
-- back the reservations it took over as they were (admit.lua keeps them in
-- the mark: '-1 0 taker until record'; one whose own router's settlement
-- came since, settle.lua left as '-1 1 taker amount given': what that
-- settlement gives back counts now), drop its own, end its lease unless
-- kept. Once: made again, it finds no lease, or 'undo:' and the id in the
-- settled ids (written when it gives back with the lease kept; made again
-- without, after its stream ended, it only ends the lease). A lease ended
-- here is not marked: one admitted late again, after another hang, is
-- undone again. What it frees, the routers hear while the tenant has a
-- line (turn.lua).
-- KEYS: 1 requests bucket, 2 tokens bucket, 3 leases, 4 held reservations,
--       5 their expiry, 6 settled lease ids (settle.lua), 7 the tenant's line
-- ARGV: rpm, tpm, cost_tokens, lease id, keep the lease (0/1), how long the
--       mark is kept (seconds), channel, tenant, then the leases it replaced
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local lease_id = ARGV[4]
if redis.call('ZSCORE', KEYS[3], lease_id) == false then return 0 end  -- (refused, or never made)

local function told()
  if redis.call('EXISTS', KEYS[7]) == 1 then redis.call('PUBLISH', ARGV[7], ARGV[8]) end
  return 1
end

local mark = 'undo:' .. lease_id
redis.call('ZREMRANGEBYSCORE', KEYS[6], '-inf', now)
local undone = redis.call('ZSCORE', KEYS[6], mark)
if ARGV[5] ~= '1' then
  redis.call('ZREM', KEYS[3], lease_id)
  if undone then return told() end  -- (given back with its lease kept, which ended since)
else
  if undone then return 0 end
  local keep = tonumber(ARGV[6])
  redis.call('ZADD', KEYS[6], now + keep, mark)
  redis.call('PEXPIRE', KEYS[6], math.ceil(keep * 1000) + 1000)
end

local function give(key, per_min, n)
  local v = redis.call('HMGET', key, 'tokens', 'ts')
  local lvl = per_min  -- no key: a full bucket
  if v[1] then lvl = math.min(per_min, tonumber(v[1]) + math.max(0, now - tonumber(v[2])) * per_min / 60) end
  lvl = math.min(per_min, lvl + n)
  redis.call('HSET', key, 'tokens', tostring(lvl), 'ts', tostring(now))
  redis.call('PEXPIRE', key, math.ceil((per_min - lvl) * 60 / per_min * 1000) + 1000)
end

local rpm = tonumber(ARGV[1])
local tpm = tonumber(ARGV[2])
if rpm > 0 then give(KEYS[1], rpm, 1) end
if tpm <= 0 then return told() end
local own = redis.call('HGET', KEYS[4], lease_id)
-- (taken over since, with what it took over: that continuation settles for them)
if own and string.sub(own, 1, 3) == '-1 ' then return told() end
redis.call('HDEL', KEYS[4], lease_id)
redis.call('ZREM', KEYS[5], lease_id)
local taken = 0  -- (what it did not charge: the reservations it took over)
local given = 0  -- (what their own routers' settlements since give back)
local seen = {}
for i = 9, #ARGV do
  local r = ARGV[i]
  local h = not seen[r] and redis.call('HGET', KEYS[4], r)
  seen[r] = true
  if h then
    local taker, until_, record = string.match(h, '^%-1 0 (%S+) (%S+) (.+)$')
    if taker == lease_id then
      taken = taken + tonumber(string.match(record, '^(%S+)'))
      if tonumber(until_) > now then
        redis.call('HSET', KEYS[4], r, record)
        redis.call('ZADD', KEYS[5], tonumber(until_), r)
      else
        redis.call('HDEL', KEYS[4], r)
        redis.call('ZREM', KEYS[5], r)
      end
    else
      local amount, back
      taker, amount, back = string.match(h, '^%-1 1 (%S+) (%S+) (%S+)$')
      if taker == lease_id then
        taken = taken + tonumber(amount)
        given = given + tonumber(back)
        redis.call('HDEL', KEYS[4], r)
        redis.call('ZREM', KEYS[5], r)
      end
    end
  end
end
give(KEYS[2], tpm, math.max(0, tonumber(ARGV[3]) - taken) + given)
return told()
