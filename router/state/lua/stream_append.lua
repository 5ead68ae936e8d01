-- Append delivered events and tokens. KEYS: hash, events list, tokens string
-- ARGV: owner, retention seconds, claim seconds, text_len, finished(0/1),
--       packed token ids (uint32 little-endian), events...
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
if #ARGV > 6 then
  redis.call('RPUSH', KEYS[2], unpack(ARGV, 7))
end
if #ARGV[6] > 0 then redis.call('APPEND', KEYS[3], ARGV[6]) end
if tonumber(ARGV[4]) >= 0 then redis.call('HSET', KEYS[1], 'text_len', ARGV[4]) end
if ARGV[5] == '1' then redis.call('HSET', KEYS[1], 'finished', 1) end
if redis.call('HGET', KEYS[1], 'owner') == ARGV[1] then
  redis.call('HSET', KEYS[1], 'owner_until', tostring(now + tonumber(ARGV[3])))
end
local ms = math.ceil(tonumber(ARGV[2]) * 1000)
redis.call('PEXPIRE', KEYS[1], ms)
redis.call('PEXPIRE', KEYS[2], ms)
redis.call('PEXPIRE', KEYS[3], ms)
return 1
