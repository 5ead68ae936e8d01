-- Read a resume buffer. KEYS: hash, events list, tokens string; ARGV: after,
-- tokens (0: leave the token ids out)
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local h = redis.call('HMGET', KEYS[1], 'meta', 'text_len', 'finished', 'owner', 'owner_until', 'broken', 'lease', 'lost', 'charged')
if not h[1] then return false end
local owner = h[4] or ''
local lost = h[8] or '0'
if owner ~= '' and tonumber(h[5]) <= now then owner = ''; lost = '1' end
local events = redis.call('LRANGE', KEYS[2], tonumber(ARGV[1]), -1)
local total = redis.call('LLEN', KEYS[2])
local toks = ''
if ARGV[2] ~= '0' then toks = redis.call('GET', KEYS[3]) or '' end
return {h[1], toks, h[2], events, total, h[3], owner, h[6] or '0', h[7] or '', lost, h[9] or '0'}
