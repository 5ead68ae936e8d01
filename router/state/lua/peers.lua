-- Publish this router's tenants-file digest and read every live router's.
-- KEYS: 1 hash (router id -> "digest expiry"); ARGV: router id, digest, ttl seconds
-- (ttl 0: the router leaves; its entry is removed)
-- Returns a flat list: router id, digest, ... (entries past their expiry are dropped)
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local ttl = tonumber(ARGV[3])
if ttl > 0 then
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[2] .. ' ' .. tostring(now + ttl))
else
  redis.call('HDEL', KEYS[1], ARGV[1])
end
local all = redis.call('HGETALL', KEYS[1])
local out = {}
for i = 1, #all, 2 do
  local digest, expiry = string.match(all[i + 1], '^(%S+) (%S+)$')
  if digest == nil or tonumber(expiry) < now then
    redis.call('HDEL', KEYS[1], all[i])
  else
    out[#out + 1] = all[i]
    out[#out + 1] = digest
  end
end
-- (the key outlives every entry: never shortened by a router with a shorter ttl)
local want = math.ceil(ttl * 2000)
if want > 0 and redis.call('PTTL', KEYS[1]) < want then
  redis.call('PEXPIRE', KEYS[1], want)
end
return out
