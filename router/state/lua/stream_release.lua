-- Drop an owner's claim. KEYS: hash; ARGV: owner, complete ('1': every event
-- its generation made is in the buffer, until the next claim)
if redis.call('HGET', KEYS[1], 'owner') == ARGV[1] then
  redis.call('HSET', KEYS[1], 'owner', '')
  if ARGV[2] == '1' then redis.call('HSET', KEYS[1], 'complete', '1') end
end
return 1
