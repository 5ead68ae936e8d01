-- Atomic admission: requests bucket, tokens bucket and concurrency leases.
-- Same arithmetic as policies/ratelimit.py (admit); time is the Redis
-- server's, so every router process shares one clock.
-- With a line (the tenant queues), the tenant's waiting requests come first:
-- one not in the line is refused while anyone waits, one in it while anyone
-- waits ahead (reason 'queued' where its limits pass); a refused one joins
-- the line's end (unless it can never fit) until its retry plus a slack.
-- Held reservations (StateStore.admit): an admitted request with a hold keeps
-- its reservation under its lease id, 'tokens base', until settled; it takes
-- over those of the leases it replaces and needs that many tokens fewer.
-- One taken over is marked '-1 0' (what earlier versions read), then the
-- lease that took it over, the record's end and the record as it was: an
-- admission its router never used hands it back (undo.lua). Its own
-- router's settlement makes it '-1 1', the taker, the amount taken over and
-- what that settlement would have given back (settle.lua).
-- KEYS: 1 requests bucket (hash), 2 tokens bucket (hash), 3 leases (zset),
--       4 line (zset: lease id -> arrival), 5 line expiry (zset: lease id -> until),
--       6 held reservations (hash: lease id -> 'tokens base'),
--       7 their expiry (zset: lease id -> until)
-- ARGV: rpm, tpm, max_concurrent, cost_tokens, lease_id, lease_ttl, line (0/1),
--       queued retry, line slack, channel, tenant (a request admitted from the
--       line with others behind it: the routers are told, the next one's
--       router asks again at once), hold (seconds), base, then the leases
--       this one takes the place of, if any (a resumed stream's continuation:
--       the leases of those that generated the stream before it, which a
--       router that died left)
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local rpm = tonumber(ARGV[1])
local tpm = tonumber(ARGV[2])
local maxc = tonumber(ARGV[3])
local cost = tonumber(ARGV[4])
local lease_id = ARGV[5]
local ttl = tonumber(ARGV[6])
local in_line = ARGV[7] == '1'
local hold = tonumber(ARGV[12])
local FIRST_REPLACED = 14
local INF = 1e300

local function level(key, per_min)
  local v = redis.call('HMGET', key, 'tokens', 'ts')
  if not v[1] then return per_min end
  local lvl = tonumber(v[1]) + math.max(0, now - tonumber(v[2])) * per_min / 60
  return math.min(per_min, lvl)
end

local function wait(available, c, per_min)
  if c > per_min then return INF end
  local short = c - available
  if short <= 0 then return 0 end
  return short * 60 / per_min
end

local function reset(available, per_min)
  return math.max(0, (per_min - available) * 60 / per_min)
end

local function store(key, lvl, per_min)
  redis.call('HSET', key, 'tokens', tostring(lvl), 'ts', tostring(now))
  -- once full again the bucket equals a missing key; let Redis drop it
  local ms = math.ceil(reset(lvl, per_min) * 1000) + 1000
  redis.call('PEXPIRE', key, ms)
end

redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
local leases = redis.call('ZCARD', KEYS[3])
-- the leases this one replaces are not counted against it (and go if it is admitted)
local replaced = {}
for i = FIRST_REPLACED, #ARGV do
  local r = ARGV[i]
  if r ~= '' and r ~= lease_id and not replaced[r] and redis.call('ZSCORE', KEYS[3], r) then
    replaced[r] = true
    leases = leases - 1
  end
end
-- the held reservations it takes over (if admitted)
local took = {}
local prior = {}  -- (each one's record as it was)
local taken = 0
local base = tonumber(ARGV[13])
local own_cost = cost
if tpm > 0 and redis.call('EXISTS', KEYS[6]) == 1 then
  local gone = redis.call('ZRANGEBYSCORE', KEYS[7], '-inf', now)
  if #gone > 0 then
    redis.call('HDEL', KEYS[6], unpack(gone))
    redis.call('ZREM', KEYS[7], unpack(gone))
  end
  local seen = {}
  for i = FIRST_REPLACED, #ARGV do
    local r = ARGV[i]
    if r ~= '' and r ~= lease_id and not seen[r] then
      seen[r] = true
      local h = redis.call('HGET', KEYS[6], r)
      if h then
        local sp = string.find(h, ' ', 1, true)
        local amount = tonumber(string.sub(h, 1, sp - 1))
        local sp2 = string.find(h, ' ', sp + 1, true)
        local b = tonumber(string.sub(h, sp + 1, (sp2 or 0) - 1))
        if amount >= 0 then
          if #took == 0 or b < base then base = b end
          taken = taken + amount
          took[#took + 1] = r
          prior[r] = h
        end
      end
    end
  end
  cost = math.max(0, cost - taken)
end
local req_level = INF
local tok_level = INF
if rpm > 0 then req_level = level(KEYS[1], rpm) end
if tpm > 0 then tok_level = level(KEYS[2], tpm) end

local behind = false
if in_line then
  local gone = redis.call('ZRANGEBYSCORE', KEYS[5], '-inf', now)
  if #gone > 0 then
    redis.call('ZREM', KEYS[4], unpack(gone))
    redis.call('ZREM', KEYS[5], unpack(gone))
  end
  local first = redis.call('ZRANGE', KEYS[4], 0, 0)
  behind = first[1] ~= nil and first[1] ~= lease_id
end

local reason = ''
local worst = 0
if rpm > 0 then
  local w = wait(req_level, 1, rpm)
  if w > worst then worst = w; reason = 'requests' end
end
if tpm > 0 then
  local w = wait(tok_level, cost, tpm)
  if w > worst then worst = w; reason = 'tokens' end
end
if maxc > 0 and leases >= maxc and worst < 1 then
  worst = 1; reason = 'concurrency'
end
if behind then
  local poll = tonumber(ARGV[8])
  if poll > worst then worst = poll; reason = 'queued' end
end
if worst >= INF then reason = 'too_large' end

local rem_req = 0
local rem_tok = 0
local rst_req = 0
local rst_tok = 0
if reason ~= '' then
  if rpm > 0 then rem_req = req_level; rst_req = reset(req_level, rpm) end
  if tpm > 0 then rem_tok = tok_level; rst_tok = reset(tok_level, tpm) end
  if in_line and reason ~= 'too_large' then
    local until_ = now + worst + tonumber(ARGV[9])
    -- (its place: the arrival of its first refusal; one the server lost rejoins at the end)
    redis.call('ZADD', KEYS[4], 'NX', now, lease_id)
    redis.call('ZADD', KEYS[5], until_, lease_id)
    local last = redis.call('ZRANGE', KEYS[5], -1, -1, 'WITHSCORES')
    local ms = math.ceil((tonumber(last[2]) - now) * 1000) + 1000
    redis.call('PEXPIRE', KEYS[4], ms)
    redis.call('PEXPIRE', KEYS[5], ms)
  end
  return {0, reason, tostring(worst), tostring(rem_req), tostring(rem_tok), tostring(rst_req), tostring(rst_tok)}
end
if in_line and redis.call('ZREM', KEYS[4], lease_id) == 1 then
  redis.call('ZREM', KEYS[5], lease_id)
  if redis.call('EXISTS', KEYS[4]) == 1 then
    redis.call('PUBLISH', ARGV[10], ARGV[11])
  end
end
if rpm > 0 then
  rem_req = req_level - 1; rst_req = reset(rem_req, rpm); store(KEYS[1], rem_req, rpm)
end
if tpm > 0 then
  rem_tok = tok_level - cost; rst_tok = reset(rem_tok, tpm); store(KEYS[2], rem_tok, tpm)
end
for r in pairs(replaced) do redis.call('ZREM', KEYS[3], r) end
if lease_id ~= '' then  -- (none: a resume's charge, requests only)
  redis.call('ZADD', KEYS[3], now + ttl, lease_id)
  -- the set lives as long as its longest lease
  local last = redis.call('ZRANGE', KEYS[3], -1, -1, 'WITHSCORES')
  redis.call('PEXPIRE', KEYS[3], math.ceil((tonumber(last[2]) - now) * 1000) + 1000)
end
for _, r in ipairs(took) do
  -- (its settlement, if it comes, changes nothing: the continuation settles for it)
  local until_ = tonumber(redis.call('ZSCORE', KEYS[7], r) or 0)
  redis.call('HSET', KEYS[6], r, '-1 0 ' .. lease_id .. ' ' .. tostring(until_) .. ' ' .. prior[r])
  redis.call('ZADD', KEYS[7], math.max(until_, now + hold), r)
end
if hold > 0 and tpm > 0 then
  redis.call('HSET', KEYS[6], lease_id, string.format('%d %d %s', math.max(own_cost, taken), base, ARGV[12]))
  redis.call('ZADD', KEYS[7], now + hold, lease_id)
end
if #took > 0 or (hold > 0 and tpm > 0) then
  local longest = redis.call('ZRANGE', KEYS[7], -1, -1, 'WITHSCORES')
  local ms = math.ceil((tonumber(longest[2]) - now) * 1000) + 1000
  redis.call('PEXPIRE', KEYS[6], ms)
  redis.call('PEXPIRE', KEYS[7], ms)
end
if #took == 0 then base = 0 end
return {1, '', '0', tostring(rem_req), tostring(rem_tok), tostring(rst_req), tostring(rst_tok), taken, base}
