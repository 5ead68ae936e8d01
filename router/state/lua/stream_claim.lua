-- Take over a stream if no live owner holds it. KEYS: hash; ARGV: owner, claim
-- seconds, the lease its continuation will hold (kept for the next claim's)
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local h = redis.call('HMGET', KEYS[1], 'finished', 'owner', 'owner_until')
if not h[1] or h[1] == '1' then return 0 end
local owner = h[2] or ''
if owner ~= '' and owner ~= ARGV[1] and tonumber(h[3]) > now then return 0 end
-- a claim that ran out unreleased: its router died (the stream is "lost": a
-- client may have events the buffer lacks)
if owner ~= '' and tonumber(h[3]) <= now then redis.call('HSET', KEYS[1], 'lost', '1') end
redis.call('HSET', KEYS[1], 'owner', ARGV[1], 'owner_until', tostring(now + tonumber(ARGV[2])), 'lease', ARGV[3] or '')
return 1
