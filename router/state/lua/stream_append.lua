-- Append delivered events and tokens. KEYS: hash, events list, tokens string
-- ARGV: owner, retention seconds, claim seconds, text_len, finished(0/1),
--       packed token ids (uint32 little-endian), first (the number of events
--       the writer put before these; -1: unchecked), events...
-- Returns 1 written; 0 not written: no such buffer (never made, expired, or
-- lost by a Redis restarted without persistence or flushed: a resume of it
-- finds nothing); 2 not written: the buffer is broken
-- (now, or before: it misses events its writer sent elsewhere, e.g. to the
-- router's local fallback during an outage); 3 not written: another router
-- holds the stream now (it took it over from a router that froze), or it
-- is finished.
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local h = redis.call('HMGET', KEYS[1], 'owner', 'finished', 'broken')
local owner = h[1] or ''
if (owner ~= '' and owner ~= ARGV[1]) or h[2] == '1' then return 3 end
local ms = math.ceil(tonumber(ARGV[2]) * 1000)
local first = tonumber(ARGV[7])
if h[3] == '1' or (first >= 0 and redis.call('LLEN', KEYS[2]) ~= first) then
  redis.call('HSET', KEYS[1], 'broken', 1)
  redis.call('PEXPIRE', KEYS[1], ms)
  redis.call('PEXPIRE', KEYS[2], ms)
  redis.call('PEXPIRE', KEYS[3], ms)
  return 2
end
if #ARGV > 7 then
  redis.call('RPUSH', KEYS[2], unpack(ARGV, 8))
end
if #ARGV[6] > 0 then redis.call('APPEND', KEYS[3], ARGV[6]) end
if tonumber(ARGV[4]) >= 0 then redis.call('HSET', KEYS[1], 'text_len', ARGV[4]) end
if ARGV[5] == '1' then redis.call('HSET', KEYS[1], 'finished', 1) end
if owner == ARGV[1] then
  redis.call('HSET', KEYS[1], 'owner_until', tostring(now + tonumber(ARGV[3])))
end
redis.call('PEXPIRE', KEYS[1], ms)
redis.call('PEXPIRE', KEYS[2], ms)
redis.call('PEXPIRE', KEYS[3], ms)
return 1
