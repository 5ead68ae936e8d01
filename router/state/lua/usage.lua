-- Live levels and leases. KEYS: requests, tokens, leases; ARGV: rpm, tpm
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local function level(key, per_min)
  if per_min <= 0 then return 0 end
  local v = redis.call('HMGET', key, 'tokens', 'ts')
  if not v[1] then return per_min end
  return math.min(per_min, tonumber(v[1]) + math.max(0, now - tonumber(v[2])) * per_min / 60)
end
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
return {tostring(level(KEYS[1], tonumber(ARGV[1]))), tostring(level(KEYS[2], tonumber(ARGV[2]))), redis.call('ZCARD', KEYS[3])}
