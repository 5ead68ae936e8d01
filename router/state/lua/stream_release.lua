-- Drop an owner's claim. KEYS: hash; ARGV: owner[, the completion tokens
-- charged for the stream so far (kept as the largest given)]
if redis.call('HGET', KEYS[1], 'owner') == ARGV[1] then
  redis.call('HSET', KEYS[1], 'owner', '')
  local charged = tonumber(ARGV[2] or '0') or 0
  if charged > (tonumber(redis.call('HGET', KEYS[1], 'charged') or '0') or 0) then
    redis.call('HSET', KEYS[1], 'charged', charged)
  end
end
return 1
