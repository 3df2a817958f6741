-- ban.lua: a penalty rule's refusals of one client, and its escalating bans, shared by
-- every daemon on this Redis (hybrid and global modes).
--
-- KEYS[1]: the ban key, <prefix><rule>@ban:{<client>} (the client's hash tag, so it is
-- on the slot of the client's other keys).
-- ARGV: now_ms (the daemon's wall clock, ms: only to turn admit_ms into a delay), n
-- (refusals to add, >= 1), after, within_ms, ban_ms, factor, max_ms, and optionally
-- admit_ms (when the rule would admit the refused requests again, by the daemon's wall
-- clock; 0 or absent: none) and shift_ms (added to Redis TIME: 0 but in tests, which
-- need a ban's minutes to pass; absent: 0).
--
-- Clock: Redis TIME, read once (plus shift_ms), decides the window of refusals, the
-- ban's start and end, and the key's TTL, so daemons whose wall clocks differ by minutes
-- agree on who is banned and until when. (Before, the daemon's now_ms decided: a ban
-- raised by a daemon two minutes behind had already ended by an accurate daemon's
-- clock.) The ban's end u is Unix ms by Redis's clock; a daemon of a version before it
-- wrote u by its own clock, which agrees where the daemons' clocks are right.
--
-- State, a hash: u = the current (or last) ban's end, ms; c = bans since the count last
-- decayed; w = start of the current `within` window of refusals, ms; r = refusals in it.
-- Semantics of limiter/bans.go (local mode): refusals while banned do not count; the
-- window of refusals starts at the first refusal; after `after` of them a ban starts,
-- lasting ban * factor^c, at most max, and at least until admit_ms (a ban never ends
-- before the refusal that started it would have: obeying its retry must not meet the
-- rule's own refusal); after max without a ban the count decays to 0.
-- The key expires (relative PEXPIRE) once it carries nothing: when the ban has ended and
-- max has passed since, or the refusal window has passed, whichever is later.
--
-- Reply: {until_ms, count, started, now_us}: the end of the ban in force (0 when none),
-- its count, 1 when these refusals started it, and the time they were counted at (Redis
-- TIME plus shift_ms, µs), which the daemon needs to turn until_ms into its own clock.

local key = KEYS[1]
local now, n = tonumber(ARGV[1]), tonumber(ARGV[2])
local after, within, ban = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local factor, max = tonumber(ARGV[6]), tonumber(ARGV[7])
local admit, shift = tonumber(ARGV[8] or '0'), tonumber(ARGV[9] or '0')
if not (now and n and after and within and ban and factor and max and admit and shift) or n < 1 then
  return redis.error_reply('rlsidecar ban.lua: want now_ms, n >= 1, after, within_ms, ban_ms, factor, max_ms[, admit_ms[, shift_ms]]')
end
-- admit_ms, by the daemon's clock, becomes a time by Redis's: the same delay from now.
if admit > 0 then admit = admit - now end
local tm = redis.call('TIME')
local now_us = tonumber(tm[1]) * 1000000 + tonumber(tm[2]) + shift * 1000
now = math.floor(now_us / 1000)
if admit > 0 then admit = now + admit else admit = 0 end

local v = redis.call('HMGET', key, 'u', 'c', 'w', 'r')
local u, c, w, r = tonumber(v[1]) or 0, tonumber(v[2]) or 0, tonumber(v[3]) or 0, tonumber(v[4]) or 0
if u > now then
  return {u, c, 0, now_us}
end
if r == 0 or now - w >= within then
  w, r = now, 0
end
r = r + n
local started = 0
if r >= after then
  if c > 0 and now - u >= max then c = 0 end
  local d = ban * factor ^ c
  if d >= max then d = max end
  d = math.floor(d)
  u = now + d
  if admit > u then u = admit end
  c, r, started = c + 1, 0, 1
end
redis.call('HSET', key, 'u', string.format('%.0f', u), 'c', c, 'w', string.format('%.0f', w), 'r', r)
local keep = w + within
if c > 0 and u + max > keep then keep = u + max end
redis.call('PEXPIRE', key, string.format('%.0f', math.max(keep - now, 1) + 1000))
if started == 1 or u > now then
  return {u, c, started, now_us}
end
return {0, c, 0, now_us}
