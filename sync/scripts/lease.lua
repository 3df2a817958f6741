-- lease.lua: concurrency leases in global mode. Acquires, releases, renews or queries one
-- lease's slots on keys that share a hash slot, atomically.
--
-- State: a concurrency key is a sorted set of the parts of the leases holding one of its
-- slots, each member "<lease id>:<part>" scored by its expiry (Redis TIME, integer ms).
-- A member whose score is <= now has expired: it holds no slot. Expired members are
-- dropped on every call once they are grace_ms old (ZREMRANGEBYSCORE), not at once, so
-- that the daemon that acquired a lease can still tell, at its next sweep, a lease that
-- expired (its member is there) from one released through another daemon (gone). The
-- key's TTL (PEXPIRE) always covers its latest expiry plus grace_ms, so an idle key
-- vanishes by itself.
--
-- Clock: Redis TIME only, so daemons with skewed clocks agree on every expiry.
--
-- ARGV[1]: the operation; ARGV[2]: the lease id; ARGV[3]: grace_ms. Then per key, in
-- KEYS order:
--   'a' acquire: part, max, lease_ms, take (0 = ask only, hold nothing), shadow (1 = a
--       dry run: never refuses the batch, holds nothing when it does not fit).
--       All-or-nothing: a slot is taken in every key with take=1 only if every
--       non-shadow key has one free. Reply: 3 integers per key: allowed (0/1), remaining
--       (free slots after this call), retry_ms (when refused: until the earliest held
--       part expires, 1..1000; 0 when allowed).
--   'r' release: part. Reply: the number of parts removed (0: unknown, expired or
--       already released).
--   'n' renew: part, lease_ms. Reply: {parts renewed, the shortest new lease in ms}.
--   'q' query: part. Reply: per key, the part's score (its expiry, ms) or -1 when absent;
--       then Redis TIME in ms. Changes nothing.
-- A key may repeat (two rules' parts of one lease cannot share a key, but two parts of an
-- Envoy call may): each part is its own member.

local tm = redis.call('TIME')
local now = tonumber(tm[1]) * 1000 + math.floor(tonumber(tm[2]) / 1000)

local op, id, grace = ARGV[1], ARGV[2], tonumber(ARGV[3])
if not grace or grace < 0 then
  return redis.error_reply('rlsidecar lease.lua: bad grace_ms ' .. tostring(ARGV[3]))
end
local per = ({a = 5, r = 1, n = 2, q = 1})[op]
if not per then
  return redis.error_reply('rlsidecar lease.lua: unknown operation ' .. tostring(op))
end
if #ARGV ~= 3 + per * #KEYS then
  return redis.error_reply('rlsidecar lease.lua: want ' .. per .. ' ARGV per key, got ' .. (#ARGV - 3) .. ' for ' .. #KEYS)
end

local function fmt(x) return string.format('%.0f', x) end

local function prune(key)
  redis.call('ZREMRANGEBYSCORE', key, '-inf', fmt(now - grace))
end

-- keep makes key live at least until expiry + grace.
local function keep(key, expiry)
  local want = expiry - now + grace
  if redis.call('PTTL', key) < want then redis.call('PEXPIRE', key, fmt(want)) end
end

local function arg(i, j) return ARGV[3 + (i - 1) * per + j] end

if op == 'r' then
  local n = 0
  for i = 1, #KEYS do
    local key, m = KEYS[i], id .. ':' .. arg(i, 1)
    prune(key)
    local s = tonumber(redis.call('ZSCORE', key, m))
    if s then
      redis.call('ZREM', key, m)
      if s > now then n = n + 1 end
    end
  end
  return n
end

if op == 'n' then
  local n, first = 0, -1
  for i = 1, #KEYS do
    local key, m, lease = KEYS[i], id .. ':' .. arg(i, 1), tonumber(arg(i, 2))
    prune(key)
    local s = tonumber(redis.call('ZSCORE', key, m))
    if s and s > now then
      redis.call('ZADD', key, 'XX', fmt(now + lease), m)
      keep(key, now + lease)
      n = n + 1
      if first < 0 or lease < first then first = lease end
    end
  end
  return {n, math.max(first, 0)}
end

if op == 'q' then
  local out = {}
  for i = 1, #KEYS do
    local s = tonumber(redis.call('ZSCORE', KEYS[i], id .. ':' .. arg(i, 1)))
    out[i] = s or -1
  end
  out[#KEYS + 1] = now
  return out
end

-- Acquire.
local taking, res, ok = {}, {}, true
for i = 1, #KEYS do
  local key = KEYS[i]
  local max, take, shadow = tonumber(arg(i, 2)), arg(i, 4) == '1', arg(i, 5) == '1'
  prune(key)
  local held = redis.call('ZCOUNT', key, '(' .. fmt(now), '+inf') + (taking[key] or 0)
  local r = {0, 0, 0}
  if held < max then
    r[1], r[2] = 1, max - held
    if take then
      taking[key] = (taking[key] or 0) + 1
      r[2] = r[2] - 1
    end
  else
    local first = redis.call('ZRANGEBYSCORE', key, '(' .. fmt(now), '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
    local retry = 1000
    if first[2] then retry = math.min(math.max(tonumber(first[2]) - now, 1), 1000) end
    r[3] = retry
    if not shadow then ok = false end
  end
  res[i] = r
end

local out = {}
for i = 1, #KEYS do
  local r = res[i]
  if ok and r[1] == 1 and arg(i, 4) == '1' then
    local key, lease = KEYS[i], tonumber(arg(i, 3))
    redis.call('ZADD', key, fmt(now + lease), id .. ':' .. arg(i, 1))
    keep(key, now + lease)
  elseif not ok and r[1] == 1 and arg(i, 4) == '1' then
    r[2] = r[2] + 1 -- nothing taken: report the slots free before this call
  end
  out[#out + 1], out[#out + 2], out[#out + 3] = r[1], r[2], r[3]
end
return out
