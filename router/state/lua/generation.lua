-- The id of the data this Redis holds, made by the first router to find none.
-- A router that reads another id than before knows that what it put here
-- (the leases of its running streams) is gone: Redis restarted without
-- persistence, was flushed or replaced. It adds its leases back at once.
-- (No expiry: it lives as long as the data it names.)
-- KEYS: 1 the id's key; ARGV: 1 a new id (taken if there is none)
redis.call('SET', KEYS[1], ARGV[1], 'NX')
return redis.call('GET', KEYS[1])
