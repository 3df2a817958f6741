-- ban.lua: a penalty rule's refusals of one client, and its escalating bans, shared by
-- every daemon on this Redis (hybrid and global modes).
--
-- KEYS[1]: the ban key, <prefix><rule>@ban:{<client>} (the client's hash tag, so it is
-- on the slot of the client's other keys).
-- ARGV: now_ms (the daemon's wall clock: the penalty's windows and bans are judged on it,
-- so tests can inject it; daemons' clocks agree within NTP's error), n (refusals to add,
-- >= 1), after, within_ms, ban_ms, factor, max_ms, and optionally admit_ms (when the
-- rule would admit the refused requests again; 0 or absent: none).
--
-- State, a hash: u = the current (or last) ban's end, ms; c = bans since the count last
-- decayed; w = start of the current `within` window of refusals, ms; r = refusals in it.
-- Semantics of limiter/bans.go (local mode): refusals while banned do not count; the
-- window of refusals starts at the first refusal; after `after` of them a ban starts,
-- lasting ban * factor^c, at most max, and at least until admit_ms (a ban never ends
-- before the refusal that started it would have: obeying its retry must not meet the
-- rule's own refusal); after max without a ban the count decays to 0.
-- The key expires (relative PEXPIRE, so an injected clock works) once it carries
-- nothing: when the ban has ended and max has passed since, or the refusal window has
-- passed, whichever is later.
--
-- Reply: {until_ms, count, started}: the end of the ban in force (0 when none), its count,
-- and 1 when these refusals started it.

local key = KEYS[1]
local now, n = tonumber(ARGV[1]), tonumber(ARGV[2])
local after, within, ban = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local factor, max = tonumber(ARGV[6]), tonumber(ARGV[7])
local admit = tonumber(ARGV[8] or '0')
if not (now and n and after and within and ban and factor and max and admit) or n < 1 then
  return redis.error_reply('rlsidecar ban.lua: want now_ms, n >= 1, after, within_ms, ban_ms, factor, max_ms[, admit_ms]')
end

local v = redis.call('HMGET', key, 'u', 'c', 'w', 'r')
local u, c, w, r = tonumber(v[1]) or 0, tonumber(v[2]) or 0, tonumber(v[3]) or 0, tonumber(v[4]) or 0
if u > now then
  return {u, c, 0}
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
  return {u, c, started}
end
return {0, c, 0}
