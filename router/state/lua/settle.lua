-- Correct the tokens bucket with the real usage (policies/ratelimit.py settle).
-- Once per lease id: one settled within the last SETTLED_TTL changes nothing
-- (a settlement that timed out on a Redis that only hung runs when Redis
-- wakes, and its router makes it again from its list of missed ones).
-- KEYS: 1 tokens bucket, 2 the tenant's line, 3 held reservations, 4 their
-- expiry (admit.lua), 5 settled lease ids (zset: lease id -> until);
-- ARGV: tpm, reserved, used, channel, tenant (tokens given back while requests
-- wait: tell the routers), lease id (its reservation taken over by a
-- continuation: nothing to do, the continuation settles for it; what it
-- would have given back is kept in the mark for undo.lua), held (1:
-- admitted with a hold), how long a settled lease id is kept (seconds)
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local lease_id = ARGV[6] or ''
if lease_id ~= '' then
  redis.call('ZREMRANGEBYSCORE', KEYS[5], '-inf', now)
  if redis.call('ZSCORE', KEYS[5], lease_id) then return 0 end
  local keep = tonumber(ARGV[8])
  redis.call('ZADD', KEYS[5], now + keep, lease_id)
  -- (every entry is kept as long: the newest is the last to go)
  redis.call('PEXPIRE', KEYS[5], math.ceil(keep * 1000) + 1000)
end
-- (admitted with a hold, its record gone: maybe taken over and settled; no refund)
local no_refund = ARGV[7] == '1'
local delta = tonumber(ARGV[2]) - tonumber(ARGV[3])
if lease_id ~= '' then
  local h = redis.call('HGET', KEYS[3], lease_id)
  if h then
    local until_ = tonumber(redis.call('ZSCORE', KEYS[4], lease_id) or 0)
    if string.sub(h, 1, 3) == '-1 ' and until_ > now then
      -- (taken over. Unless the continuation is undone, its router never
      -- having used it (undo.lua): then what this would have given back
      -- counts, as its reservation was, kept in the mark until then)
      local taker, end_, amount = string.match(h, '^%-1 0 (%S+) (%S+) (%S+)')
      if taker then
        if no_refund and tonumber(end_) <= now and delta > 0 then delta = 0 end
        redis.call('HSET', KEYS[3], lease_id, '-1 1 ' .. taker .. ' ' .. amount .. ' ' .. tostring(delta))
      elseif string.sub(h, 1, 5) ~= '-1 1 ' then  -- (an earlier version's mark, '-1 0' alone)
        redis.call('HDEL', KEYS[3], lease_id)
        redis.call('ZREM', KEYS[4], lease_id)
      end
      return 0
    end
    redis.call('HDEL', KEYS[3], lease_id)
    redis.call('ZREM', KEYS[4], lease_id)
    if string.sub(h, 1, 3) ~= '-1 ' and until_ > now then no_refund = false end
  end
end
local tpm = tonumber(ARGV[1])
if no_refund and delta > 0 then delta = 0 end
local v = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
local lvl = tpm  -- no key: a full bucket (admit.lua lets full buckets expire)
if v[1] then
  lvl = math.min(tpm, tonumber(v[1]) + math.max(0, now - tonumber(v[2])) * tpm / 60)
end
lvl = math.min(tpm, lvl + delta)
redis.call('HSET', KEYS[1], 'tokens', tostring(lvl), 'ts', tostring(now))
redis.call('PEXPIRE', KEYS[1], math.ceil(math.max(0, (tpm - lvl) * 60 / tpm) * 1000) + 1000)
if delta > 0 and redis.call('EXISTS', KEYS[2]) == 1 then
  redis.call('PUBLISH', ARGV[4], ARGV[5])
end
return 1
