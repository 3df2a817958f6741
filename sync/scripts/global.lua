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
--     in the call of the client's other keys), the emission_ns slot a shift in ms added
--     to Redis TIME (0 but in tests), cost 0. Refused while the ban it holds (field u, its
--     end in Unix ms by Redis's clock, written by ban.lua) is in force by Redis TIME, with
--     retry_after_ns to its end and the ban's end (ms) as the last value; never written. A banned client's checks so commit nothing, in the
--     same round trip as the checks themselves.
--   6 concurrency lease slot (sync.LeaseCheck): the key is a concurrency rule's sorted
--     set, exactly as lease.lua keeps it (its header: members "<lease id>:<part>" scored
--     by expiry in Redis TIME ms, expired members dropped once grace_ms old, TTL the
--     latest expiry + grace_ms), so a lease taken here is released, renewed and queried
--     by lease.lua, through any daemon. ARGV: 6, max, lease_ms, the member, grace_ms,
--     take (1: hold a slot; 0: ask only), shadow. Allowed while fewer than max
--     unexpired members (with the slots the request's earlier checks take) hold it;
--     committed, like every check, only if the whole request is allowed: then ZADD the
--     member at now + lease_ms. Reply: allowed, 0, remaining (free slots after the
--     request), and when refused reset_ns = retry_after_ns = until the earliest held
--     slot expires (1 ms .. 1 s), window 0. A request's rate checks and lease slots on
--     one slot are so decided all-or-nothing in one call: a refused rate check holds no
--     slot, a full lease takes nothing.
--
-- State, a hash per key, mirroring localbucket.State:
--   token bucket (GCRA): t = theoretical arrival time, integer µs; f = its sub-µs part in
--     ns (0..999), so the TAT keeps localbucket's nanosecond emission interval exactly
--     instead of drifting by rounding a fractional µs emission on every take; er = the
--     emission interval (ns) t counts in. A check whose emission differs (a reload
--     changed the limit; the window is in the key) reads the same units used at its own
--     rate, and writes that back whether it commits or not (rescale_token). More than a
--     whole burst at its rate is cut to a whole burst (localbucket.Limit.Rescale) only
--     if no cut was made at that emission within the last window: gce = the emission
--     (ns) of the last cut, gct = when (Redis TIME, µs), gpe and gpt the same of the cut
--     before it at another emission, written with it (hybrid.lua's cuts use them too).
--     Else the units are kept, over the burst (the client refused): while
--     a reload has reached some daemons and not others, checks alternate between the
--     rates, and a cut at each forgave a burst each time. A cut keeps what it left out:
--     gu = when the bucket would be full uncut (µs), counted at emission gue (ns), read
--     by the next read at another rate (the later of t and gu) and then dropped, so a
--     rate lowered and raised back (a request of another plan) reads the units used
--     before the cut (hybrid.lua keeps and reads gu the same way). A key with no er
--     (written before there was one) is read as it is.
--   windows: t = start of the current window (µs, aligned to absolute time: now - now %
--     window); n = count in it; p = count of the previous window (sliding only, 0 else).
--   every written key: gx = when the TTL it was last given ends (Redis TIME, integer ms;
--     not x, which hybrid.lua uses: the same rule in both modes shares its keys).
-- A missing key or field is a fresh key (a full bucket, empty windows). A key is written
-- only when something is consumed, with a TTL that covers at least until its state
-- carries no information any more, plus 1s, so idle clients vanish; PEXPIRE runs only
-- when that TTL must grow (see the commit at the end).
--
-- Cost: one HMGET per key read, one HSET per key written, PEXPIRE rarely, and TIME. The
-- commands are cheap (under 1 µs each); the script's own work, in Lua, is most of the
-- cost, so the takes return multiple values rather than building tables.
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
--
-- Batch: the checks of several requests in one call (sync's auto-pipeline sends the
-- requests queued together on a standalone Redis so, see autopipe.go). ARGV[1] =
-- 'batch', ARGV[2] = m, the number of requests, ARGV[3..m+2] = each request's number of
-- keys, then the 7 values per key of every request, in order; KEYS the requests' keys in
-- order. The requests are decided one after another, each all-or-nothing as above on the
-- states the earlier ones left (exactly as m calls in a row), one TIME for all of them.
-- Reply: an array of m replies, each as above. An error reply fails the whole batch, and
-- then nothing is written.

local floor, max, min = math.floor, math.max, math.min
local TWO52 = 4503599627370496
-- The most a token bucket's uncut units (gu, see rescale_token) count for, ns: 2^62, as
-- localbucket.Limit.Rescale keeps them (about 146 years).
local GU_MAX = 4611686018427387904

local tm = redis.call('TIME')
local now = tonumber(tm[1]) * 1000000 + tonumber(tm[2])

-- How long a calendar window's key outlives the window's end by the clock of the daemon
-- that last grew its TTL: the daemons' clock skew it tolerates (see the commit below).
local CALENDAR_GRACE_MS = 60000

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

-- Every take_* returns, for one check: allowed (0/1), impossible (0/1), remaining,
-- reset_ns, retry_after_ns, window (the reply's last value), expires_ns (when the state
-- carries no information any more, relative to now), consumed (boolean); and updates st
-- when consumed. Multiple values, no table: the script runs per check, and Lua's tables
-- are its main cost after the commands.

-- rescale_token reads a token bucket's state st of key, written at emission st.er, at
-- emission e: the units used kept. It returns the new d (tat - now, ns) when it changed
-- st, else nil. More units than a whole burst at e are cut to a whole burst
-- (localbucket.Limit.Rescale: a lowering leaves the bucket empty, not in debt), but only
-- if no cut was made at e within the last window (burst * e) before now. A reload
-- reaches the daemons at different times, and until the last has it the checks of a key
-- alternate between the two rates; cut at each of them, a raise from 10 to 20 per hour
-- forgave 10 units at every check through the daemon still at 10, and the other admitted
-- them again, without bound. Kept, a refused client stays refused at either rate: at
-- most one burst is forgiven per window and rate. The key records its last two cuts at
-- distinct emissions (gce, gct: the last one's emission, ns, and time, µs; gpe, gpt: the
-- one before, at another emission), read only here (the rare path: another rate, and
-- over its burst): both rates of a disagreement may cut, as a bucket with a delay
-- (algorithm 4) holds more than its burst at the rate that wrote it, and with the last
-- cut alone the two cut in turn, admitting every check. cut[key] holds the fields the
-- commit writes. Kept units are capped at max(a whole burst, 2^52 ns, 52 days), so that t
-- stays exact; what the cap leaves out is kept in gu (below), as a cut's is.
--
-- What a cut leaves out is kept in the key, as the local store keeps it in the state's N:
-- gu, the time (µs) the bucket would be full uncut, counted at emission gue (ns). The
-- next read at another rate reads the later of t and gu, each at its own emission, then
-- drops gu (or writes the new one, if it cuts again). Without it, 30 units used at 30 per
-- hour, read at 3 per hour (one check of a lower plan, refused, or a peek), were cut to
-- 3 and read back at 30 per hour as 3 used: 27 more admitted within the hour, where the
-- local mode admits none. Read only here (another rate), with the cut fields.
-- gu_ttl[key]: the uncut time owed (ns), which the key's TTL covers.
local cut, gu_ttl, gf = {}, {}, {}
local function rescale_token(key, st, burst, e)
  local er = st.er
  st.er = e
  if not er or er == e or not st.t then return nil end
  local d = (st.t - now) * 1000 + st.f
  -- gf[key]: the key's cut fields as this call leaves them so far (a batch may read a key
  -- at two rates: two plans, or calls from before and after a reload).
  local g = gf[key]
  if not g then
    local c = redis.call('HMGET', key, 'gce', 'gct', 'gpe', 'gpt', 'gu', 'gue')
    g = {ce = tonumber(c[1]), ct = tonumber(c[2]), pe = tonumber(c[3]), pt = tonumber(c[4]),
      gu = tonumber(c[5]), gue = tonumber(c[6])}
    gf[key] = g
  end
  local gu, gue = g.gu, g.gue
  local dgu = 0
  if gu and gue and gue > 0 and gu > now then dgu = muldiv(min((gu - now) * 1000, GU_MAX), e, gue) end
  if d <= 0 and dgu == 0 then return nil end -- a full bucket is full at any rate (a gu run out says nothing)
  d = max(muldiv(max(d, 0), e, er), dgu)
  local tau = burst * e
  -- keep_gu: what t does not hold of d is kept in gu, at most GU_MAX (as the local store
  -- keeps it, to 2^62 ns), not only 2^52 ns as t: 30 used of 30 per 30 days, read at 3
  -- per 30 days, are 300 days of that rate, and kept as 52 days they read back as 5.2
  -- used (TestGlobalPlanFlappingKeepsLongUnits).
  local kept_gu = false
  local function keep_gu(x)
    x = min(x, GU_MAX)
    g.gu, g.gue = now + math.ceil(x / 1000), e
    gu_ttl[key] = max(gu_ttl[key] or 0, x)
    kept_gu = true
  end
  if d > tau then
    local ce, ct, pe, pt = g.ce, g.ct, g.pe, g.pt
    if ce == e and ct and (now - ct) * 1000 < tau or pe == e and pt and (now - pt) * 1000 < tau then
      if d > TWO52 then
        if d > max(tau, TWO52) then keep_gu(d) end
        d = max(tau, TWO52)
      end
    else
      if ce and ce ~= e and ct then g.pe, g.pt = ce, ct end
      g.ce, g.ct, g.cut = e, now, true
      keep_gu(d)
      d = tau
    end
  end
  if gu and not kept_gu then g.gu, g.gue, g.drop = nil, nil, true end
  if kept_gu or g.drop or g.cut then cut[key] = true end
  local us = floor(d / 1000)
  st.t, st.f = now + us, d - us * 1000
  return d
end

-- cut_fields returns the cut fields the commit writes for key (cut[key] set): those
-- gf[key] holds, as HSET arguments.
local function cut_fields(key)
  local g, f = gf[key], {}
  if g.ce and g.ct then f[#f + 1], f[#f + 2], f[#f + 3], f[#f + 4] = 'gce', g.ce, 'gct', g.ct end
  if g.pe and g.pt then f[#f + 1], f[#f + 2], f[#f + 3], f[#f + 4] = 'gpe', g.pe, 'gpt', g.pt end
  if g.gu and g.gue then f[#f + 1], f[#f + 2], f[#f + 3], f[#f + 4] = 'gu', g.gu, 'gue', g.gue end
  return f
end

-- Token bucket (GCRA). st = {t, f}; works on d = tat - now in ns. delay in ns (algorithm
-- 4; 0 else).
local function take_token(st, burst, e, cost, delay)
  local tau = burst * e
  local d = 0
  if st.t then d = (st.t - now) * 1000 + st.f end
  if d < 0 then d = 0 end -- tat = max(tat, now)
  local allowed, impossible, retry, window, consumed = 0, 0, 0, 0, false
  if cost > burst then
    impossible = 1
  else
    local nd = d + max(cost, 1) * e
    if nd <= tau + delay then
      allowed = 1
      if delay > 0 and nd > tau then window = nd - tau end -- the wait (algorithm 4)
      if cost > 0 then d, consumed = nd, true end
    else
      retry = nd - tau - delay
    end
  end
  -- remaining = floor((tau - d) / e) = burst - ceil(d / e), taken from d: exactly below
  -- 2^52 ns; above it with d a few ns past a whole number of tokens taken for that
  -- number, since past 2^53 ns (a bucket that takes more than 104 days to fill) tau
  -- (burst * e) and d are rounded by a few ns. From tau - d, a full bucket of 151 at 7
  -- per 22,346,737,943 ms was said to hold 150; from d alone, exactly, a bucket of 9 per
  -- 16,380,212,729 ms holding 8 was said to hold 2 after a take of 5 (d rounded a ns past
  -- 6 tokens; the wire audit, TestE2EWireFuzz).
  local remaining = 0
  local used, r
  if d < TWO52 then
    used, r = muldiv(d, 1, e) -- exact: d is whole ns and a fraction here, not rounded
    if r > 0 then used = used + 1 end
  else
    used = math.ceil((d - 4) / e)
  end
  if used < burst then remaining = burst - used end
  if consumed then
    local us = floor(d / 1000)
    st.t, st.f = now + us, d - us * 1000
  end
  return allowed, impossible, remaining, d, retry, window, d, consumed
end

-- Fixed window. st = {t, n}.
local function take_fixed(st, requests, w, cost)
  local t = st.t or 0
  local start = max(now, t)
  start = start - start % w
  local count = st.n
  if t < start then count = 0 end
  local allowed, impossible, retry, consumed = 0, 0, 0, false
  if cost > requests then
    impossible = 1
  elseif count <= requests and max(cost, 1) <= requests - count then
    allowed = 1
    count = count + cost
    consumed = cost > 0
  else
    retry = (start + w - now) * 1000
  end
  local remaining, reset, expires = 0, 0, 0
  if count < requests then remaining = requests - count end
  if count == 0 then
    expires = max(start - now, 0) * 1000
  else
    reset = (start + w - now) * 1000
    expires = reset
  end
  if consumed then st.t, st.n, st.p = start, count, 0 end
  return allowed, impossible, remaining, reset, retry, start, expires, consumed
end

-- earliest returns, in ns relative to now, the earliest instant t >= from at which the
-- sliding window (start, prev, cur) has an estimate of at most x (localbucket's
-- slidingEarliest). start and from are µs.
local function earliest(w, start, prev, cur, from, x)
  if cur <= x then
    local k = x - cur
    if k >= prev then return (from - now) * 1000 end
    local rmax = ceildiv((k + 1) * 1000, w, prev) - 1
    if rmax > 0 then return max((start + w - now) * 1000 - rmax, (from - now) * 1000) end
    return (start + w - now) * 1000
  end
  local rmax = ceildiv((x + 1) * 1000, w, cur) - 1
  return (start + 2 * w - now) * 1000 - rmax
end

-- Sliding window counter. st = {t, n, p}.
local function take_sliding(st, requests, w, cost)
  local start = st.t or 0
  local nowc = max(now, start)
  local prev, cur = st.p, st.n
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
  local allowed, impossible, retry, consumed = 0, 0, 0, false
  if cost > requests then
    impossible = 1
  elseif est <= requests and max(cost, 1) <= requests - est then
    allowed = 1
    cur, est = cur + cost, est + cost
    consumed = cost > 0
  else
    retry = earliest(w, start, prev, cur, nowc, requests - max(cost, 1))
  end
  local remaining, reset = 0, 0
  if est < requests then remaining = requests - est end
  local expires = max(earliest(w, start, prev, cur, start, 0), 0)
  if est > 0 then reset = expires end
  if consumed then st.t, st.n, st.p = start, cur, prev end
  return allowed, impossible, remaining, reset, retry, start, expires, consumed
end

-- Calendar window (algorithm 3). st = {n}; left = µs to the window's end.
local function take_calendar(st, requests, left, cost)
  local count = st.n
  local allowed, impossible, retry, consumed = 0, 0, 0, false
  if cost > requests then
    impossible = 1
  elseif count <= requests and max(cost, 1) <= requests - count then
    allowed = 1
    count = count + cost
    consumed = cost > 0
  else
    retry = left * 1000
  end
  local remaining, reset = 0, 0
  if count < requests then remaining = requests - count end
  if count > 0 then reset = left * 1000 end
  if consumed then st.t, st.n, st.p = 0, count, 0 end
  return allowed, impossible, remaining, reset, retry, 0, left * 1000, consumed
end

-- Ban check (algorithm 5). st.u = the ban's end, ms of Redis's clock; shift: ms added to
-- it (tests).
local function take_ban(st, shift)
  local u = st.u or 0
  local now_ms = floor(now / 1000) + shift
  if u > now_ms then
    return 0, 0, 0, 0, (u - now_ms) * 1000000, u, 0, false
  end
  return 1, 0, 0, 0, 0, 0, 0, false
end

local function take(alg, st, requests, w, burst, e, cost)
  if alg == 0 then return take_token(st, burst, e, cost, 0) end
  if alg == 1 then return take_sliding(st, requests, w, cost) end
  if alg == 2 then return take_fixed(st, requests, w, cost) end
  if alg == 3 then return take_calendar(st, requests, e, cost) end
  if alg == 4 then return take_token(st, burst, e, cost, w * 1000) end
  if alg == 5 then return take_ban(st, e) end
  return redis.error_reply('rlsidecar global.lua: unknown algorithm ' .. tostring(alg))
end

-- state parses a key's HMGET reply (t, f, n, p, u, gx, o, er) into a state. x: the TTL's end
-- as global.lua last set it, unless a hybrid daemon has written the key since (its field
-- o: the same rule in hybrid mode on another daemon, or before a reload), whose PEXPIRE
-- may have shortened the TTL: then x is unknown (nil), and the commit sets the TTL. (A
-- hybrid sync that sets the TTL also drops gx: a daemon leaving the key drops o.)
local function state(v)
  local x = nil
  if not v[7] then x = tonumber(v[6]) end
  return {t = tonumber(v[1]), f = tonumber(v[2]) or 0, n = tonumber(v[3]) or 0, p = tonumber(v[4]) or 0,
    u = tonumber(v[5]), x = x, er = tonumber(v[8]), er0 = tonumber(v[9])} -- u: a ban key's (algorithm 5)
end

-- states: per key, its state as the requests decided so far left it; order: the keys in
-- the order first read. written: per key, the expires_ns and algorithm of its last
-- committed take (nil: not written), and when.
local states, order, written, wrote_at = {}, {}, {}, {}

-- Concurrency lease slots (algorithm 6). held: per lease key, the unexpired members as
-- the requests decided so far left it (read once per call, after dropping the members
-- expired more than grace_ms ago). Scores and TTLs are integer ms, below 2^53: they go to Redis as numbers, and into a
-- string ('(' .. now_ms) with Lua's %.14g, exact for 14 digits (until the year 5138):
-- no string.format, which costs as much as a command here.
local now_ms = floor(now / 1000)
local exclusive_now = '(' .. now_ms
local held = {}

local function lease_held(key, grace)
  local h = held[key]
  if not h then
    redis.call('ZREMRANGEBYSCORE', key, '-inf', now_ms - grace)
    h = redis.call('ZCOUNT', key, exclusive_now, '+inf')
    held[key] = h
  end
  return h
end

-- lease_ask decides one slot of key (ARGV from a), on top of taking[key], the slots of
-- key the request's earlier checks take: allowed (0/1), remaining, retry_ns.
local function lease_ask(key, a, taking)
  local mx, grace = tonumber(ARGV[a + 2]), tonumber(ARGV[a + 5])
  if not mx or not grace or grace < 0 then
    return redis.error_reply('rlsidecar global.lua: bad lease slot ARGV for ' .. key)
  end
  local h = lease_held(key, grace) + (taking[key] or 0)
  if h < mx then
    local left = mx - h
    if ARGV[a + 6] == '1' then left = left - 1 end
    return 1, left, 0
  end
  local first = redis.call('ZRANGEBYSCORE', key, exclusive_now, '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
  local retry = 1000
  if first[2] then retry = min(max(tonumber(first[2]) - now_ms, 1), 1000) end
  return 0, 0, retry * 1000000
end

-- lease_commit holds the slot of the allowed check of key (ARGV from a): its member
-- scored by its expiry, and the key's TTL covering that expiry + grace_ms.
local function lease_commit(key, a)
  local lease, grace = tonumber(ARGV[a + 3]), tonumber(ARGV[a + 5])
  local expiry = now_ms + lease
  redis.call('ZADD', key, expiry, ARGV[a + 4])
  held[key] = held[key] + 1
  local want = lease + grace
  if redis.call('PTTL', key) < want then redis.call('PEXPIRE', key, want) end
end

-- decide decides one request: n checks on KEYS[k0+1..k0+n], ARGV from a0 (7 per check),
-- all-or-nothing on the states left by the earlier requests, and writes its 6 reply
-- values per check to res from index 1. It returns an error reply, or nil.
local function decide(k0, a0, n, res)
  local before -- per key first touched by this request: its state before it
  local ok = true
  local commits -- the consuming checks, to mark written if the request commits
  local taking -- lease slots: per key, the slots the request's allowed checks take
  local slots -- lease slots: the checks that take one, if the request commits
  local carry -- per key: the cost of its earlier refused checks (identical Envoy
  -- descriptors), which a later check on it is decided on top of, so that its retry is
  -- when all of them fit (localbucket's applyWith does the same)
  for i = 1, n do
    local key = KEYS[k0 + i]
    local a = a0 + (i - 1) * 7
    local alg = tonumber(ARGV[a + 1])
    if alg == 6 then
      taking = taking or {}
      local allowed, remaining, retry = lease_ask(key, a, taking)
      if type(allowed) == 'table' then return allowed end -- an error reply
      if allowed == 1 and ARGV[a + 6] == '1' then
        taking[key] = (taking[key] or 0) + 1
        slots = slots or {}
        slots[#slots + 1] = i
      end
      if allowed == 0 and ARGV[a + 7] ~= '1' then ok = false end
      local j = (i - 1) * 6
      res[j + 1], res[j + 2], res[j + 3] = allowed, 0, remaining
      res[j + 4], res[j + 5], res[j + 6] = retry, retry, 0
    else
      local requests, w = tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3])
      local burst, e, cost = tonumber(ARGV[a + 4]), tonumber(ARGV[a + 5]), tonumber(ARGV[a + 6])
      local st = states[key]
      if not st then
        local v = redis.call('HMGET', key, 't', 'f', 'n', 'p', 'u', 'gx', 'o', 'er')
        v[9] = v[8] -- er as read (state's er0): the commit writes er only when it changes
        st = state(v)
        if alg == 0 or alg == 4 then
          local d = rescale_token(key, st, burst, e)
          if d then
            -- Written back whatever this call decides (it consumes nothing), and the
            -- reply rewritten so that a request that commits nothing goes back to it.
            v[1], v[2], v[8] = st.t, st.f, e
            written[key], wrote_at[key] = d, alg
          end
        end
        states[key] = st
        order[#order + 1] = key
        before = before or {}
        before[key] = v -- the HMGET reply: parsed again only when nothing commits
      else
        if (alg == 0 or alg == 4) and st.er and st.er ~= e then
          -- Read before in this call at another rate (an earlier request of a batch, or
          -- an earlier check: two plans, or calls from before and after a reload):
          -- rescaled as a first read is, and so written back whatever this call decides.
          -- Before, it was read as written at its own rate (the same time, not the same
          -- units: TestGlobalBatchReadsEachRate).
          local d = rescale_token(key, st, burst, e)
          if d then
            written[key], wrote_at[key] = max(written[key] or 0, d), alg
          end
        end
        if not (before and before[key]) then
          before = before or {}
          before[key] = {copy = true, t = st.t, f = st.f, n = st.n, p = st.p, u = st.u, x = st.x, er = st.er, er0 = st.er0}
        end
      end
      local carried = carry and carry[key] or 0
      local allowed, impossible, remaining, reset, retry, window, expires, consumed =
        take(alg, st, requests, w, burst, e, cost + carried)
      if type(allowed) == 'table' then return allowed end -- an error reply
      if allowed == 0 then
        carry = carry or {}
        carry[key] = carried + cost
      end
      if consumed then
        commits = commits or {}
        commits[#commits + 1] = key
        commits[#commits + 1] = expires
        commits[#commits + 1] = alg
      end
      if allowed == 0 and ARGV[a + 7] ~= '1' then ok = false end
      local j = (i - 1) * 6
      res[j + 1], res[j + 2], res[j + 3] = allowed, impossible, remaining
      res[j + 4], res[j + 5], res[j + 6] = reset, retry, window
    end
  end
  if ok then
    if commits then
      for c = 1, #commits, 3 do
        local key = commits[c]
        written[key], wrote_at[key] = commits[c + 1], commits[c + 2]
      end
    end
    if slots then
      for _, i in ipairs(slots) do lease_commit(KEYS[k0 + i], a0 + (i - 1) * 7) end
    end
    return nil
  end
  -- Nothing is committed: the request's keys go back to their state before it, and each
  -- check that was itself allowed reports that state as a peek would (a lease slot: the
  -- slots free before the request).
  if before then
    for key, b in pairs(before) do
      if b.copy then
        states[key] = {t = b.t, f = b.f, n = b.n, p = b.p, u = b.u, x = b.x, er = b.er, er0 = b.er0}
      else
        states[key] = state(b)
      end
    end
  end
  for i = 1, n do
    local j = (i - 1) * 6
    local a = a0 + (i - 1) * 7
    if res[j + 1] == 1 and tonumber(ARGV[a + 1]) == 6 then
      res[j + 3] = tonumber(ARGV[a + 2]) - held[KEYS[k0 + i]]
    elseif res[j + 1] == 1 then
      local key = KEYS[k0 + i]
      local b = before[key]
      local st = b.copy and {t = b.t, f = b.f, n = b.n, p = b.p, u = b.u} or state(b)
      local _, impossible, remaining, reset = take(tonumber(ARGV[a + 1]), st,
        tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3]), tonumber(ARGV[a + 4]), tonumber(ARGV[a + 5]), 0)
      res[j + 2], res[j + 3], res[j + 4], res[j + 5], res[j + 6] = impossible, remaining, reset, 0, 0
    end
  end
  return nil
end

local out = {}
if ARGV[1] == 'batch' then
  -- Several requests (see the header): ARGV[2] = m, ARGV[3..m+2] their key counts.
  local m = tonumber(ARGV[2])
  if not m or m < 1 or #ARGV < 2 + m then
    return redis.error_reply('rlsidecar global.lua: bad batch header')
  end
  local nk = 0
  for r = 1, m do
    local n = tonumber(ARGV[2 + r])
    if not n or n < 1 then return redis.error_reply('rlsidecar global.lua: bad batch key count ' .. tostring(ARGV[2 + r])) end
    nk = nk + n
  end
  if nk ~= #KEYS or #ARGV ~= 2 + m + 7 * nk then
    return redis.error_reply('rlsidecar global.lua: batch of ' .. m .. ' requests wants ' .. nk .. ' keys and ' ..
      (2 + m + 7 * nk) .. ' ARGV, got ' .. #KEYS .. ' and ' .. #ARGV)
  end
  local k0, a0 = 0, 2 + m
  for r = 1, m do
    local n = tonumber(ARGV[2 + r])
    local res = {}
    local err = decide(k0, a0, n, res)
    if err then return err end
    out[r] = res
    k0, a0 = k0 + n, a0 + 7 * n
  end
else
  local nops = #KEYS
  if #ARGV ~= 7 * nops then
    return redis.error_reply('rlsidecar global.lua: want 7 ARGV per key, got ' .. #ARGV .. ' for ' .. nops)
  end
  local err = decide(0, 0, nops, out)
  if err then return err end
end

-- Commit what the committed requests consumed. A key's TTL must cover its state's
-- information plus 1 s: ttl ms from now. Its hash keeps in gx the instant (Redis TIME, ms)
-- the TTL it was last given ends, so PEXPIRE runs only when the TTL must grow:
--   - a fixed window's information ends with its window (+1 s), the same instant for
--     every take in it: one PEXPIRE per window, exact;
--   - a token bucket's (its TAT) and a sliding window's grow with every take: the TTL is
--     grown by 1 s + 1/8 more than needed, so a key taken from again and again pays
--     PEXPIRE about once a second (or per eighth of its lifetime), not on every take.
--     An idle key lives at most 1 s + 1/8 of its TTL longer than it must;
--   - a calendar window's end is the daemon's (left, on its wall clock), and daemons'
--     clocks differ: the TTL covers the window's end by this daemon's clock plus
--     CALENDAR_GRACE_MS (not 1 s), so that a daemon whose clock is behind by up to that
--     much still finds the window's count, and, like every other TTL, it only grows.
--     Before, every take set it to its own daemon's end + 1 s: a take on a daemon ahead
--     cut the TTL a daemon behind had set, and the key vanished while the daemon behind
--     still counted that window, which then admitted the whole quota again
--     (limiter/calendar_skew_test.go:TestCalendarGlobalSkewedDaemons).
-- Numbers go to Redis as they are (integers below 2^53 print exactly).
for _, key in ipairs(order) do
  local expires = written[key]
  if expires then
    local st, alg = states[key], wrote_at[key]
    if gu_ttl[key] then expires = max(expires, gu_ttl[key]) end
    local ttl = math.ceil(expires / 1000000) + 1000
    if alg == 3 then ttl = ttl - 1000 + CALENDAR_GRACE_MS end
    local x = st.x
    if x and x >= now_ms + ttl then
      if (alg == 0 or alg == 4) and cut[key] then
        redis.call('HSET', key, 't', st.t, 'f', st.f, 'er', st.er, unpack(cut_fields(key)))
        if not gf[key].gu and gf[key].drop then redis.call('HDEL', key, 'gu', 'gue') end
      elseif (alg == 0 or alg == 4) and st.er ~= st.er0 then
        redis.call('HSET', key, 't', st.t, 'f', st.f, 'er', st.er)
      elseif alg == 0 or alg == 4 then
        redis.call('HSET', key, 't', st.t, 'f', st.f)
      else
        redis.call('HSET', key, 't', st.t, 'n', st.n, 'p', st.p)
      end
    else
      if alg ~= 2 and alg ~= 3 then ttl = ttl + 1000 + floor(ttl / 8) end
      st.x = now_ms + ttl
      if (alg == 0 or alg == 4) and cut[key] then
        redis.call('HSET', key, 't', st.t, 'f', st.f, 'gx', st.x, 'er', st.er, unpack(cut_fields(key)))
        if not gf[key].gu and gf[key].drop then redis.call('HDEL', key, 'gu', 'gue') end
      elseif (alg == 0 or alg == 4) and st.er ~= st.er0 then
        redis.call('HSET', key, 't', st.t, 'f', st.f, 'gx', st.x, 'er', st.er)
      elseif alg == 0 or alg == 4 then
        redis.call('HSET', key, 't', st.t, 'f', st.f, 'gx', st.x)
      else
        redis.call('HSET', key, 't', st.t, 'n', st.n, 'p', st.p, 'gx', st.x)
      end
      redis.call('PEXPIRE', key, ttl)
    end
  end
end
return out
