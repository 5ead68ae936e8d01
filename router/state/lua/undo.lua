-- Undo an admission its router never used (StateStore.undo_admit): it timed
-- out on a Redis that only hung, which ran it when it woke. Its lease here
-- says it was admitted: give back its request and the tokens it took, hand
-- back the reservations it took over as they were (admit.lua keeps them in
-- the mark: '-1 0 taker until record'), drop its own, end its lease unless
-- kept. Once: made again, it finds no lease, or a kept one marked undone
-- ('undo:' and the id in the settled ids; a lease released is not marked:
-- one admitted late again, after another hang, is undone again).
-- KEYS: 1 requests bucket, 2 tokens bucket, 3 leases, 4 held reservations,
--       5 their expiry, 6 settled lease ids (settle.lua)
-- ARGV: rpm, tpm, cost_tokens, lease id, keep the lease (0/1), how long the
--       mark is kept (seconds), then the leases it replaced
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local lease_id = ARGV[4]
if redis.call('ZSCORE', KEYS[3], lease_id) == false then return 0 end  -- (refused, or never made)
if ARGV[5] ~= '1' then
  redis.call('ZREM', KEYS[3], lease_id)
else
  local mark = 'undo:' .. lease_id
  redis.call('ZREMRANGEBYSCORE', KEYS[6], '-inf', now)
  if redis.call('ZSCORE', KEYS[6], mark) then return 0 end
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
if tpm <= 0 then return 1 end
local own = redis.call('HGET', KEYS[4], lease_id)
-- (taken over since, with what it took over: that continuation settles for them)
if own and string.sub(own, 1, 3) == '-1 ' then return 1 end
redis.call('HDEL', KEYS[4], lease_id)
redis.call('ZREM', KEYS[5], lease_id)
local taken = 0
local seen = {}
for i = 7, #ARGV do
  local r = ARGV[i]
  local h = not seen[r] and redis.call('HGET', KEYS[4], r)
  seen[r] = true
  local taker, until_, record
  if h then taker, until_, record = string.match(h, '^%-1 0 (%S+) (%S+) (.+)$') end
  if taker == lease_id then
    taken = taken + tonumber(string.match(record, '^(%S+)'))
    if tonumber(until_) > now then
      redis.call('HSET', KEYS[4], r, record)
      redis.call('ZADD', KEYS[5], tonumber(until_), r)
    else
      redis.call('HDEL', KEYS[4], r)
      redis.call('ZREM', KEYS[5], r)
    end
  end
end
give(KEYS[2], tpm, math.max(0, tonumber(ARGV[3]) - taken))
return 1
