-- beat_age.lua: how long ago a daemon id last sent a heartbeat, on Redis time, so a
-- daemon starting under an id can tell whether another live daemon already uses it.
-- KEYS[1] the daemons sorted set (heartbeat.lua); ARGV[1] the daemon id.
-- Reply: the age of its last heartbeat in ms (0 if it is in the future: another Redis
-- clock wrote it), or -1 when the set does not hold the id.
local s = tonumber(redis.call('ZSCORE', KEYS[1], ARGV[1]) or '')
if not s then
  return -1
end
local tm = redis.call('TIME')
local now = tonumber(tm[1]) * 1000 + math.floor(tonumber(tm[2]) / 1000)
if now < s then
  return 0
end
return now - s
