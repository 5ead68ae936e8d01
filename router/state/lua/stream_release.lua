-- Drop an owner's claim. KEYS: hash; ARGV: owner
if redis.call('HGET', KEYS[1], 'owner') == ARGV[1] then
  redis.call('HSET', KEYS[1], 'owner', '')
end
return 1
