-- Create a stream's resume buffer. KEYS: hash, events list, tokens string
-- ARGV: meta, owner, retention seconds, claim seconds[, the last claim's leases,
-- lost (1: a router that held it died), the completion tokens charged for it:
-- a buffer copied from a fallback]
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3])
redis.call('HSET', KEYS[1], 'meta', ARGV[1], 'text_len', 0, 'finished', 0,
           'owner', ARGV[2], 'owner_until', tostring(now + tonumber(ARGV[4])))
if ARGV[5] and ARGV[5] ~= '' then redis.call('HSET', KEYS[1], 'lease', ARGV[5]) end
if ARGV[6] == '1' then redis.call('HSET', KEYS[1], 'lost', '1') end
if ARGV[7] and ARGV[7] ~= '0' then redis.call('HSET', KEYS[1], 'charged', ARGV[7]) end
redis.call('SET', KEYS[3], '')
local ms = math.ceil(tonumber(ARGV[3]) * 1000)
redis.call('PEXPIRE', KEYS[1], ms)
redis.call('PEXPIRE', KEYS[3], ms)
return 1
