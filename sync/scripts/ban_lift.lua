-- ban_lift.lua: lifts the ban of one client: deletes its ban key (its refusals and bans)
-- and says whether a ban was in force, by Redis's clock.
--
-- KEYS[1]: the ban key, <prefix><rule>@ban:{<client>}.
-- ARGV: shift_ms (added to Redis TIME: 0 but in tests; absent: 0), and optionally
-- only_banned: 1 to delete the key only while it holds a ban in force (a lift asked of a
-- client no daemon lists, which may not be banned: its refusals and count are kept).
--
-- Reply: {until_ms, count, now_us}: the ban's end and count the key held (0 when none),
-- and the time read (Redis TIME plus shift_ms, µs). The caller drops the index's member
-- "<count>|<key>" (the index may be on another node of a Cluster).

local shift = tonumber(ARGV[1] or '0')
local only = tonumber(ARGV[2] or '0')
if not (shift and only) then
  return redis.error_reply('rlsidecar ban_lift.lua: want [shift_ms[, only_banned]]')
end
local v = redis.call('HMGET', KEYS[1], 'u', 'c')
local tm = redis.call('TIME')
local now_us = tonumber(tm[1]) * 1000000 + tonumber(tm[2]) + shift * 1000
local u = tonumber(v[1]) or 0
if only == 0 or u > math.floor(now_us / 1000) then
  redis.call('DEL', KEYS[1])
end
return {u, tonumber(v[2]) or 0, now_us}
