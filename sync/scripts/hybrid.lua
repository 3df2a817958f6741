-- hybrid.lua: one daemon's sync of many keys in hybrid mode, each key atomically (the
-- whole call is): settle what the daemon admitted since its last sync of the key against
-- the grant it held, then, if asked, reserve a new grant, and answer the key's state.
--
-- A grant is a reservation: the units are taken from the key's global state when they
-- are granted, so every other daemon's view already excludes them. At the next sync the
-- daemon reports what it used; the unused part goes back. Units a daemon admitted beyond
-- its grant (on credit, see sync/hybrid_take.go) are added as they are: what was admitted
-- is recorded, never lost; if that overdraws the key, the debt delays its refill.
--
-- The modes of a key's sync (ARGV per key: mode), two of them kinds of grant:
--   0 share: the key's headroom over the next interval (what it can admit now plus the
--     interval's refill) times this daemon's share of the key's demand (a key hot on this
--     daemon, whose demand outran its allowance);
--   1 exact: exactly `demand` units if the key has them now, else none (a request the
--     daemon could not decide locally waits for this answer: the exact mode's decision);
--   2 leave: the daemon's last sync before it stops (demand 0, no grant): it settles as
--     a share sync does, and the daemon, which holds no credit once it is gone, is no
--     longer the key's last user (o) nor owed a reservation of credit (k), so the next
--     daemon to use the key reserves nothing for it.
-- Plus 4 (relimit): the daemon's first sync of the key since a reload changed its limit;
-- plus 8 (first): the daemon has not synced the key before. The syncs that may cut a
-- token bucket's state to a whole burst of this limit (the rescale of t, below).
-- Plus 16 (gone): the entry was evicted by the daemon's key cap, and this sync carries
-- its units once, never sent again: it writes no record, which is the daemon's new entry
-- of the key's, if it has one (its grant is settled against it).
--
-- Redis TIME (microseconds) is the only clock, so daemons with skewed clocks agree.
-- Lua numbers are doubles, exact for integers below 2^53: times stay in microseconds.
--
-- State (a hash; every write sets a TTL, so idle keys vanish): t = GCRA theoretical
-- arrival time, or the current window's start; n = current window count (reservations
-- included); g = the units of grants reserved and not yet settled (a window's: of n; a
-- token bucket's: of how far t runs ahead, forgotten once the bucket is full); p = previous
-- window count; e = demand epoch; dc, dp = total demand of the
-- current and previous epoch, over all daemons; o = the last daemon that used the key
-- and when, "id/N epoch" (N its count of live daemons: see me); x = the epoch until
-- which the key counts as shared (used by more than one daemon within share_epochs; a
-- use by another daemon sets it at least share_epochs ahead, and at most half as much
-- again, so it is rewritten at most every share_epochs ÷ 2 epochs, not at every sync);
-- hx = when the TTL this script last gave the key ends (ms of Redis TIME: PEXPIRE runs
-- only when the TTL must grow, at most every 10 s per key, not at every sync; unknown,
-- so set every time, on a key the global mode also wrote, field gx, which a sync that
-- sets the TTL drops); a token bucket's cut
-- fields, gce, gct, gpe, gpt, gu and gue, as global.lua's (see the cut below);
-- s:<daemon> = that daemon's last sync of the key, "prev_token token grant used window
-- written_s" (written_s not when the sync made the key), written by a sync that changed
-- the key's count or a window's reservations (a sync that settles nothing and reserves
-- nothing leaves the last record: replaying it, or losing its reply, has nothing to
-- count twice); sn, w:* = the bookkeeping of pruning old records (prune_records).
--
-- Syncs are idempotent. Each carries the token of the daemon's last confirmed sync of
-- the key (prev_token) and a fresh one (token). If the record shows the daemon's previous
-- sync was applied but its reply never came back (its prev_token matches ours, its token
-- is not the one we confirmed), the units it settled are not settled again and the grant
-- it reserved is given back. A sync whose token was already applied changes nothing and
-- answers the same grant.
--
-- KEYS: the keys, declared (on a cluster: the keys of the first key's slot, which
-- route the call to its master, all of them so that Redis runs the call only where all
-- are while that slot migrates; the others follow in ARGV).
-- ARGV[1] daemon id; ARGV[2] every number of the call, each a little-endian 64-bit
-- integer (struct.unpack: one string for Redis to hand over, not one per number, which
-- cost a single-key call about a sixth of its time); ARGV[3..] the names of the keys not
-- declared, in order.
-- The numbers: interval_us, replicas, minimum TTL in ms (how long a record must outlive
-- a sync), share_epochs, extra: how many keys are not declared, limits: how many distinct
-- limits the keys have, heartbeat: 0, or (on a standalone Redis) the ttl in ms of a
-- heartbeat this call carries for the daemon (heartbeat.lua's work: the last KEYS entry
-- is then the live-daemons set, not a key to sync); then per limit 4 values: algorithm (0
-- token_bucket, 1 sliding_window, 2 fixed_window), requests, window_us, burst; then per
-- key 9 values:
-- limit (its index among the limits, from 1), used, prev_grant, grant_window (the window
-- start the previous grant was taken in, 0 if none), demand, mode, prev_token, token,
-- age_us (how long ago, by the daemon's clock, the key last admitted a unit not yet
-- synced: units used beyond the grant are charged to a token bucket as of then, and to
-- the window of then, as the exact mode would have charged them). A window's mode plus 32
-- (dated): those units were all admitted before the window of the daemon's view
-- (grant_window) ended, whenever Redis reads them: they count in that window. Dated by
-- age alone, units admitted just before the turn in a sync Redis read just after it were
-- counted whole in the new window (age counts from when the daemon sent the sync). Plus
-- 64 as well (prev): in the window before that one, admitted while the sync that brought
-- the view of the next window was on its way.
-- On a cluster one call carries every key of one master, whatever their slots: old-style
-- scripts (no shebang) may touch keys of other slots that the node serves. A key the node
-- does not serve (its slot moved since the daemon read the slot map) is not touched, and
-- answers grant -1: the daemon keeps its units for the next sync.
-- Returns per key 7 integers (and, after them, the live daemons if the call carries a
-- heartbeat): grant (whole units), remaining, reset_us, retry_us (for a sliding window,
-- in their place: the previous window's count, and the µs gone of the current window), window
-- start (echo it as grant_window next time), avail_milli: the units the key can admit
-- now beyond every reservation, times 1000, negative while it is in debt or its next
-- interval's refill is reserved; and flags: 1 if another daemon used the key within
-- share_epochs (its daemons then admit on grants only, no credit), plus 2 if other
-- daemons hold units reserved (they come back unless used), plus 4 if a
-- token bucket holds units a cut left out (gu) that the answer at this rate does not
-- count: reported by the syncs that read gu (a cut, a relimit), read back into t at the
-- next read at another rate.
-- The libraries as locals: one lookup each per call, not one per use.
local math, string, struct, redis, tonumber = math, string, struct, redis, tonumber
local id = ARGV[1]
local nums = ARGV[2]
local interval, replicas, min_ttl, share_epochs, extra, nlimits, beat_ttl, pos = struct.unpack('<i8i8i8i8i8i8i8', nums)
replicas = math.max(1, replicas)
-- How long a token bucket's grants count as held by other daemons after the key's last
-- reservation (gt, below): ten intervals, a second at the default, the daemons' heldWait.
local held_for = 10 * interval

-- tb_eps is what a token bucket's count of units (a quotient by T, window / requests,
-- of microsecond times near 2^51) is given to make up for the doubles' rounding: up to
-- 2 us worth of refill, at most a thousandth of a unit. Without it a whole count came out
-- a hair short when T is not a whole number of microseconds (7 per 60 s: 3.99999997
-- units left after 3 of 7): remaining one too low, and a request for the last units
-- refused, where the exact mode and the local buckets admit it.
local function tb_eps(T)
  return math.min(1e-3, 2 / T)
end
-- The limits, flat (4 values each, limit j from 4(j-1)+1): one table per call, not one
-- per limit (every table a call makes is garbage the next collection step pays for).
local limits
if nlimits == 1 then
  local a1, a2, a3, a4
  a1, a2, a3, a4, pos = struct.unpack('<i8i8i8i8', nums, pos)
  limits = {a1, a2, a3, a4} -- made at its size
else
  limits = {}
  for j = 0, 4 * (nlimits - 1), 4 do
    limits[j + 1], limits[j + 2], limits[j + 3], limits[j + 4], pos = struct.unpack('<i8i8i8i8', nums, pos)
  end
end
local declared = #KEYS
if beat_ttl > 0 then declared = declared - 1 end
local nkeys = declared + extra
local rfield = 's:' .. id

local tm = redis.call('TIME')
local now = tonumber(tm[1]) * 1000000 + tonumber(tm[2])
local epoch = math.floor(now / interval)

-- Numbers are written with %.17g: Redis would format them with %.14g, losing the
-- microseconds of a timestamp.
local function num(x) return string.format('%.17g', x) end

-- count_at adds units admitted at time at (µs) to a window's counts n (the window that
-- began at t) and p (the one before, a sliding window's), and returns them: units of an
-- older window, or of a fixed window's before, count nowhere now.
local function count_at(at, units, t, window, alg, n, p)
  if at >= t then return n + units, p end
  if alg == 1 and at >= t - window then return n, p + units end
  return n, p
end

-- The fields a key's sync reads (hmget below): its own record, the last user and the
-- shared mark always; the window counts for windows; the demand epochs only when this
-- sync brings demand for a share grant (nothing else reads or writes them). Fewer
-- fields, less work per key. Each list is written out in its call: no table to build
-- and unpack per call (an exact sync is a call of one key).
-- How long a reservation of a previous user's credit (field k) lasts: longer than a
-- daemon may spend credit from one view (creditLife in sync/hybrid_take.go, 50 s), so
-- the credit lapses on the daemon before its reservation lapses here.
local credit_life = 60000000
-- The most a token bucket's uncut units (gu, see the cut below) count for, µs: 2^62 ns,
-- as global.lua and localbucket.Limit.Rescale keep them (about 146 years).
local GU_MAX = 4611686018427387
-- The last user, as this sync records it (%d: see the record): "id/N epoch", N the count
-- of live daemons this sync was sized by (replicas), which sizes that daemon's credit
-- (⌊V ÷ 2N⌋), and so the reservation of it (k) when the key changes hands. By the
-- taker's own count instead, a daemon whose count was a heartbeat old (alone, the others
-- just started) held credit of ⌊V ÷ 2⌋, of which the taker reserved ⌊C ÷ 6⌋: 26
-- admitted of 20 (TestHybridStaleLiveCountCreditReserved). A script before this one
-- wrote "id epoch", and reads "id/N" as another daemon's id, which it is.
local me = string.format('%s/%d %d', id, replicas, epoch)
-- owner parses a last user (o): its daemon id, the count its credit was sized by (nil:
-- written by a script before this one), and its epoch.
local function owner(last)
  local oid, oep = string.match(last, '^(%S+) (%S+)$')
  if not oid then return nil end
  local base, n = string.match(oid, '^(.*)/(%d+)$')
  if base then return base, tonumber(n), tonumber(oep) end
  return oid, nil, tonumber(oep)
end
local now_ms = math.floor(now / 1000)
local now_s = math.floor(now / 1000000)

-- A key's sync records (s:<daemon id>) are read only by their own daemon, at its next sync
-- of the key, to tell a resent sync from a new one and a grant the key gave from one it
-- never did. They live with the key, and a key kept alive by steady use would keep one
-- for every daemon id that ever synced it: one per restart under the default
-- --daemon-id, 60-80 bytes each, for as long as the key is used. So every prune_every-th
-- record of a daemon new to a live key (field sn counts them), the sync that writes it
-- drops the records not written for record_life s, or for as long as the key's state can
-- hold a reservation (a token bucket's burst, a window or two), plus a minute, if that
-- is longer. A daemon retries a lost reply within seconds; a grant is its key's only
-- while its record lasts, and a daemon keeps its view of a key, grant included, until
-- the key is full again. So a record that old is one its daemon has no more use for,
-- unless that daemon kept a grant through that long without Redis; then its next sync
-- counts everything it used since its last confirmed sync, on top of the grant still
-- reserved: too much, never too little. A record without its time (written by a script
-- before this one, whose daemon may still be running it, and would not read a record
-- rewritten with a time) gets a mark, w:<daemon id> = "token s", its token and when a
-- prune first saw it with that token; it is dropped, with its mark, once a prune finds
-- it unchanged for as long. A daemon still running that script rewrites its record with
-- a new token at each sync that changes the key, and keeps it. (Before, one mark, sp,
-- dated when untimed records were first seen, and every one went once it was that old:
-- the records of daemons still running the previous script too, whose grants then stayed
-- reserved in the key, units nobody held, until the key's state let them go.)
local record_life = 600
local prune_every = 16
local function prune_records(key, life)
  life = math.max(record_life, life)
  local all = redis.call('HGETALL', key)
  local stale, marks, untimed, untok, mark = {}, {}, {}, {}, {}
  for j = 1, #all - 1, 2 do
    local name = all[j]
    local pre = string.sub(name, 1, 2)
    if pre == 's:' and name ~= rfield then
      local at = tonumber(string.match(all[j + 1], '^%S+ %S+ %S+ %S+ %S+ (%d+)$'))
      if not at then
        untimed[#untimed + 1] = name
        untok[#untok + 1] = string.match(all[j + 1], '^%S+ (%S+)') or all[j + 1]
      elseif now_s - at > life then
        stale[#stale + 1] = name
      end
    elseif pre == 'w:' then
      marks[name] = all[j + 1]
    elseif name == 'sp' then
      stale[#stale + 1] = name -- an earlier build's one mark for every untimed record
    end
  end
  for k = 1, #untimed do
    local m = 'w:' .. string.sub(untimed[k], 3)
    local mt, mat = nil, nil
    if marks[m] then mt, mat = string.match(marks[m], '^(%S+) (%d+)$') end
    if mt ~= untok[k] or not mat then
      mark[#mark + 1] = m
      mark[#mark + 1] = untok[k] .. ' ' .. now_s
    elseif now_s - tonumber(mat) > life then
      stale[#stale + 1] = untimed[k]
      stale[#stale + 1] = m
    end
    marks[m] = nil
  end
  for j = 1, #all - 1, 2 do -- marks of records gone, or written with a time since
    if marks[all[j]] then stale[#stale + 1] = all[j] end
  end
  -- In chunks: unpack of a long list overflows Lua's stack.
  for j = 1, #mark, 1000 do
    redis.call('HSET', key, unpack(mark, j, math.min(j + 999, #mark)))
  end
  for j = 1, #stale, 1000 do
    redis.call('HDEL', key, unpack(stale, j, math.min(j + 999, #stale)))
  end
end

local out
if nkeys == 1 then out = {0, 0, 0, 0, 0, 0, 0} else out = {} end -- one key: made at its size
for i = 1, nkeys do
  local key = KEYS[i]
  if i > declared then key = ARGV[2 + i - declared] end
  local li, used, prev_grant, grant_window, demand, mode, prev_token, token, age
  li, used, prev_grant, grant_window, demand, mode, prev_token, token, age, pos =
    struct.unpack('<i8i8i8i8i8i8i8i8i8', nums, pos)
  -- Tokens are written into sync records as decimal strings (Lua's %.14g, exact: they
  -- are below 2^32), and a record's tokens compared as numbers: no string made for a
  -- comparison.
  local lb = 4 * (li - 1)
  local alg, requests, window, burst = limits[lb + 1], limits[lb + 2], limits[lb + 3], limits[lb + 4]

  local relimit, first, gone, dated, prev = false, false, false, false, false
  if mode >= 64 then prev, mode = true, mode - 64 end
  if mode >= 32 then dated, mode = true, mode - 32 end
  if mode >= 16 then gone, mode = true, mode - 16 end
  if mode >= 8 then first, mode = true, mode - 8 end
  if mode >= 4 then relimit, mode = true, mode - 4 end
  local win = alg ~= 0
  local h
  if mode == 0 and demand > 0 then
    if win then
      h = redis.pcall('HMGET', key, 't', rfield, 'o', 'x', 'k', 'hx', 'gx', 'n', 'p', 'e', 'dc', 'dp', 'g', 'sn')
    else
      h = redis.pcall('HMGET', key, 't', rfield, 'o', 'x', 'k', 'hx', 'gx', 'e', 'dc', 'dp', 'er', 'g', 'gt', 'sn')
    end
  elseif win then
    h = redis.pcall('HMGET', key, 't', rfield, 'o', 'x', 'k', 'hx', 'gx', 'n', 'p', 'g', 'sn')
  else
    h = redis.pcall('HMGET', key, 't', rfield, 'o', 'x', 'k', 'hx', 'gx', 'er', 'g', 'gt', 'sn')
  end
  if h.err then
    -- not served here (a slot moved): nothing touched
    local r = (i - 1) * 7
    out[r + 1] = -1
    for k = 2, 7 do out[r + k] = 0 end
  else
    local t0 = tonumber(h[1]) -- as read: t, n and p are written only if they change
    local t = t0 or 0
    local rec, last, shared = h[2], h[3], h[4]
    local kres = h[5]
    local hx = tonumber(h[6])
    if h[7] then hx = nil end -- the global mode also sets this key's TTL
    local d = 8 -- where the demand epochs are in h
    local n, p, g = 0, 0, 0
    if win then
      n = tonumber(h[8]) or 0
      p = tonumber(h[9]) or 0
      d = 10
      if mode == 0 and demand > 0 then g = tonumber(h[13]) or 0 else g = tonumber(h[10]) or 0 end
    elseif mode == 0 and demand > 0 then
      g = tonumber(h[12]) or 0
    else
      g = tonumber(h[9]) or 0
    end
    local n0, p0, g0 = n, p, g
    local e = tonumber(h[d]) or 0
    local dc = tonumber(h[d + 1]) or 0
    local dp = tonumber(h[d + 2]) or 0
    -- A token bucket's emission interval t counts in (ns; global.lua's field too), the
    -- last in h.
    local er = nil
    -- And when units were last reserved in g (µs; gt, before sn, the last in h).
    local gt = nil
    if not win then
      if mode == 0 and demand > 0 then er = tonumber(h[11]) else er = tonumber(h[8]) end
      gt = tonumber(h[#h - 1])
    end

    -- What the daemon used beyond (or short of) its last grant. If the key is gone
    -- (expired, or Redis lost its data), so is that grant: everything used counts.
    local settle = used - prev_grant
    if h[1] == false then settle = used end
    -- The window of the daemon's view (a resend replaces grant_window below with the
    -- lost sync's): a dated sync's units beyond the grant were admitted in it.
    local view_window = grant_window
    if prev then view_window = grant_window - window end
    -- The grant this sync settles, which the window's reserved units (g) counted.
    local settled_grant = prev_grant

    -- Idempotency: what did this daemon's last applied sync of this key do?
    local replay, replay_grant, resent = false, 0, false
    local since_lost = 0 -- a resend: the units used since the sync whose reply was lost
    local rp, rt = nil, nil
    if rec then
      rp, rt = string.match(rec, '^(%S+) (%S+) ')
      rp, rt = tonumber(rp), tonumber(rt)
      if rt == token then
        -- this very sync was applied already: change nothing, answer the same grant
        local _, _, rg = string.match(rec, '^(%S+) (%S+) (%S+) ')
        replay, replay_grant = true, tonumber(rg)
        settle, demand = 0, 0
        settled_grant = 0
      elseif rp == prev_token and rt ~= prev_token then
        local _, _, rg, ru, rw = string.match(rec, '^(%S+) (%S+) (%S+) (%S+) (%S+)')
        -- our previous sync was applied but we never got its answer: it settled ru against
        -- prev_grant and reserved rg. Count only what was used since, against rg.
        settle = (used - tonumber(ru)) - tonumber(rg)
        settled_grant = tonumber(rg)
        grant_window = tonumber(rw) -- the window that grant was taken from
        resent = true
        since_lost = used - tonumber(ru)
      end
    end
    -- A grant is this key's only if this key reserved it: the sync that did wrote this
    -- daemon's record with the token the daemon now names as its last confirmed one. A
    -- key without that record (Redis restarted empty, or failed over to a replica that
    -- never saw the sync, and another daemon's sync made the key again since) never gave
    -- the grant: it is forgotten with the state that held it, and everything the daemon
    -- used counts. Taken off, it was taken off the units of the daemons that synced
    -- first: after a restart 100 units counted and 125 admitted against a limit of 100.
    if not replay and not resent and prev_grant > 0 and rt ~= prev_token then
      settle = math.max(0, used)
      settled_grant = 0
    end

    -- Credit a previous user may still hold (k = "owner units until_us"): set when the
    -- key changed hands, cleared when its owner syncs again (then told the key is
    -- shared, so its credit is gone). Until then the other daemons' grants and views
    -- leave those units: exact syncs must not hand out what the owner may admit unseen.
    local res, kown, kset = 0, nil, nil
    if kres then
      local kid, kamt, kuntil = string.match(kres, '^(%S+) (%S+) (%S+)$')
      if kid and tonumber(kuntil) > now then
        -- A script before this one, taking the key over from this one's last user
        -- ("id/N epoch"), reserved under "id/N", which is this daemon too: left standing,
        -- it withheld half the key for a minute, from this daemon's views as well
        -- (TestHybridLegacyTakersReservationDroppedByItsOwner).
        if kid == id or string.match(kid, '^(.*)/%d+$') == id then kset = false else res, kown = tonumber(kamt), kid end
      else
        kset = false
      end
    end

    -- Shared: another daemon used the key lately.
    local x0 = tonumber(shared) or 0 -- as read
    local x = x0
    local o = nil
    local other = false -- another daemon used the key within share_epochs
    if used > 0 or demand > 0 then
      if last and last ~= me then
        local oid, on, oep = owner(last)
        if oid and oid ~= id and oep then
          local recent = oep >= epoch - share_epochs
          if x < epoch and not kown and (recent or (oep + 1) * interval + credit_life > now) then
            -- The key changes hands: its last user was answered "not shared" and may
            -- hold credit, up to a 2N-th of the capacity (growth included; N its count
            -- of the live daemons, recorded with it), that no sync has counted yet.
            -- Reserve it until that daemon syncs again. Also for
            -- a last user whose use is older than share_epochs: its credit lasts
            -- creditLife (50 s) from its view, and before, a daemon that used the key
            -- 11 s earlier then spent 4 on credit that no reservation left it, after
            -- another daemon had taken every unit: 24 admitted of 20
            -- (TestHybridOldUsersCreditReserved). Its reservation lasts no longer than
            -- that credit may (from its last use, plus credit_life).
            local cap = burst
            if alg ~= 0 then cap = requests end
            -- A last user with no count recorded ("id epoch": a daemon running a script
            -- before this one, beside upgraded ones) may hold credit sized by any count,
            -- its own alone too: reserve the most, ⌊C ÷ 2⌋. By the taker's count, an old
            -- daemon still counting itself alone kept ⌊V ÷ 2⌋ of which ⌊C ÷ 6⌋ was
            -- reserved: 26 admitted of 20 (TestHybridLegacyLastUserCreditReserved).
            local c = math.floor(cap / (2 * math.max(1, on or 1)))
            if c > 0 then
              local untl = now + credit_life
              if not recent then untl = (oep + 1) * interval + credit_life end
              res, kown, kset = c, oid, oid .. ' ' .. c .. ' ' .. num(untl)
            end
          end
          if recent then
            other = true
            if x < epoch + share_epochs then x = epoch + share_epochs + math.floor(share_epochs / 2) end
          end
        end
      end
      o = me
    end
    -- Leaving (mode 2): not the key's last user any more; the record of it as the last
    -- user is dropped (below), and so is a reservation of its credit (k: kset false).
    local drop_o = false
    if mode == 2 then
      o = nil
      drop_o = last and owner(last) == id
    end

    -- Demand, per sync epoch of one interval: each daemon adds its own once per epoch.
    local share_demand = 0
    if mode == 0 then share_demand = demand end
    if e == epoch then
      dc = dc + share_demand
    elseif e == epoch - 1 then
      dp = dc
      dc = share_demand
    else
      dp = 0
      dc = share_demand
    end
    local total = math.max(dp, dc)
    -- How many daemons the headroom is shared by, for the cap below. With no complete
    -- epoch of demand yet (a key new to Redis, or a Redis restarted empty), at least two:
    -- a daemon's count of the live daemons is up to a heartbeat old, and one that still
    -- counted itself alone took the whole headroom of a key another daemon was starting
    -- to use, which refused it, as full, until the grant came back a sync later, telling
    -- its clients to retry at the window's end (half an hour on a 1-per-hour window).
    local sharers = replicas
    if dp == 0 then
      sharers = math.max(replicas, 2)
      -- no complete epoch yet: assume every live daemon sees as much as this one
      total = math.max(total, share_demand * sharers)
    elseif other then
      -- Another daemon used the key lately: it is shared, whatever this daemon's count of
      -- the live ones says (up to a heartbeat old) and whatever demand the epochs hold
      -- (another daemon's sync may fall in an epoch of its own). A daemon that counted
      -- itself alone took the whole headroom once an epoch was complete, and the other
      -- refused its clients until the next sync.
      sharers = math.max(replicas, 2)
    end

    local avail, headroom, wstart
    local ern = nil -- a token bucket's emission interval, ns, as global.lua writes it
    local cutf = nil -- the fields of a cut to a whole burst, written with the rest
    -- A token bucket read at another rate or cut (the rare paths): its cut fields (c),
    -- read at another rate (atother), the gu the commit drops (gudrop) or writes (gukept).
    -- gukept: the key's gu after this sync (µs), a cut's: the key holds units beyond its
    -- state at this rate, which the daemon's view of it does not count (flag 4).
    local c, atother, gudrop, gukept = nil, false, false, nil
    if alg == 0 then
      local T = window / requests
      local tau = burst * T
      -- t written at another rate (a reload changed the limit; the window is in the
      -- key): the same units used at this rate, written back with the sync, and cut to
      -- a whole burst below (cut).
      ern = math.floor(window * 1000 / requests)
      local rescaled = false
      atother = er and t0 and math.abs(er - ern) > 1
      if atother or relimit and t0 then
        -- Read at another rate, or the daemon's first sync since its limit changed (the
        -- rare paths): the cut fields too, and what the key's last cut left out (gu,
        -- below): read back into t at another rate, else only reported (flag 4).
        c = redis.call('HMGET', key, 'gce', 'gct', 'gpe', 'gpt', 'gu', 'gue')
        local gu, gue = tonumber(c[5]), tonumber(c[6])
        if atother then
          if t > now then
            t = now + (t - now) * ern / er
            rescaled = true
          end
          if gu then
            gudrop = true
            if gue and gue > 0 and gu > now then
              local tu = now + math.min(gu - now, GU_MAX) * ern / gue
              if tu > t then t, rescaled = tu, true end
            end
          end
        elseif gu and gue and gue > 0 and gu > now then
          gukept = gu -- kept as it is: a cut's, at this rate
        end
      end
      -- Units used beyond the grant were admitted (at the latest) age ago: a full bucket
      -- started refilling then, not now.
      local since = now
      if settle > 0 then since = now - age end
      t = math.max(t, since) + settle * T
      if t < now then t = now end
      -- The grant settled is no longer reserved (g, as a window's). A full bucket holds
      -- nothing that could come back: grants of daemons that never settled them (killed)
      -- are forgotten, not reported as held until the key goes idle.
      g = math.max(0, g - settled_grant)
      if t <= now then g = 0 end
      -- At most a whole burst, as the exact mode and the local buckets read a state
      -- written at another rate (localbucket.Limit.Rescale): a lowering leaves the
      -- bucket empty, refilling at the new rate, not in debt. After the settle: what
      -- the daemon admitted under the old limit and syncs only now counts as used
      -- before the change (charged on top, 15 of 20 lowered to 10, 4 of them synced
      -- after the reload, owed 24 minutes more than the local mode). Only at the
      -- daemon's first sync since its limit changed (relimit), or of a key at another
      -- rate that it has not synced before (first): a reload reaches the daemons at
      -- different times, and until the last has it, the key's syncs alternate between
      -- the two rates. A daemon still on the old limit then reads the units the others
      -- admitted under the new one as they are, over its own limit if they are (it
      -- refuses, as that limit says), and they read them back unchanged. Cut at each
      -- of its syncs, a raise from 10 to 20 forgave 10 units every time the lagging
      -- daemon synced the key, and the others admitted them again. So each daemon cuts
      -- once per change: at most one difference of limits forgiven per daemon and key
      -- (and, at a reload, any debt the key owed; never a debt at the same rate, which
      -- a key new to a daemon keeps).
      --
      -- And at most once per window and rate, as global.lua's rescale_token cuts (same
      -- fields, gce/gct and gpe/gpt: the last two cuts at distinct emissions, ns, and
      -- when, µs): a client whose requests alternate between two plans of one rule moves
      -- its key between two limits at each request, each move a relimit, and a cut at
      -- each sync forgave the difference of the bursts every time (16 of 300 requests
      -- admitted in 3 s under plans of 2 and 1 per hour).
      --
      -- A cut keeps what it leaves out, as global.lua's does (same fields): gu, when
      -- the bucket would be full uncut (µs), counted at emission gue (ns), read by the
      -- next read at another rate (above: the later of t and gu, each at its own
      -- emission) and then dropped. Without it, 30 used of 30 per hour, read at 3 per
      -- hour (a check of a lower plan) and cut to 3, read back at 30 per hour as 3
      -- used: 27 more admitted within the hour (TestHybridPlanFlappingKeepsUnits).
      if (relimit or (first and rescaled)) and t > now + tau then
        if not c then c = redis.call('HMGET', key, 'gce', 'gct', 'gpe', 'gpt', 'gu', 'gue') end
        local ce, ct, pe, pt = tonumber(c[1]), tonumber(c[2]), tonumber(c[3]), tonumber(c[4])
        if not (ce == ern and ct and now - ct < tau or pe == ern and pt and now - pt < tau) then
          local uncut = t
          local gu, gue = tonumber(c[5]), tonumber(c[6])
          if gukept then
            -- A gu at this rate, kept by an earlier cut and not read back since
            uncut = math.max(uncut, now + math.min(gu - now, GU_MAX) * ern / gue)
          end
          uncut = math.ceil(now + math.min(uncut - now, GU_MAX))
          t = now + tau
          if ce and ce ~= ern and ct then
            cutf = {'gce', ern, 'gct', now, 'gpe', ce, 'gpt', ct, 'gu', uncut, 'gue', ern}
          else
            cutf = {'gce', ern, 'gct', now, 'gu', uncut, 'gue', ern}
          end
          gukept, gudrop = uncut, false
        end
      end
      avail = (now + tau - t) / T - res + tb_eps(T)
      headroom = math.min(burst, math.max(0, avail + interval / T))
      wstart = 0
    else
      local start = now - now % window
      if t + window <= start then
        if alg == 1 and t + window == start then p = n else p = 0 end
        n = 0
        g = 0
        t = start
      elseif t == 0 then
        t = start
      end
      -- Settle against the window the grant was taken from; if that window is gone, only
      -- what exceeded the grant still counts: in the window it was admitted in, the last
      -- of it age ago (at the latest), if that window still counts. Charged to the
      -- current window whenever admitted, a unit admitted 35 ms before a fixed window
      -- ended and synced after took a unit of the next window.
      if resent and grant_window ~= t then
        -- A resend in a later window than the lost sync's grant: the daemon never had
        -- that grant (its reply was lost), so what it used since was not drawn from it.
        -- The grant goes back to its window if that still counts; the units count in
        -- the window they were admitted in. Netted against the grant as a grant used
        -- across a boundary is, they were lost with the grant's window: 3 units admitted
        -- in a window of 1 s, resent after a lost sync of the window before that had
        -- reserved 49, counted 0 (TestHybridLostReplyAcrossWindowCountsUnits).
        if alg == 1 and grant_window == t - window then p = math.max(0, p - settled_grant) end
        if since_lost > 0 then
          local at = now - age
          if dated then at = view_window end
          n, p = count_at(at, since_lost, t, window, alg, n, p)
        end
      elseif prev and not replay and not resent then
        -- The units were admitted in the window before the grant's, while the sync that
        -- took the grant was on its way: none was drawn from it. The grant goes back
        -- whole to its window, if that still counts; the units count in theirs. (A
        -- replay changes nothing; a resend settles against the lost sync's grant, above
        -- or below, its units dated by the view's window.)
        if grant_window == t then
          n = math.max(0, n - settled_grant)
          g = math.max(0, g - settled_grant)
        elseif alg == 1 and grant_window == t - window then
          p = math.max(0, p - settled_grant)
        end
        if used > 0 then n, p = count_at(view_window, used, t, window, alg, n, p) end
      elseif grant_window == t then
        n = math.max(0, n + settle)
        g = math.max(0, g - settled_grant)
      elseif alg == 1 and grant_window == t - window and settle <= 0 then
        -- The previous window's grant, not all used: the rest goes back to that window.
        -- (Units beyond it, below, were admitted since: counted by when, not put in the
        -- previous window whenever admitted, which admitted 8 of 6 a sliding window.)
        p = math.max(0, p + settle)
      elseif settle > 0 then
        local at = now - age
        if dated then at = view_window end
        n, p = count_at(at, settle, t, window, alg, n, p)
      end
      wstart = t
      if alg == 2 then
        avail = requests - n - res
        headroom = math.max(0, avail)
      else
        -- The estimate of the sliding window counter, as the exact mode (global.lua)
        -- and the local buckets count it: the previous window's weighted share rounded
        -- down, plus the current window's count.
        local elapsed = now - t
        avail = requests - (math.floor(p * (window - elapsed) / window) + n) - res
        local later = elapsed + interval
        local est2
        if later < window then
          est2 = math.floor(p * (window - later) / window) + n
        else
          -- The interval reaches into the next window, where this window's count weighs
          -- less; but a grant made now is reserved in this window's count and may be
          -- spent at once, so it must fit this window: n + grant within the limit. (Sized
          -- by the next window's estimate, a hot client got limit x (1 + interval ÷
          -- window) every window: 22 of 20 a second.)
          est2 = n
        end
        headroom = math.min(requests, math.max(0, requests - est2 - res))
      end
    end

    local grant = 0
    if replay then
      grant = replay_grant
    elseif mode == 1 then
      if demand > 0 and avail >= demand then grant = demand end
    elseif demand > 0 and headroom >= 1 then
      -- This daemon's share of the headroom, by demand, in whole units (so counts stay
      -- exact). Capped at twice its demand (or an even split of the headroom, if larger),
      -- so a daemon that saw little traffic does not hold budget the others need; at least
      -- one unit when there is one.
      grant = headroom * demand / math.max(total, demand)
      grant = math.min(grant, math.max(2 * demand, headroom / sharers))
      grant = math.min(math.max(1, math.floor(grant)), math.floor(headroom))
    end

    -- Reserve it (a replayed sync reserved it the first time).
    local reserve = grant
    if replay then reserve = 0 end
    local remaining, reset, retry, ttl
    if alg == 0 then
      local T = window / requests
      local tau = burst * T
      t = math.max(t, now) + reserve * T
      g = g + reserve
      if reserve > 0 then gt = false end -- now (written below)
      local left = (now + tau - t) / T - res + tb_eps(T)
      avail = left
      remaining = math.max(0, math.floor(left))
      reset = math.max(0, t - now)
      if left >= 1 then retry = 0 else retry = t - now - tau + T end
      ttl = reset
      if gukept then ttl = math.max(ttl, gukept - now) end -- the key outlives its gu
    else
      n = n + reserve
      g = g + reserve
      avail = avail - reserve
      if alg == 2 then
        remaining = math.max(0, math.floor(requests - n - res))
        if n > 0 then reset = t + window - now else reset = 0 end
        if remaining >= 1 then retry = 0 else retry = t + window - now end
        ttl = window
      else
        local elapsed = now - t
        local est = math.floor(p * (window - elapsed) / window) + n + res
        remaining = math.max(0, requests - est)
        -- When units come back depends on the cost asked (a cost of 2 waits for two of
        -- the previous window's units, at that window's pace): the daemon works reset and
        -- retry out for any cost from the previous window's count and the window's phase,
        -- which it gets in their place.
        reset, retry = p, elapsed
        ttl = 2 * window
      end
    end

    -- Write only what changed (each field costs Redis CPU on every sync): the epoch's
    -- demand only when this sync brought some, n and p only for the windows. Numbers passed
    -- to redis.call are written exactly (the record formats its integers with %d; the
    -- window start goes through num).
    -- (f is made with room for the usual fields: one allocation, not one per doubling.)
    local f = {nil, nil, nil, nil, nil, nil, nil, nil, nil, nil}
    if t ~= t0 or n ~= n0 or p ~= p0 then
      f[1] = 't'; f[2] = t
      if alg ~= 0 then
        f[3] = 'n'; f[4] = n; f[5] = 'p'; f[6] = p
      elseif not er or math.abs(er - ern) > 1 then
        f[3] = 'er'; f[4] = ern
      end
    end
    if g ~= g0 then
      f[#f + 1] = 'g'; f[#f + 1] = g
    end
    if gt == false then
      f[#f + 1] = 'gt'; f[#f + 1] = now
    end
    if cutf then
      for j = 1, #cutf do f[#f + 1] = cutf[j] end
    end
    if share_demand > 0 then
      f[#f + 1] = 'e'; f[#f + 1] = epoch; f[#f + 1] = 'dc'; f[#f + 1] = dc; f[#f + 1] = 'dp'; f[#f + 1] = dp
    end
    if x ~= x0 then
      f[#f + 1] = 'x'; f[#f + 1] = x
    end
    if kset then
      f[#f + 1] = 'k'; f[#f + 1] = kset
    end
    -- A sync that gives a grant's reservation back (g), its units used exactly, is
    -- recorded too: resent after its reply was lost, it took the grant off g again, and
    -- with it other daemons' reservations (TestHybridSettleOnlySyncResentOnce).
    if not replay and not gone and (settle ~= 0 or reserve ~= 0 or resent or (win and settled_grant > 0)) then
      local ws = '0'
      if wstart ~= 0 then ws = num(wstart) end
      f[#f + 1] = rfield
      -- Integers formatted as integers (%d): Lua's own number-to-string (%.14g, what a
      -- concatenation uses) costs several times as much. The same text for every value
      -- below 10^14, so a record reads the same to a daemon running the previous script.
      -- Then when it was written (s of Redis TIME), for prune_records; not by the sync that
      -- makes the key (most keys of a sparse load are synced once: 14 bytes a key in
      -- Redis): such a record is pruned as one without its time, once a prune has seen
      -- it for as long, later than if it had one, and its daemon's next sync that writes
      -- the record gives it its time.
      if t0 then
        f[#f + 1] = string.format('%d %d %d %d %s %d', prev_token, token, grant, used, ws, now_s)
      else
        f[#f + 1] = string.format('%d %d %d %d %s', prev_token, token, grant, used, ws)
      end
      -- A record of a daemon new to a key that lives on: counted, and every 16th such
      -- record the key's stale ones go (see prune_records).
      if not rec and t0 then
        local sn = (tonumber(h[#h]) or 0) + 1
        if sn >= prune_every then
          local span = window -- a fixed window's; a token bucket's burst; two sliding windows
          if alg == 0 then span = burst * window / requests elseif alg == 1 then span = 2 * window end
          prune_records(key, math.ceil(span / 1000000) + 60)
          sn = 0
        end
        f[#f + 1] = 'sn'; f[#f + 1] = sn
      end
    end
    -- Keep the key while it carries state, for the epochs, and for as long as the sync
    -- records must last: need ms from now. The TTL grows only when it ends sooner, and
    -- then by up to 10 s more, so a key synced often is given a TTL every 10 s, not at
    -- every sync (one command less per key, and per exact sync).
    local need = math.ceil(math.max(ttl / 1000, 4 * interval / 1000, min_ttl)) + 1000
    -- A key's first sync (no state yet: most keys of a sparse load are synced once)
    -- writes no hx: it would cost a field and save nothing.
    local expire = nil
    if not hx or hx < now_ms + need then
      if t0 then
        expire = need + math.min(math.floor(need / 2), 10000)
        f[#f + 1] = 'hx'; f[#f + 1] = now_ms + expire
      else
        expire = need
      end
    end
    -- The last user: written with the rest; alone (a sync that changes nothing else,
    -- typically an exact sync refused) only if the key is not already marked shared for
    -- at least share_epochs ÷ 2 more epochs with another daemon's use on record. While it
    -- is, no daemon gets credit, and the first sync past that half writes it again, so
    -- credit is never given to, nor kept from a reservation for, a daemon it would be
    -- otherwise (the refusals of a spread client then cost a read, as in the global mode).
    if o and o ~= last and (#f > 0 or not (other and x >= epoch + math.floor(share_epochs / 2))) then
      f[#f + 1] = 'o'; f[#f + 1] = o
    end
    -- A daemon leaving a key gone from Redis with nothing to count: not made again.
    if mode == 2 and not t0 and settle <= 0 then f, expire = {}, nil end
    -- A question (cost 0: an exact sync asking for no unit) of a key Redis holds
    -- nothing of, with nothing to count: answered from the empty state, not made. Made,
    -- every question on a new key left a hash for 11 s, so a client asking of random
    -- keys filled Redis as a key flood does, where the protocol stores nothing for a
    -- question (TestHybridQuestionOnANewKeyStoresNothing).
    if mode == 1 and demand == 0 and settle == 0 and not h[1] and not rec and not last and not shared and not kres then
      f, expire = {}, nil
    end
    if #f > 0 then redis.call('HSET', key, unpack(f)) end
    if gudrop then redis.call('HDEL', key, 'gu', 'gue') end -- read back into t (atother)
    if kset == false and drop_o then
      redis.call('HDEL', key, 'k', 'o')
    elseif kset == false then
      redis.call('HDEL', key, 'k')
    elseif drop_o then
      redis.call('HDEL', key, 'o')
    end
    if expire then
      redis.call('PEXPIRE', key, expire)
      -- The global mode's gx no longer tells this TTL, which may be shorter: dropped, so
      -- global.lua sets the TTL again at its next take (field o said so too, but a leave
      -- drops o, and the global mode then trusted gx and left the key to expire with its
      -- state in force: TestGlobalTTLAfterHybridLeave).
      if h[7] then redis.call('HDEL', key, 'gx') end
    end
    local r = (i - 1) * 7
    out[r + 1] = grant
    out[r + 2] = remaining
    out[r + 3] = math.floor(reset)
    out[r + 4] = math.floor(retry)
    out[r + 5] = wstart
    out[r + 6] = math.floor(avail * 1000)
    -- Shared while another daemon's credit is reserved, too: at most one daemon holds
    -- credit nobody has counted.
    local flags = 0
    if x >= epoch or kown then flags = 1 end
    -- Units reserved by other daemons (their grants, a previous user's credit), counted
    -- in the window or in how far the bucket's t runs ahead: they come back at those
    -- daemons' next syncs if unused. A refusal for want of them is retried after the
    -- next sync, not at the window's end (a client spread over 3 daemons, at its 84th of
    -- 100 a minute, was told 39 s while its units were reserved, free again within half
    -- a second) nor when the bucket refills (8 an hour, 12 requests at once over 3
    -- daemons: 7 admitted, the rest told 450 s while a unit came free within 200 ms).
    --
    -- Not a token bucket's grants reserved held_for or longer ago (gt): one used exactly,
    -- the usual end of an exact sync, is not reported (a report would cost a periodic
    -- sync where none is made), and its units stay in g until the holder's next sync of
    -- the key or the bucket is full. Counted, a client whose requests rotate over 3
    -- daemons at 3 an hour was told 100 ms at every refusal for up to an hour, where
    -- its next unit was 20 minutes away; now for a second at most after the last
    -- reservation. (A grant still unused after that comes back unannounced: a retry
    -- told the refill is then later than it could be, never earlier.)
    local others = g - grant
    if gt and now - gt >= held_for then others = 0 end
    if math.min(win and n or (t - now) / (window / requests), others + res) >= 1 then flags = flags + 2 end
    -- The key holds units a cut left out (gu): the view, at this rate, does not count
    -- them, and a raise of the daemon's limit must not give them as room.
    if gukept then flags = flags + 4 end
    out[r + 7] = flags
  end
end
if beat_ttl > 0 then
  -- The daemon's heartbeat, as heartbeat.lua does it, riding on this call.
  local dk = KEYS[#KEYS]
  local ms = math.floor(now / 1000)
  redis.call('ZADD', dk, ms, id)
  redis.call('ZREMRANGEBYSCORE', dk, '-inf', ms - beat_ttl)
  redis.call('PEXPIRE', dk, 2 * beat_ttl)
  out[#out + 1] = redis.call('ZCARD', dk)
end
return out
