-- Extend the leases of streams the caller still runs; one the server lost
-- (expired while its router was frozen, a restart, a flush) is added again.
-- A held reservation (admit.lua) of a lease renewed, not taken over, is kept
-- for its hold from the lease's new end: a stream that runs longer than its
-- hold can still be taken over by a continuation.
-- KEYS: 1 leases zset, 2 held reservations, 3 their expiry; ARGV: ttl, lease ids...
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local ttl = tonumber(ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local held = KEYS[2] ~= nil and redis.call('EXISTS', KEYS[2]) == 1
local extended = false
for i = 2, #ARGV do
  redis.call('ZADD', KEYS[1], now + ttl, ARGV[i])
  if held then
    local h = redis.call('HGET', KEYS[2], ARGV[i])
    if h and string.sub(h, 1, 3) ~= '-1 ' then
      local hold = tonumber(string.match(h, '^%S+ %S+ (%S+)$') or '0') or 0
      local until_ = tonumber(redis.call('ZSCORE', KEYS[3], ARGV[i]) or 0)
      if hold > 0 and until_ > now and now + ttl + hold > until_ then
        redis.call('ZADD', KEYS[3], now + ttl + hold, ARGV[i])
        extended = true
      end
    end
  end
end
local last = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')
if last[2] then
  redis.call('PEXPIRE', KEYS[1], math.ceil((tonumber(last[2]) - now) * 1000) + 1000)
end
if extended then
  local longest = redis.call('ZRANGE', KEYS[3], -1, -1, 'WITHSCORES')
  local ms = math.ceil((tonumber(longest[2]) - now) * 1000) + 1000
  redis.call('PEXPIRE', KEYS[2], ms)
  redis.call('PEXPIRE', KEYS[3], ms)
end
return 1
