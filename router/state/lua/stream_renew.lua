-- Extend an owner's own claim: a live router renewing the streams it
-- generates. Never takes a stream (released, finished, another's, gone: 0).
-- KEYS: hash; ARGV: owner, claim seconds
local h = redis.call('HMGET', KEYS[1], 'finished', 'owner')
if not h[1] or h[1] == '1' or h[2] ~= ARGV[1] then return 0 end
local t = redis.call('TIME')
redis.call('HSET', KEYS[1], 'owner_until', tostring(tonumber(t[1]) + tonumber(t[2]) / 1000000 + tonumber(ARGV[2])))
return 1
