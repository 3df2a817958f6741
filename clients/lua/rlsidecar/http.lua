-- rlsidecar.http: a decision as HTTP, exactly as the Go client writes it
-- (clients/go/http.go; the rules in clients/go/README.md, "HTTP mapping"; the cases in
-- clients/testdata/http_headers.json, which test/unit.lua checks).
--
-- A decision is the table the clients return: allowed, rule, limit, remaining,
-- reset_ms, retry_after_ms, reason, degraded, rules = {{name, limit, window_ms,
-- remaining, reset_ms, retry_after_ms, allowed, shadow, unasked, concurrency}, ...}, and unreachable = true
-- when the client applied its policy because the sidecar gave no answer. Numbers may be
-- Lua integers or floats (lua-mpack and cjson give floats); they print the same.
--
-- Pure functions: safe under nginx, HAProxy and plain Lua 5.1-5.4.

local byte, char, sub, format, concat = string.byte, string.char, string.sub, string.format, table.concat
local floor = math.floor

local M = {}

-- PROBLEM_TYPE is the "type" of the problem+json bodies (RFC 9457 "about:blank": the
-- problem is what the status says; "rule" and "retry_after" carry the details).
M.PROBLEM_TYPE = "about:blank"

local REASON_COST_EXCEEDS_CAPACITY = "cost_exceeds_capacity"

-- REQUEST_TOO_LARGE is the reason of a decision refusing a request too large to be
-- checked (its frame over max_frame: not sent, or refused by the daemon with
-- frame_too_large); rejection answers it with 431.
local REQUEST_TOO_LARGE = "request_too_large"
M.REQUEST_TOO_LARGE = REQUEST_TOO_LARGE

-- too_large_code reports whether a daemon's error code says the request is too large to
-- check: its frame (frame_too_large, the daemon's --max-frame is smaller) or one of its
-- values (attr_too_large, longer than the daemon's --max-attr-len). Both are answered
-- with 431 whatever the policy: a long path or header is the HTTP client's doing, and
-- under "open" the policy let such requests past every limit.
function M.too_large_code(code)
  return code == "frame_too_large" or code == "attr_too_large"
end

-- busy_code reports whether a daemon's error code says it cannot serve the request now
-- (too_many_connections, shutting_down): the daemon's state, like an unreachable one, not
-- a fault in what was sent; logged at warn, not as an error.
function M.busy_code(code)
  return code == "too_many_connections" or code == "shutting_down"
end

-- busy_error reports whether msg, a client's error string for an error answer
-- ("rlsidecar: CODE: message"), has a busy_code.
function M.busy_error(msg)
  return type(msg) == "string" and M.busy_code(msg:match("^rlsidecar: ([%w_]+):"))
end

-- gate returns a log gate: gate(now), now in seconds, returns nil when a line was let
-- through less than every seconds ago (the line is not to be written), else how many were
-- held back since the last one. A daemon away, or past its connection cap, fails every
-- request: one line each was about 48,000 lines in 6 s at 8,000 requests/s.
function M.gate(every)
  local last, held = -math.huge, 0
  return function(now)
    if now - last < every then
      held = held + 1
      return nil
    end
    last = now
    local n = held
    held = 0
    return n
  end
end

-- held_note is what a gated line adds for the n lines held back before it.
function M.held_note(n)
  if n == 0 then
    return ""
  end
  return " (and " .. n .. " more like it in the last second, not logged)"
end

local function int(n)
  return format("%.0f", n)
end

-- ceil_seconds rounds milliseconds up to whole seconds; 0 or less is 0.
local function ceil_seconds(ms)
  if ms == nil or ms <= 0 then
    return 0
  end
  return floor((ms + 999) / 1000)
end

local function retry_after_seconds(d)
  local s = ceil_seconds(d.retry_after_ms)
  if s < 1 then s = 1 end
  return s
end

-- sf_string is s as an RFC 8941 string: \ and " escaped, any byte outside printable
-- ASCII replaced with _.
local function sf_string(s)
  return '"' .. s:gsub('[\\"]', "\\%0"):gsub("[^\32-\126]", "_") .. '"'
end

-- append_item adds the items of a rule named name (window_ms nil: not known, no w; cur
-- nil: its RateLimit-Policy item alone) whose figures (remaining, allowed, reset_ms,
-- retry_after_ms) are f's. t is the draft's time
-- until more quota is made available, which a Retry-After is never earlier than: a
-- refusing rule's retry (none when no retry can pass it), an allowing rule's reset.
-- A concurrency rule's (concurrency true) quota is of concurrent requests, with no window:
-- qu="concurrent-requests", no w, and, allowing, no t (nothing says when a slot frees).
local function append_item(pol, cur, name, limit, window_ms, f, concurrency)
  local q = sf_string(name) .. ";q=" .. int(limit)
  if concurrency then
    q = q .. ';qu="concurrent-requests"'
  elseif window_ms then
    local w = ceil_seconds(window_ms)
    if w < 1 then w = 1 end
    q = q .. ";w=" .. int(w)
  end
  pol[#pol + 1] = q
  if not cur then return end
  local c = sf_string(name) .. ";r=" .. int(f.remaining or 0)
  if f.allowed and concurrency then
    -- no t
  elseif f.allowed then
    c = c .. ";t=" .. int(ceil_seconds(f.reset_ms))
  elseif (f.retry_after_ms or 0) > 0 then
    c = c .. ";t=" .. int(ceil_seconds(f.retry_after_ms))
  end
  cur[#cur + 1] = c
end

-- deciding_rule returns the index in rules of the deciding rule of d, nil when none carries
-- its name: the first non-shadow entry named d.rule whose figures are the top-level ones
-- (the deciding rule's), else the first non-shadow entry of that name. Names need not be
-- unique: inline limits without a name are named by their key, so two limits on one key
-- (10 per second and 3 per minute) share a name, and the first is not always the one
-- that decided.
local function deciding_rule(d, rules)
  local first
  for i, r in ipairs(rules) do
    if not r.shadow and r.name == d.rule then
      if (r.allowed == true) == (d.allowed == true) and (r.limit or 0) == (d.limit or 0)
          and (r.remaining or 0) == (d.remaining or 0) and (r.reset_ms or 0) == (d.reset_ms or 0)
          and (r.retry_after_ms or 0) == (d.retry_after_ms or 0) then
        return i
      end
      first = first or i
    end
  end
  return first
end

-- least_room returns the index in rules of the rule an allowed d lists first: of the
-- non-shadow rules with as little remaining as the deciding rule (rules[decided]), the one
-- with the longest reset_ms, the most restrictive; among those, the deciding rule, else
-- the first in rules. The daemon's deciding rule, when allowed, is the first with the
-- least remaining: with per-second and per-day both at 1 left, per-second, and a client
-- reading only the first item of RateLimit would miss the daily limit.
local function least_room(rules, decided)
  local best = decided
  for i, r in ipairs(rules) do
    local b = rules[best]
    if not r.shadow and r.unasked ~= true and (r.remaining or 0) == (b.remaining or 0)
        and (r.reset_ms or 0) > (b.reset_ms or 0) then
      best = i
    end
  end
  return best
end

-- headers returns the rate-limit headers of d as a table name -> value:
--   RateLimit-Policy and RateLimit when d has a deciding rule, one item per non-shadow
--   rule, the deciding rule first (built from the top-level fields, without w, when
--   d.rules lacks it; when d allows, of the rules tied with it on remaining, the one
--   with the longest reset_ms comes first: least_room), and for a rule with unasked =
--   true (the request was refused before its store was asked: its remaining and
--   reset_ms of 0 were not read) a RateLimit-Policy item but no RateLimit item; a rule
--   with concurrency = true (a concurrency rule: limit is its max in flight) is a quota
--   of "concurrent-requests" with no w, and a t only when it refused with a retry hint;
--   RateLimit-Warning (rlsidecar's own header, not in the draft) when
--   d allows and some non-shadow rule warns (warn_at): those rules' names in the order of
--   d.rules, quoted as in RateLimit-Policy, "per-user", "per-ip";
--   Retry-After (seconds, at least 1) when d rejects, except when
--   d.reason is cost_exceeds_capacity or request_too_large (no retry can pass).
-- A decision where nothing matched gets no RateLimit fields.
function M.headers(d)
  local h = {}
  local rules = d.rules or {}
  if d.rule ~= nil and d.rule ~= "" then
    local pol, cur, decided = {}, {}, deciding_rule(d, rules)
    if decided and d.allowed then decided = least_room(rules, decided) end
    if decided then
      local r = rules[decided]
      append_item(pol, cur, r.name, r.limit, r.window_ms, r, r.concurrency == true)
    else
      append_item(pol, cur, d.rule, d.limit, nil, d)
    end
    for i, r in ipairs(rules) do
      -- An unasked rule's figures were not read: its quota stays in RateLimit-Policy, the
      -- same from one response to the next, but it has no RateLimit item.
      if not r.shadow and i ~= decided then
        append_item(pol, r.unasked ~= true and cur or nil, r.name, r.limit, r.window_ms, r, r.concurrency == true)
      end
    end
    h["RateLimit-Policy"] = concat(pol, ", ")
    h["RateLimit"] = concat(cur, ", ")
  end
  if d.allowed then
    local warn = {}
    for _, r in ipairs(rules) do
      if r.warning == true and not r.shadow then warn[#warn + 1] = sf_string(r.name) end
    end
    if #warn > 0 then h["RateLimit-Warning"] = concat(warn, ", ") end
  end
  if not d.allowed and d.reason ~= REASON_COST_EXCEEDS_CAPACITY and d.reason ~= REQUEST_TOO_LARGE then
    h["Retry-After"] = int(retry_after_seconds(d))
  end
  return h
end

-- utf8_len returns the length of the valid UTF-8 sequence at s[i], or nil.
local function utf8_len(s, i)
  local c = byte(s, i)
  local n, min
  if c >= 0xc2 and c <= 0xdf then n, min = 2, 0x80
  elseif c >= 0xe0 and c <= 0xef then n, min = 3, 0x800
  elseif c >= 0xf0 and c <= 0xf4 then n, min = 4, 0x10000
  else return nil end
  local cp = c % (2 ^ (7 - n))
  for k = 1, n - 1 do
    local cc = byte(s, i + k)
    if not cc or cc < 0x80 or cc > 0xbf then return nil end
    cp = cp * 64 + (cc - 0x80)
  end
  if cp < min or cp > 0x10ffff or (cp >= 0xd800 and cp <= 0xdfff) then return nil end
  return n, cp
end

-- NOT_PRINTABLE are the ranges of assigned code points above U+007F that Go's
-- unicode.IsPrint rejects (separators other than U+0020, C1 controls, format characters,
-- private use), all of them as of Go's Unicode 15.0.0; strconv.Quote escapes them.
-- Unassigned code points are not listed: Go escapes them too, so a name holding one
-- (U+0378) is quoted differently here. (Before, U+0890-U+0891, U+08E2, U+110BD, U+110CD,
-- U+13430-U+1343F, U+1BCA0-U+1BCA3, U+1D173-U+1D17A and the tags U+E0001 and
-- U+E0020-U+E007F were missing: kept as they are where the other clients escape them;
-- vector name-format-characters.)
local NOT_PRINTABLE = {
  { 0x80, 0xa0 }, { 0xad, 0xad }, { 0x600, 0x605 }, { 0x61c, 0x61c }, { 0x6dd, 0x6dd },
  { 0x70f, 0x70f }, { 0x890, 0x891 }, { 0x8e2, 0x8e2 }, { 0x1680, 0x1680 },
  { 0x180e, 0x180e }, { 0x2000, 0x200f }, { 0x2028, 0x202f }, { 0x205f, 0x2064 },
  { 0x2066, 0x206f }, { 0x3000, 0x3000 }, { 0xd800, 0xf8ff }, { 0xfeff, 0xfeff },
  { 0xfff9, 0xfffb }, { 0x110bd, 0x110bd }, { 0x110cd, 0x110cd }, { 0x13430, 0x1343f },
  { 0x1bca0, 0x1bca3 }, { 0x1d173, 0x1d17a }, { 0xe0001, 0xe0001 }, { 0xe0020, 0xe007f },
  { 0xf0000, 0x10ffff },
}

local function go_printable(cp)
  for _, r in ipairs(NOT_PRINTABLE) do
    if cp >= r[1] and cp <= r[2] then
      return false
    end
  end
  return true
end

local GO_QUOTE_ESC = { [7] = "\\a", [8] = "\\b", [12] = "\\f", [10] = "\\n", [13] = "\\r", [9] = "\\t", [11] = "\\v" }

-- go_quote is Go's strconv.Quote (the detail message quotes the rule as Go does): \"
-- \\ and C escapes, \xNN for other control bytes and invalid UTF-8, \uXXXX for the
-- non-printable characters of NOT_PRINTABLE; other characters are kept.
local function go_quote(s)
  local out, i = { '"' }, 1
  while i <= #s do
    local c = byte(s, i)
    if c == 34 or c == 92 then
      out[#out + 1] = "\\" .. char(c); i = i + 1
    elseif c >= 32 and c < 127 then
      out[#out + 1] = char(c); i = i + 1
    elseif c < 128 then
      out[#out + 1] = GO_QUOTE_ESC[c] or format("\\x%02x", c); i = i + 1
    else
      local n, cp = utf8_len(s, i)
      if n and not go_printable(cp) then
        out[#out + 1] = format(cp < 0x10000 and "\\u%04x" or "\\U%08x", cp); i = i + n
      elseif n then
        out[#out + 1] = sub(s, i, i + n - 1); i = i + n
      else
        out[#out + 1] = format("\\x%02x", c); i = i + 1
      end
    end
  end
  out[#out + 1] = '"'
  return concat(out)
end

local JSON_ESC = { [34] = '\\"', [92] = "\\\\", [10] = "\\n", [13] = "\\r", [9] = "\\t",
  [60] = "\\u003c", [62] = "\\u003e", [38] = "\\u0026" }

-- json_string is s as Go's encoding/json writes it (HTML-safe): <, >, & as \u00XX,
-- control bytes as \u00XX, U+2028/9 escaped, invalid UTF-8 as \ufffd.
local function json_string(s)
  local out, i = { '"' }, 1
  while i <= #s do
    local c = byte(s, i)
    if JSON_ESC[c] then
      out[#out + 1] = JSON_ESC[c]; i = i + 1
    elseif c < 32 then
      out[#out + 1] = format("\\u%04x", c); i = i + 1
    elseif c < 128 then
      out[#out + 1] = char(c); i = i + 1
    else
      local n, cp = utf8_len(s, i)
      if not n then
        out[#out + 1] = "\\ufffd"; i = i + 1
      elseif cp == 0x2028 or cp == 0x2029 then
        out[#out + 1] = format("\\u%04x", cp); i = i + n
      else
        out[#out + 1] = sub(s, i, i + n - 1); i = i + n
      end
    end
  end
  out[#out + 1] = '"'
  return concat(out)
end

local function seconds(n)
  if n == 1 then
    return "1 second"
  end
  return int(n) .. " seconds"
end

local UNAVAILABLE_BODY = '{"type":"about:blank","title":"Service Unavailable","status":503,'
  .. '"detail":"The rate limiter is unavailable and this service does not admit requests without it; retry in 1 second.",'
  .. '"retry_after":1}'

local TOO_LARGE_BODY = '{"type":"about:blank","title":"Request Header Fields Too Large","status":431,'
  .. '"detail":"This request\'s attributes (its path or header fields) are too large for the rate limiter to check."}'

-- BAD_COST_BODY is the problem+json body of the 400 the gateways answer for a request whose
-- cost (a cost function's result, HAProxy's txn.rlsidecar_cost) is not a non-negative
-- integer: whatever the policy, since under "open" the policy would let such a request
-- past every limit, and a cost taken from a header is the HTTP client's to choose.
M.BAD_COST_BODY = '{"type":"about:blank","title":"Bad Request","status":400,'
  .. '"detail":"This request\'s cost is not a non-negative integer."}'

-- bad_cost reports whether cost, a request's cost as a gateway computed it, is not one
-- the client can send: nil (the default, 1) and integers from 0 are (past 2^53 too:
-- sent as 2^53); negative, fractional, NaN, infinite and non-numbers are not.
function M.bad_cost(cost)
  if cost == nil then
    return false
  end
  return type(cost) ~= "number" or cost ~= cost or cost < 0 or cost == math.huge or floor(cost) ~= cost
end

-- rejection returns the response for a decision that does not allow the request:
-- status, headers (a table name -> value, Content-Type included) and body:
--   - rejected by the sidecar: 429, the headers of M.headers, and a problem+json body
--     with the members "rule" and "retry_after" (seconds; absent when no retry can pass);
--   - no decision from the sidecar under the closed policy (d.unreachable, or d.cause
--     set by an error answer): 503, Retry-After: 1, and a problem+json body saying the
--     rate limiter is unavailable;
--   - too large to be checked (d.reason request_too_large): 431 and a problem+json body,
--     no rate-limit headers.
function M.rejection(d)
  if d.reason == REQUEST_TOO_LARGE then
    return 431, { ["Content-Type"] = "application/problem+json" }, TOO_LARGE_BODY
  end
  if d.unreachable or d.cause then
    return 503, { ["Retry-After"] = "1", ["Content-Type"] = "application/problem+json" }, UNAVAILABLE_BODY
  end
  local h = M.headers(d)
  h["Content-Type"] = "application/problem+json"
  local rule = d.rule or ""
  local limit = "the rate limit"
  if rule ~= "" then
    limit = "rate limit " .. go_quote(rule)
  end
  local detail, retry
  if d.reason == REASON_COST_EXCEEDS_CAPACITY then
    detail = "This request costs more than " .. limit .. " can ever admit: it can never pass under this limit."
  else
    retry = retry_after_seconds(d)
    detail = "This request exceeds " .. limit .. "; retry in " .. seconds(retry) .. "."
  end
  local body = { '{"type":"about:blank","title":"Too Many Requests","status":429,"detail":', json_string(detail) }
  if rule ~= "" then
    body[#body + 1] = ',"rule":' .. json_string(rule)
  end
  if retry then
    body[#body + 1] = ',"retry_after":' .. int(retry)
  end
  body[#body + 1] = "}"
  return 429, h, concat(body)
end

-- octet: whether s is a dotted quad's part as written canonically (0-255, no leading 0).
local function octet(s)
  return #s <= 3 and (s == "0" or s:sub(1, 1) ~= "0") and tonumber(s) <= 255
end

-- peer_ip returns the ip attribute every client sends for a peer address (without a
-- port): addr itself, except that an IPv4-mapped IPv6 address ("::ffff:" in any case
-- before a dotted quad) is sent as the IPv4 address it maps. An IPv4 client of a
-- dual-stack listener (nginx `listen [::]:80 ipv6only=off`, HAProxy `bind :::80 v4v6`)
-- may be seen as "::ffff:203.0.113.7", which the Go client sends as "203.0.113.7": one
-- form, one key per client whichever gateway asks (clients/testdata/ips.json). nil is "".
function M.peer_ip(addr)
  if addr == nil then
    return ""
  end
  if #addr > 7 and addr:sub(1, 7):lower() == "::ffff:" then
    local a, b, c, d = addr:match("^(%d+)%.(%d+)%.(%d+)%.(%d+)$", 8)
    if a and octet(a) and octet(b) and octet(c) and octet(d) then
      return addr:sub(8)
    end
  end
  return addr
end

-- policy_decision is the decision a client returns when the sidecar gave no answer:
-- allowed under "open", rejected (503) under "closed"; degraded and unreachable either
-- way, cause saying why.
function M.policy_decision(on_unavailable, cause)
  return {
    allowed = on_unavailable ~= "closed",
    rule = "", limit = 0, remaining = 0, reset_ms = 0, retry_after_ms = 0,
    rules = {}, degraded = true, unreachable = true, cause = cause,
  }
end

-- too_large_decision is the decision of a request too large to be checked: refused (431)
-- whatever the policy, since under "open" the policy would let any request through
-- unlimited, given a huge header; neither degraded nor unreachable; cause says why.
function M.too_large_decision(cause)
  return {
    allowed = false,
    rule = "", limit = 0, remaining = 0, reset_ms = 0, retry_after_ms = 0,
    rules = {}, degraded = false, unreachable = false, reason = REQUEST_TOO_LARGE, cause = cause,
  }
end

-- MIN_RENEWAL_MS is the shortest wait, in ms, between two renewals of a lease.
M.MIN_RENEWAL_MS = 10

-- first_renewal_ms is when a gateway first renews decision d's lease, in ms: half the
-- shortest window among d's rules, at least MIN_RENEWAL_MS. A concurrency rule's entry
-- has its lease as its window; a rate rule's may be shorter, which only brings the first
-- renewal forward (its answer says when the lease expires, and the next renewal follows
-- that).
function M.first_renewal_ms(d)
  local w
  for _, r in ipairs(d.rules or {}) do
    local rw = tonumber(r.window_ms)
    if rw and rw > 0 and (not w or rw < w) then
      w = rw
    end
  end
  return math.max((w or 2000) / 2, M.MIN_RENEWAL_MS)
end

-- lease_life_ms is how long decision d's lease lasts unless renewed, in ms: the shortest
-- window of its concurrency entries (a concurrency rule's window is its lease; a renewal
-- of a lease one of whose slots ran out answers renewed: false); 0 when d flags none (an
-- earlier daemon: a gateway then takes twice its first renewal's wait). It is the lease's
-- expiry until a renewal answers. Before, that was always twice the first wait, the
-- shortest window of all the rules: a rate rule of 10 per second beside a lease of a
-- minute made it one second, and a daemon that did not answer the renewals of that
-- second (stalled, restarting) ended them for good, the lease left to expire under a
-- request still running.
function M.lease_life_ms(d)
  local w = 0
  for _, r in ipairs(d.rules or {}) do
    local rw = tonumber(r.window_ms)
    if r.concurrency == true and rw and rw > 0 and (w == 0 or rw < w) then
      w = rw
    end
  end
  return w
end

return M
