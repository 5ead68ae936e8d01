-- Something that frees a tenant's limits (a lease released, tokens given
-- back) or moves its line (a waiting request left it): when requests of the
-- tenant wait in its line, tell the routers (their heads ask again at once).
-- KEYS: 1 leases zset, 2 line zset, 3 line expiry zset; ARGV: op
--       (release|leave), lease id, channel, tenant
if ARGV[1] == 'release' then
  redis.call('ZREM', KEYS[1], ARGV[2])
else
  redis.call('ZREM', KEYS[2], ARGV[2])
  redis.call('ZREM', KEYS[3], ARGV[2])
end
if redis.call('EXISTS', KEYS[2]) == 1 then
  redis.call('PUBLISH', ARGV[3], ARGV[4])
end
return 1
