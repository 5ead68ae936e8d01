-- Extend the leases of streams the caller still runs; one the server lost
-- (expired while its router was frozen, a restart, a flush) is added again.
-- KEYS: 1 leases zset; ARGV: ttl, lease ids...
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local ttl = tonumber(ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
for i = 2, #ARGV do
  redis.call('ZADD', KEYS[1], now + ttl, ARGV[i])
end
local last = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')
if last[2] then
  redis.call('PEXPIRE', KEYS[1], math.ceil((tonumber(last[2]) - now) * 1000) + 1000)
end
return 1
