-- global.lua: the exact global mode. Decides one request's checks on keys that share a
-- hash slot, atomically, with localbucket's semantics (Limit.Take and Store.Apply), and
-- commits them all-or-nothing.
--
-- Why a script: the read-decide-write of every key must be one atomic step, or two
-- daemons checking the same client at once would both see the last token. Redis runs a
-- script without interleaving anything else, and one call per slot is one round trip.
--
-- Clock: Redis TIME, read once, is the only clock, so daemons with skewed clocks agree on
-- every window. Times are integer microseconds (a double holds integers exactly below
-- 2^53, about 285 years of microseconds). Durations handed back are integer nanoseconds,
-- computed exactly as localbucket computes them from now = TIME*1000 (exact while they
-- are below 2^53 ns, about 104 days; longer ones are rounded by a few ns).
--
-- KEYS: one key per check (a key may repeat: its checks then apply in order).
-- ARGV: 7 values per check, in KEYS order:
--   algorithm (0 token_bucket, 1 sliding_window, 2 fixed_window), requests, window_us,
--   burst (= requests for the windows), emission_ns (token bucket: window/requests in
--   integer ns, rounded down, as localbucket computes it; 0 for the windows), cost
--   (0 = peek: judged as cost 1, consumes nothing), shadow (1 = dry run: never makes the
--   batch fail, and consumes nothing when it would reject).
--
-- Two more algorithms carry the policies of issue #15 (built by global_policies.go),
-- each reusing the ARGV slots it has no use for:
--   3 calendar window: requests, window_us (its length), burst (= requests), and in the
--     emission_ns slot the µs left in the window at the daemon's clock. The daemon
--     computes the window from its time zone and names its start in the key, so every
--     daemon counts one window in one key and the script needs no clock for it; the key
--     expires when the window ends (+1 s). State: n, the count (t = 0, for refund.lua).
--     reset_ns and retry_after_ns count to the window's end.
--   4 token bucket with a delay: as algorithm 0, with the delay in µs in the window_us
--     slot: a take that would pass within the delay passes now (its tokens reserved) and
--     the reply's last value (window_us for the others) is how long to wait, in ns.
--   5 ban check: the key is a penalty rule's ban key (sync.BanKey: the client's slot, so
--     in the call of the client's other keys), the emission_ns slot the daemon's wall
--     clock in ms, cost 0. Refused while the ban it holds (field u, its end in ms, written
--     by ban.lua) is in force, with retry_after_ns to its end and the ban's end (ms) as
--     the last value; never written. A banned client's checks so commit nothing, in the
--     same round trip as the checks themselves.
--
-- State, a hash per key, mirroring localbucket.State:
--   token bucket (GCRA): t = theoretical arrival time, integer µs; f = its sub-µs part in
--     ns (0..999), so the TAT keeps localbucket's nanosecond emission interval exactly
--     instead of drifting by rounding a fractional µs emission on every take.
--   windows: t = start of the current window (µs, aligned to absolute time: now - now %
--     window); n = count in it; p = count of the previous window (sliding only, 0 else).
-- A missing key or field is a fresh key (a full bucket, empty windows). A key is written
-- only when something is consumed, always with PEXPIRE set to when its state carries no
-- information any more, plus 1s, so idle clients vanish.
--
-- All-or-nothing: every check is decided on the state as left by the earlier checks of
-- the call. Only if every non-shadow check is allowed are the new states written; else
-- nothing is written, and each check that was itself allowed reports its key's current
-- state as a peek would (Allowed still 1, retry 0), as Store.Apply does.
--
-- Reply: a flat array of 6 integers per check, in KEYS order: allowed (0/1), impossible
-- (0/1: cost exceeds the capacity, never passes), remaining, reset_ns, retry_after_ns,
-- window_us (the start of the window the check counted in, for refund.lua; 0 for a token
-- bucket).

local floor = math.floor
local TWO52 = 4503599627370496

local tm = redis.call('TIME')
local now = tonumber(tm[1]) * 1000000 + tonumber(tm[2])

-- muldiv returns q = floor(a*b/c) and r = a*b - q*c, exactly, for non-negative integers
-- a, b and c >= 1 with c < 2^52 and q < 2^53 (a*b itself may exceed 2^53).
local function muldiv(a, b, c)
  local bq = floor(b / c)
  local br = b - bq * c
  if br < 0 then
    bq, br = bq - 1, br + c
  elseif br >= c then
    bq, br = bq + 1, br - c
  end
  local q = a * bq
  local p = a * br
  local q2, r = 0, 0
  if p < TWO52 then
    q2 = floor(p / c)
    r = p - q2 * c
    if r < 0 then
      q2, r = q2 - 1, r + c
    elseif r >= c then
      q2, r = q2 + 1, r - c
    end
  else
    -- Binary long multiplication: r stays below 2c, so every step is exact.
    local bit = 1
    while bit * 2 <= a do bit = bit * 2 end
    local rest = a
    while bit >= 1 do
      q2, r = q2 * 2, r * 2
      if r >= c then q2, r = q2 + 1, r - c end
      if rest >= bit then
        rest = rest - bit
        r = r + br
        if r >= c then q2, r = q2 + 1, r - c end
      end
      bit = bit / 2
    end
  end
  return q + q2, r
end

-- ceildiv returns ceil(a*b/c).
local function ceildiv(a, b, c)
  local q, r = muldiv(a, b, c)
  if r > 0 then q = q + 1 end
  return q
end

local function fmt(x) return string.format('%.0f', x) end

-- Token bucket (GCRA). st = {t, f}; works on d = tat - now in ns.
local function take_token(st, requests, burst, e, cost, r, delay)
  delay = delay or 0 -- ns (algorithm 4)
  local tau = burst * e
  local d = 0
  if st.t then d = (st.t - now) * 1000 + st.f end
  if d < 0 then d = 0 end -- tat = max(tat, now)
  local consumed = false
  if cost > burst then
    r.impossible = 1
  else
    local nd = d + math.max(cost, 1) * e
    if nd <= tau + delay then
      r.allowed = 1
      if delay > 0 and nd > tau then r.window = nd - tau end -- the wait (algorithm 4)
      if cost > 0 then d, consumed = nd, true end
    else
      r.retry = nd - tau - delay
    end
  end
  local avail = tau - d
  if avail > 0 then r.remaining = math.min(muldiv(avail, 1, e), burst) end
  r.reset = d
  r.expires = d
  if consumed then
    local us = floor(d / 1000)
    st.t, st.f = now + us, d - us * 1000
  end
  return consumed
end

-- Fixed window. st = {t, n}.
local function take_fixed(st, requests, w, cost, r)
  local t = st.t or 0
  local start = math.max(now, t)
  start = start - start % w
  local count = st.n or 0
  if t < start then count = 0 end
  local consumed = false
  if cost > requests then
    r.impossible = 1
  elseif count <= requests and math.max(cost, 1) <= requests - count then
    r.allowed = 1
    count = count + cost
    consumed = cost > 0
  else
    r.retry = (start + w - now) * 1000
  end
  if count < requests then r.remaining = requests - count end
  if count == 0 then
    r.expires = math.max(start - now, 0) * 1000
  else
    r.reset = (start + w - now) * 1000
    r.expires = r.reset
  end
  r.window = start
  if consumed then st.t, st.n, st.p = start, count, 0 end
  return consumed
end

-- earliest returns, in ns relative to now, the earliest instant t >= from at which the
-- sliding window (start, prev, cur) has an estimate of at most x (localbucket's
-- slidingEarliest). start and from are µs.
local function earliest(w, start, prev, cur, from, x)
  if cur <= x then
    local k = x - cur
    if k >= prev then return (from - now) * 1000 end
    local rmax = ceildiv((k + 1) * 1000, w, prev) - 1
    if rmax > 0 then return math.max((start + w - now) * 1000 - rmax, (from - now) * 1000) end
    return (start + w - now) * 1000
  end
  local rmax = ceildiv((x + 1) * 1000, w, cur) - 1
  return (start + 2 * w - now) * 1000 - rmax
end

-- Sliding window counter. st = {t, n, p}.
local function take_sliding(st, requests, w, cost, r)
  local start = st.t or 0
  local nowc = math.max(now, start)
  local prev, cur = st.p or 0, st.n or 0
  local dt = nowc - start
  if dt >= w then
    if dt < 2 * w then
      prev, cur, start = cur, 0, start + w
    else
      prev, cur, start = 0, 0, nowc - nowc % w
    end
  end
  local est = cur
  if prev ~= 0 then est = est + muldiv(prev, start + w - nowc, w) end
  local consumed = false
  if cost > requests then
    r.impossible = 1
  elseif est <= requests and math.max(cost, 1) <= requests - est then
    r.allowed = 1
    cur, est = cur + cost, est + cost
    consumed = cost > 0
  else
    r.retry = earliest(w, start, prev, cur, nowc, requests - math.max(cost, 1))
  end
  if est < requests then r.remaining = requests - est end
  r.expires = math.max(earliest(w, start, prev, cur, start, 0), 0)
  if est > 0 then r.reset = r.expires end
  r.window = start
  if consumed then st.t, st.n, st.p = start, cur, prev end
  return consumed
end

-- Calendar window (algorithm 3). st = {n}; left = µs to the window's end.
local function take_calendar(st, requests, left, cost, r)
  local count = st.n or 0
  local consumed = false
  if cost > requests then
    r.impossible = 1
  elseif count <= requests and math.max(cost, 1) <= requests - count then
    r.allowed = 1
    count = count + cost
    consumed = cost > 0
  else
    r.retry = left * 1000
  end
  if count < requests then r.remaining = requests - count end
  if count > 0 then r.reset = left * 1000 end
  r.expires = left * 1000
  if consumed then st.t, st.n, st.p = 0, count, 0 end
  return consumed
end

-- Ban check (algorithm 5). st.u = the ban's end, ms; now_ms: the daemon's clock.
local function take_ban(st, now_ms, r)
  local u = st.u or 0
  if u > now_ms then
    r.retry = (u - now_ms) * 1000000
    r.window = u
  else
    r.allowed = 1
  end
  return false
end

local function take(alg, st, requests, w, burst, e, cost, r)
  if alg == 0 then return take_token(st, requests, burst, e, cost, r) end
  if alg == 3 then return take_calendar(st, requests, e, cost, r) end
  if alg == 4 then return take_token(st, requests, burst, e, cost, r, w * 1000) end
  if alg == 5 then return take_ban(st, e, r) end
  if alg == 1 then return take_sliding(st, requests, w, cost, r) end
  if alg == 2 then return take_fixed(st, requests, w, cost, r) end
  return redis.error_reply('rlsidecar global.lua: unknown algorithm ' .. tostring(alg))
end

local function load(key)
  local v = redis.call('HMGET', key, 't', 'f', 'n', 'p', 'u')
  local st = {t = tonumber(v[1]), f = tonumber(v[2]) or 0, n = tonumber(v[3]) or 0, p = tonumber(v[4]) or 0,
    u = tonumber(v[5])} -- u: a ban key's (algorithm 5)
  return st
end

local function copy(st) return {t = st.t, f = st.f, n = st.n, p = st.p} end

local nops = #KEYS
if #ARGV ~= 7 * nops then
  return redis.error_reply('rlsidecar global.lua: want 7 ARGV per key, got ' .. #ARGV .. ' for ' .. nops)
end

local states, firsts, order = {}, {}, {}
local res, ok = {}, true
for i = 1, nops do
  local key = KEYS[i]
  local a = (i - 1) * 7
  local alg, requests, w = tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3])
  local burst, e, cost = tonumber(ARGV[a + 4]), tonumber(ARGV[a + 5]), tonumber(ARGV[a + 6])
  local shadow = ARGV[a + 7] == '1'
  if not states[key] then
    states[key] = load(key)
    firsts[key] = copy(states[key])
    order[#order + 1] = key
  end
  local r = {allowed = 0, impossible = 0, remaining = 0, reset = 0, retry = 0, expires = 0, window = 0}
  local consumed = take(alg, states[key], requests, w, burst, e, cost, r)
  if type(consumed) == 'table' then return consumed end -- an error reply
  if consumed then
    states[key].dirty = true
    states[key].expires = r.expires
    states[key].alg = alg
  end
  if r.allowed == 0 and not shadow then ok = false end
  res[i] = r
end

local out = {}
for i = 1, nops do
  local r = res[i]
  if not ok and r.allowed == 1 then
    -- Nothing is committed: report the key's state before the call as a peek would.
    local a = (i - 1) * 7
    local p = {allowed = 0, impossible = 0, remaining = 0, reset = 0, retry = 0, expires = 0, window = 0}
    take(tonumber(ARGV[a + 1]), copy(firsts[KEYS[i]]), tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3]),
      tonumber(ARGV[a + 4]), tonumber(ARGV[a + 5]), 0, p)
    r = p
    r.allowed, r.retry, r.window = 1, 0, 0
  end
  local j = (i - 1) * 6
  out[j + 1], out[j + 2], out[j + 3] = r.allowed, r.impossible, r.remaining
  out[j + 4], out[j + 5], out[j + 6] = r.reset, r.retry, r.window
end

if ok then
  for _, key in ipairs(order) do
    local st = states[key]
    if st.dirty then
      if st.alg == 0 or st.alg == 4 then
        redis.call('HSET', key, 't', fmt(st.t), 'f', fmt(st.f))
      else
        redis.call('HSET', key, 't', fmt(st.t), 'n', fmt(st.n), 'p', fmt(st.p))
      end
      redis.call('PEXPIRE', key, fmt(math.ceil(st.expires / 1000000) + 1000))
    end
  end
end
return out
