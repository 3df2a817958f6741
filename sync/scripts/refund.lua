-- refund.lua: gives back what global.lua committed, when a later slot group of the same
-- request rejected.
--
-- Why: a request's global checks on keys of different hash slots (say per user and per
-- IP) are separate global.lua calls, each atomic on its own. All-or-nothing across them is
-- restored by undoing the calls that committed once another one rejected. Between the
-- two, other requests may have taken from the same keys; the refund therefore subtracts
-- the cost rather than restoring an old state, which keeps their takes intact.
--
-- It needs no clock: it undoes a take, it does not decide one.
--
-- KEYS: one key per committed check. ARGV: 5 values per check, in KEYS order:
--   algorithm (0 token_bucket, 1 sliding_window, 2 fixed_window), window_us,
--   emission_ns (token bucket), cost, window_start_us (the window global.lua counted the
--   cost in, from its reply; 0 for a token bucket).
--
-- State layout as in global.lua (t, f for a token bucket; t, n, p for the windows).
--   token bucket: TAT -= cost * emission, in exact µs + ns parts; the emission the
--   key's TAT counts at (its er) when it has one, else the take's.
--   windows: if the key is still in the same window, n -= cost; for a sliding window
--   that has since rolled once, that count is now p, so p -= cost; never below 0. A
--   window that has rolled further no longer counts the cost: nothing to undo.
-- A missing key (expired) has nothing to give back. The TTL is left alone, and with it
-- field gx (the TTL's end, see global.lua): a refund only makes the state expire sooner,
-- so the TTL set by global.lua stays long enough. Numbers go to Redis as they are
-- (integers below 2^53 print exactly, as global.lua writes them).
--
-- A concurrency lease slot that global.lua took (its algorithm 6) is given back by
-- removing its member: ARGV 6, the member, 0, 0, 0.
--
-- Reply: the number of checks refunded.

local floor = math.floor

if #ARGV ~= 5 * #KEYS then
  return redis.error_reply('rlsidecar refund.lua: want 5 ARGV per key, got ' .. #ARGV .. ' for ' .. #KEYS)
end

local done = 0
for i = 1, #KEYS do
  local key = KEYS[i]
  local a = (i - 1) * 5
  local alg, w, e = tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3])
  local cost, start = tonumber(ARGV[a + 4]), tonumber(ARGV[a + 5])
  if alg == 6 then
    done = done + redis.call('ZREM', key, ARGV[a + 2]) -- a lease slot: its member
  else
    local v = redis.call('HMGET', key, 't', 'f', 'n', 'p', 'er')
    local t = tonumber(v[1])
    if t and cost > 0 then
      if alg == 0 then
        -- The TAT counts at the emission of the key's last read (global.lua's er): a
        -- check of another plan, or after a reload, since the take read it at its own
        -- rate. The units taken are given back at that rate (TestGlobalRefundAtTheKeysRate).
        local er = tonumber(v[5])
        if er and er > 0 then e = er end
        local eus = floor(e / 1000)
        local f = (tonumber(v[2]) or 0) - cost * (e - eus * 1000)
        t = t - cost * eus
        local carry = floor(f / 1000)
        t, f = t + carry, f - carry * 1000
        redis.call('HSET', key, 't', t, 'f', f)
        done = done + 1
      elseif t == start then
        redis.call('HSET', key, 'n', math.max((tonumber(v[3]) or 0) - cost, 0))
        done = done + 1
      elseif alg == 1 and t == start + w then
        redis.call('HSET', key, 'p', math.max((tonumber(v[4]) or 0) - cost, 0))
        done = done + 1
      end
    end
  end
end
return done
