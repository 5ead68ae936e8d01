-- Publish this router's tenants-file digest and read every live router's.
-- KEYS: 1 hash (router id -> "digest expiry"); ARGV: router id, digest, ttl seconds
-- Returns a flat list: router id, digest, ... (entries past their expiry are dropped)
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local ttl = tonumber(ARGV[3])
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2] .. ' ' .. tostring(now + ttl))
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
redis.call('PEXPIRE', KEYS[1], math.ceil(ttl * 2000))
return out
