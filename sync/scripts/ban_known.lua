-- ban_known.lua: the shared bans in force, read from their index by Redis's clock.
--
-- KEYS[1]: the index, <prefix>~bans (a sorted set: member "<count>|<key>", score the
-- ban's end in Unix ms by Redis's clock, as ban.lua wrote it).
-- ARGV: limit (at most that many members, those ending last), shift_ms (added to Redis
-- TIME: 0 but in tests).
--
-- Redis TIME, not a daemon's clock, says which bans have ended, so every daemon reads the
-- same bans whatever its clock (before, a daemon ahead dropped the bans still in force
-- by everyone else's). The ended members are dropped.
--
-- Reply: {now_us, {member, score, ...}}: the time read (Redis TIME plus shift_ms, µs),
-- which the daemon also uses to learn its clock's offset from Redis's, and the bans in
-- force, latest to end first.

local limit, shift = tonumber(ARGV[1]), tonumber(ARGV[2] or '0')
if not (limit and shift) or limit < 1 then
  return redis.error_reply('rlsidecar ban_known.lua: want limit >= 1[, shift_ms]')
end
local tm = redis.call('TIME')
local now_us = tonumber(tm[1]) * 1000000 + tonumber(tm[2]) + shift * 1000
local now_ms = string.format('%.0f', math.floor(now_us / 1000))
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now_ms)
local zs = redis.call('ZRANGE', KEYS[1], '+inf', '(' .. now_ms, 'BYSCORE', 'REV', 'LIMIT', 0, limit, 'WITHSCORES')
return {now_us, zs}
