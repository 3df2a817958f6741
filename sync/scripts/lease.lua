-- lease.lua: concurrency leases in global mode. Releases, renews or queries one lease's
-- slots on keys that share a hash slot, atomically. Slots are taken by global.lua (its
-- algorithm 6), in the script call of the request's other checks of that slot, on the
-- state kept as described here.
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
--   'r' release: part. Reply: the number of live parts removed; when none, -1 if an
--       expired part was there (removed too: it ran out unreleased), else 0 (unknown or
--       already released, through this daemon or another).
--   'n' renew: part, lease_ms. Reply: {parts renewed, the shortest new lease in ms}: all
--       of them, or none (0) when one is no longer live.
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
local per = ({r = 1, n = 2, q = 1})[op]
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
  local n, expired = 0, false
  for i = 1, #KEYS do
    local key, m = KEYS[i], id .. ':' .. arg(i, 1)
    prune(key)
    local s = tonumber(redis.call('ZSCORE', key, m))
    if s then
      redis.call('ZREM', key, m)
      if s > now then n = n + 1 else expired = true end
    end
  end
  if n == 0 and expired then return -1 end
  return n
end

if op == 'n' then
  -- All or none: a lease one of whose parts ran out (or was released) no longer holds
  -- every slot it was given, and renewing the others would tell the gateway it does.
  for i = 1, #KEYS do
    local key = KEYS[i]
    prune(key)
    local s = tonumber(redis.call('ZSCORE', key, id .. ':' .. arg(i, 1)))
    if not s or s <= now then return {0, 0} end
  end
  local first = -1
  for i = 1, #KEYS do
    local key, m, lease = KEYS[i], id .. ':' .. arg(i, 1), tonumber(arg(i, 2))
    redis.call('ZADD', key, 'XX', fmt(now + lease), m)
    keep(key, now + lease)
    if first < 0 or lease < first then first = lease end
  end
  return {#KEYS, math.max(first, 0)}
end

-- Query.
local out = {}
for i = 1, #KEYS do
  local s = tonumber(redis.call('ZSCORE', KEYS[i], id .. ':' .. arg(i, 1)))
  out[i] = s or -1
end
out[#KEYS + 1] = now
return out

