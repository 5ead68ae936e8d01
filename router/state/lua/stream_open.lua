-- Create a stream's resume buffer. KEYS: hash, events list, tokens string
-- ARGV: meta, owner, retention seconds, claim seconds
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3])
redis.call('HSET', KEYS[1], 'meta', ARGV[1], 'text_len', 0, 'finished', 0,
           'owner', ARGV[2], 'owner_until', tostring(now + tonumber(ARGV[4])))
redis.call('SET', KEYS[3], '')
local ms = math.ceil(tonumber(ARGV[3]) * 1000)
redis.call('PEXPIRE', KEYS[1], ms)
redis.call('PEXPIRE', KEYS[3], ms)
return 1
