-- Unit tests of the Lua clients: the codec against proto/testdata/vectors.json, the HTTP
-- mapping against clients/testdata/http_headers.json and problem_bodies.json, the path
-- normalization against clients/testdata/paths.json, and bad
-- input. Runs under Lua 5.3 (HAProxy's runtime: `lua5.3 test/unit.lua` from
-- clients/lua) and under nginx's LuaJIT (test/unit.sh runs it in init_by_lua, where the
-- nginx client's lua-mpack decoder is used too). Needs lua-cjson to read the JSON files.
--
-- RLSIDECAR_REPO (env) or the first argument: the repository root (default ../..).

local cjson = require "cjson"
local codec = require "rlsidecar.codec"
local http = require "rlsidecar.http"

local root = (arg and arg[1]) or os.getenv("RLSIDECAR_REPO") or "../.."
local out = io.stdout
local failures, checks = 0, 0

local function fail(fmt, ...)
  failures = failures + 1
  out:write("FAIL: " .. string.format(fmt, ...) .. "\n")
  out:flush()
end

local function check(cond, fmt, ...)
  checks = checks + 1
  if not cond then fail(fmt, ...) end
end

local function read(path)
  local f = assert(io.open(root .. "/" .. path, "rb"))
  local s = f:read("*a")
  f:close()
  return cjson.decode(s)
end

local function hex(s)
  return (s:gsub(".", function(c) return string.format("%02x", c:byte()) end))
end

local function unhex(h)
  return (h:gsub("..", function(x) return string.char(tonumber(x, 16)) end))
end

-- deep_equal compares a decoded answer with the JSON meaning; numbers by value.
local function deep_equal(a, b, path)
  if type(a) ~= type(b) then
    return false, path .. ": " .. type(a) .. " vs " .. type(b)
  end
  if type(a) ~= "table" then
    if a ~= b then return false, path .. ": " .. tostring(a) .. " vs " .. tostring(b) end
    return true
  end
  for k, v in pairs(b) do
    local ok, why = deep_equal(a[k], v, path .. "." .. tostring(k))
    if not ok then return false, why end
  end
  for k in pairs(a) do
    if b[k] == nil then return false, path .. "." .. tostring(k) .. ": unexpected" end
  end
  return true
end

-- integers_stay_integers checks, where the runtime has integers (5.3+), that every
-- number decoded from msgpack is one: a float would print as "5.0" in a header.
local function integers_stay_integers(v, path)
  if not math.type then return true end
  if type(v) == "number" then
    return math.type(v) == "integer" or v >= 2 ^ 53, path
  end
  if type(v) == "table" then
    for k, x in pairs(v) do
      local ok, where = integers_stay_integers(x, path .. "." .. tostring(k))
      if not ok then return false, where end
    end
  end
  return true
end

local vectors = read("proto/testdata/vectors.json")

-- Requests: encode each message to exactly its bytes, and decode the bytes back.
for _, v in ipairs(vectors.requests) do
  local m = v.message
  local frame, err = codec.encode_request({ id = m.id, op = m.op, attrs = m.attrs, limits = m.limits, cost = m.cost })
  if m.id > codec.MAX_SAFE then
    -- 2^64-1 is no exact Lua number on LuaJIT; the encoder refuses it instead of
    -- sending another id. Its decoding is checked below.
    check(frame == nil and err:find('"id"'), "%s: an id above 2^53 must be refused, got %s", v.name, tostring(err))
  else
    check(frame ~= nil, "%s: encode: %s", v.name, tostring(err))
    check(frame and hex(frame) == v.hex, "%s: encoded\n  %s\nwant\n  %s", v.name, frame and hex(frame) or "", v.hex)
  end
  local bytes = unhex(v.hex)
  check(codec.frame_length(bytes) == #bytes - 4, "%s: frame length", v.name)
  local req, derr = codec.decode_body(bytes:sub(5))
  check(req ~= nil, "%s: decode: %s", v.name, tostring(derr))
  if req then
    check(req.op == m.op and req.id == m.id and (req.cost or 1) == m.cost, "%s: decoded id/op/cost", v.name)
  end
end

-- Lease requests (release, renew): encoded to exactly their bytes.
for _, v in ipairs(vectors.lease_requests) do
  local m = v.message
  local frame, err = codec.encode_request({ id = m.id, op = m.op, cost = m.cost, lease = m.lease, lease_ms = m.lease_ms })
  check(frame ~= nil, "%s: encode: %s", v.name, tostring(err))
  check(frame and hex(frame) == v.hex, "%s: encoded\n  %s\nwant\n  %s", v.name, frame and hex(frame) or "", v.hex)
end
for _, v in ipairs(vectors.lease_responses) do
  local resp, err = codec.decode_body(unhex(v.hex):sub(5))
  check(resp ~= nil, "%s: decode: %s", v.name, tostring(err))
  if resp then
    local ok, why = deep_equal(resp, v.message, "")
    check(ok, "lease %s: %s", v.name, tostring(why))
  end
end

-- Responses: decode with the Lua codec (HAProxy) and with the nginx client's decoder.
local decoders = { { "rlsidecar.codec", codec.decode_body } }
if ngx then
  local resty = require "resty.rlsidecar"
  check(resty.mpack_decode_body ~= nil, "nginx: lua-mpack not found on package.cpath (%s)", package.cpath)
  decoders[#decoders + 1] = { "resty.rlsidecar (lua-mpack)", resty.mpack_decode_body }
  check(resty.decode_body == codec.decode_body, "nginx: the default decoder is rlsidecar.codec")
  local c, err = resty.new({ socket = "/nonexistent.sock", decoder = "lua-mpack" })
  check(c and c.decode == resty.mpack_decode_body, "nginx: new{decoder = lua-mpack}: %s", tostring(err))
  c, err = resty.new({ socket = "/nonexistent.sock", decoder = "cjson" })
  check(c == nil and err:find("decoder"), "nginx: a bad decoder is refused")
  c, err = resty.new({ socket = "/x.sock", on_unavailable = "maybe" })
  check(c == nil and err:find("on_unavailable"), "nginx: a bad policy is refused")
  c, err = resty.new({})
  check(c == nil and err:find("socket"), "nginx: a missing socket is refused")
  -- A misspelled option is refused, not ignored: with on_unavailable misspelled, a
  -- location meant to fail closed failed open.
  for _, bad in ipairs({ "timeout", "onUnavailable", "on_unavailble", "pool" }) do
    c, err = resty.new({ socket = "/x.sock", [bad] = "closed" })
    check(c == nil and err and err:find("unknown option \"" .. bad .. "\"", 1, true) and err:find("on_unavailable", 1, true),
      "nginx: the unknown option %s is refused: %s", bad, tostring(err))
  end
  for _, bad in ipairs({ { pool_size = "16" }, { pool_size = 0 }, { pool_size = 1.5 }, { keepalive_ms = "60s" },
    { keepalive_ms = -1 }, { renew_leases = "false" }, { renew_leases = 0 } }) do
    local name, v = next(bad)
    bad.socket = "/x.sock"
    c, err = resty.new(bad)
    check(c == nil and err and err:find(name, 1, true), "nginx: %s = %s is refused: %s", name, tostring(v), tostring(err))
  end
  c, err = resty.new({ socket = "/x.sock", timeout_ms = 50, on_unavailable = "closed", pool_size = 8,
    keepalive_ms = 1000, attrs = function() return {} end, cost = function() return 1 end, decoder = "lua",
    max_frame = 65536, renew_leases = false })
  check(c ~= nil and c.policy == "closed" and c.renew_leases == false, "nginx: every documented option is taken: %s", tostring(err))
  check(resty.new({ socket = "/x.sock" }).max_frame == 65536, "nginx: max_frame defaults to 65536")
  for _, bad in ipairs({ 0, -1, 1.5, "64k" }) do
    c, err = resty.new({ socket = "/x.sock", max_frame = bad })
    check(c == nil and err:find("max_frame"), "nginx: max_frame %s is refused", tostring(bad))
  end
end
for _, dec in ipairs(decoders) do
  for _, v in ipairs(vectors.responses) do
    local bytes = unhex(v.hex)
    check(codec.frame_length(bytes) == #bytes - 4, "%s: frame length", v.name)
    local resp, err = dec[2](bytes:sub(5))
    check(resp ~= nil, "%s %s: decode: %s", dec[1], v.name, tostring(err))
    if resp then
      local ok, why = deep_equal(resp, v.message, "")
      check(ok, "%s %s: %s", dec[1], v.name, tostring(why))
      if dec[1] == "rlsidecar.codec" then
        local int_ok, where = integers_stay_integers(resp, "")
        check(int_ok, "%s %s: %s decoded as a float", dec[1], v.name, tostring(where))
      end
    end
  end
end

-- Malformed bodies: the decoder says so instead of returning a value.
for _, body in ipairs({ "", "\130\162id", "\192\192", "\193", "\217\10abc" }) do
  local v, err = codec.decode_body(body)
  check(v == nil and type(err) == "string", "malformed %q decoded to %s", hex(body), tostring(v))
end

-- Canonical order of a map of attributes: sorted by name.
do
  local a = codec.encode_request({ id = 9, op = "check", attrs = { user = "u", ip = "1.2.3.4", method = "GET" } })
  local b = codec.encode_request({ id = 9, op = "check", attrs = { { "ip", "1.2.3.4" }, { "method", "GET" }, { "user", "u" } } })
  check(a == b, "a map of attributes is encoded sorted by name")
  local many = {}
  for i = 1, 40 do many[string.format("k%02d", i)] = string.rep("v", i * 10) end
  local f = codec.encode_request({ id = 70000, op = "check", attrs = many, cost = 300 })
  local r = codec.decode_body(f:sub(5))
  check(r and r.id == 70000 and r.cost == 300 and r.attrs.k40 == string.rep("v", 400), "map16, str16 and uint32 round trip")
  -- Pairs and fields in one table (default_attrs() with `a.user = ...` added): the pairs
  -- in order, then the fields by name; a field replaces a pair of its name.
  local mixed = { { "ip", "1.2.3.4" }, { "method", "GET" }, user = "u", method = "POST" }
  local c = codec.encode_request({ id = 9, op = "check", attrs = mixed })
  local want = codec.encode_request({ id = 9, op = "check", attrs = { { "ip", "1.2.3.4" }, { "method", "POST" }, { "user", "u" } } })
  local mr = codec.decode_body(c:sub(5))
  check(mr and mr.attrs.user == "u" and mr.attrs.method == "POST" and mr.attrs.ip == "1.2.3.4", "pairs and fields: %s", hex(c))
  check(c == want, "pairs and fields: three attributes, the pair replaced: %s, want %s", hex(c), hex(want))
end

-- Bad input: a clear error, nothing encoded.
for _, c in ipairs({
  { { id = 1, op = "check", attrs = { user = 5 } }, "attribute user must be a string" },
  { { id = 1, op = "check", attrs = { [1] = { "user" } } }, "attrs[1] must be a {name, value} pair" },
  { { id = 1, op = "check", attrs = "user=alice" }, "attrs must be a table" },
  { { id = 1, op = "check", attrs = { { "ip", "1.2.3.4" }, user = 5 } }, "attribute user must be a string" },
  { { id = 1, op = "check", attrs = { { "ip", "1.2.3.4" }, [5] = "x" } }, "attribute names must be strings" },
  { { id = 1, op = "check", cost = -1 }, '"cost" must be a non-negative integer' },
  { { id = 1, op = "check", cost = 1.5 }, '"cost" must be a non-negative integer' },
  { { id = 1, op = "" }, '"op" must be a non-empty string' },
  { { id = 1, op = "check", limits = { { key = "k", limit = 0, window_ms = 1000 } } }, 'limits[0]: "limit" must be an integer of at least 1' },
  { { id = 1, op = "check", limits = { { key = "", limit = 1, window_ms = 1000 } } }, 'limits[0]: "key" must be a non-empty string' },
  { { id = 1, op = "check", limits = { { key = "k", limit = 1, window_ms = 1000, mode = 3 } } }, 'limits[0]: "mode" must be a string' },
}) do
  local frame, err = codec.encode_request(c[1])
  check(frame == nil and err and err:find(c[2], 1, true), "bad input: got %s, %s; want error %q", tostring(frame), tostring(err), c[2])
end

-- A cost past 2^53 is sent as 2^53 (over every capacity: cost_exceeds_capacity), as the
-- other clients and HAProxy's action send a cost past what they can: refused by the
-- encoder, the request went to the failure policy, which under "open" let it through.
for _, big in ipairs({ 2 ^ 53 + 2, 1e20, 1e300 }) do
  local f, err = codec.encode_request({ id = 1, op = "check", cost = big })
  local r = f and codec.decode_body(f:sub(5))
  check(r and r.cost == codec.MAX_SAFE, "cost %.17g: sent as 2^53, got %s %s", big, tostring(r and r.cost), tostring(err))
end
-- What a gateway refuses as a cost (400, whatever the policy) and what it sends.
for _, c in ipairs({ { -1, true }, { 1.5, true }, { 0 / 0, true }, { math.huge, true }, { -math.huge, true },
  { "3", true }, { nil, false }, { 0, false }, { 3, false }, { 1e20, false } }) do
  check(http.bad_cost(c[1]) == c[2], "bad_cost(%s): got %s, want %s", tostring(c[1]), tostring(http.bad_cost(c[1])), tostring(c[2]))
end

-- The HTTP mapping: every case of the shared table.
local function lower_keys(t)
  local l = {}
  for k, v in pairs(t) do l[k:lower()] = v end
  return l
end

for _, v in ipairs(read("clients/testdata/http_headers.json")) do
  local got = lower_keys(http.headers(v.decision))
  local want = lower_keys(v.headers)
  for k, w in pairs(want) do
    check(got[k] == w, "%s: %s: got %s, want %s (%s)", v.name, k, tostring(got[k]), w, v.meaning)
  end
  for k, g in pairs(got) do
    check(want[k] ~= nil, "%s: unexpected header %s: %s", v.name, k, g)
  end
  check(v.decision.allowed == (v.status == 200), "%s: allowed vs status %d", v.name, v.status)
  if not v.decision.allowed then
    local status, h = http.rejection(v.decision)
    check(status == v.status, "%s: rejection status %d, want %d", v.name, status, v.status)
    check(h["Content-Type"] == "application/problem+json", "%s: Content-Type %s", v.name, tostring(h["Content-Type"]))
  end
end

-- A rule the refused request left unasked (refused before its store was asked: its
-- remaining 0 and reset_ms 0 not read) comes through both decoders with unasked = true,
-- keeps its RateLimit-Policy item (its quota is known) and has no RateLimit item, which
-- would say it has nothing left.
-- The answer as the daemon encodes it (proto.Encoder.EncodeCheck).
do
  local frame = unhex("0000011d89a2696401a7616c6c6f776564c2a472756c65a67065722d6970a56c696d697402a972656d61696e696e6700"
    .. "a872657365745f6d73cd7530ae72657472795f61667465725f6d73cd38a4a86465677261646564c2a572756c65739288a46e616d65a67065"
    .. "722d6970a56c696d697402a977696e646f775f6d73cdea60a972656d61696e696e6700a872657365745f6d73cd7530ae72657472795f6166"
    .. "7465725f6d73cd38a4a7616c6c6f776564c2a6736861646f77c289a46e616d65ab7065722d6163636f756e74a56c696d697405a977696e64"
    .. "6f775f6d73ce0036ee80a972656d61696e696e6700a872657365745f6d7300ae72657472795f61667465725f6d7300a7616c6c6f776564c3"
    .. "a6736861646f77c2a7756e61736b6564c3")
  check(codec.frame_length(frame) == #frame - 4, "unasked: frame length")
  for _, dec in ipairs(decoders) do
    local d, err = dec[2](frame:sub(5))
    check(d ~= nil, "%s unasked: decode: %s", dec[1], tostring(err))
    if d then
      check(d.rules[1].unasked == nil and d.rules[2].name == "per-account" and d.rules[2].unasked == true,
        "%s unasked: rules[2].unasked %s", dec[1], tostring(d.rules[2].unasked))
      local h = http.headers(d)
      check(h["RateLimit-Policy"] == '"per-ip";q=2;w=60, "per-account";q=5;w=3600' and h["RateLimit"] == '"per-ip";r=0;t=15'
        and h["Retry-After"] == "15", "%s unasked: RateLimit-Policy %s, RateLimit %s, Retry-After %s",
        dec[1], tostring(h["RateLimit-Policy"]), tostring(h["RateLimit"]), tostring(h["Retry-After"]))
    end
  end
end

-- A concurrency rule's entry (the lease vectors of proto/testdata/vectors.json) comes
-- through both decoders with concurrency = true; its items are a quota of concurrent
-- requests with no window, and a t only when it refused with a retry hint.
do
  local want = {
    ["check-lease"] = { '"exports";q=2;qu="concurrent-requests"', '"exports";r=1', nil },
    ["check-lease-refused"] = { '"exports";q=2;qu="concurrent-requests"', '"exports";r=0;t=1', "1" },
  }
  local seen = 0
  for _, v in ipairs(vectors.lease_responses) do
    local w = want[v.name]
    if w then
      seen = seen + 1
      for _, dec in ipairs(decoders) do
        local d, err = dec[2](unhex(v.hex):sub(5))
        check(d ~= nil, "%s %s: decode: %s", dec[1], v.name, tostring(err))
        if d then
          check(d.rules[1].concurrency == true, "%s %s: rules[1].concurrency %s", dec[1], v.name, tostring(d.rules[1].concurrency))
          local h = http.headers(d)
          check(h["RateLimit-Policy"] == w[1] and h["RateLimit"] == w[2] and h["Retry-After"] == w[3],
            "%s %s: RateLimit-Policy %s, RateLimit %s, Retry-After %s", dec[1], v.name,
            tostring(h["RateLimit-Policy"]), tostring(h["RateLimit"]), tostring(h["Retry-After"]))
        end
      end
    end
  end
  check(seen == 2, "lease vectors check-lease and check-lease-refused: %d found", seen)
end

for _, v in ipairs(read("clients/testdata/problem_bodies.json")) do
  local d = v.decision
  d.unreachable = v.unreachable
  local status, h, body = http.rejection(d)
  check(status == v.status, "%s: status %d, want %d", v.name, status, v.status)
  check(body == v.body, "%s: body\n  %s\nwant\n  %s", v.name, body, v.body)
  local got = lower_keys(h)
  for k, w in pairs(lower_keys(v.headers)) do
    check(got[k] == w, "%s: %s: got %s, want %s", v.name, k, tostring(got[k]), w)
  end
end

-- The ip attribute: every case of the shared table (clients/testdata/ips.json).
do
  local t = read("clients/testdata/ips.json")
  check(#t.cases >= 10, "ips.json: %d cases", #t.cases)
  for _, c in ipairs(t.cases) do
    local got = http.peer_ip(c.peer)
    check(got == c.ip, "peer_ip(%q) = %q, want %q", c.peer, tostring(got), c.ip)
  end
  check(http.peer_ip(nil) == "", "peer_ip(nil) is not \"\"")
end

-- Path normalization (the HAProxy client's `path`): every case of the shared table, and
-- a result that is normalized already stays as it is.
do
  local path = require "rlsidecar.path"
  local t = read("clients/testdata/paths.json")
  check(#t.cases > 30, "paths.json: %d cases", #t.cases)
  for _, c in ipairs(t.cases) do
    -- JSON strings stand for bytes: U+0000..U+00FF are the bytes 0x00..0xFF.
    local want = c.path:gsub("[\194\195][\128-\191]", function(u)
      return string.char((u:byte(1) - 192) * 64 + u:byte(2) - 128)
    end)
    local got = path.normalize(c.raw)
    check(got == want, "normalize(%q) = %q, want %q", c.raw, got, want)
    -- Its bytes percent-encoded where they would mean something else, it is a fixed point.
    local again = path.normalize((got:gsub("[%%?#]", function(ch) return string.format("%%%02X", ch:byte()) end)))
    check(again == got, "normalize(normalize(%q)) = %q", c.raw, again)
  end
  -- Beyond the shared table: the absolute form (a proxy's request target), as nginx.
  for _, c in ipairs({
    { "http://example.com/f%61st?x", "/fast" }, { "HTTPS://example.com", "/" },
    { "http://example.com//a/../b", "/b" }, { "/http://x/a", "/http:/x/a" },
  }) do
    local got = path.normalize(c[1])
    check(got == c[2], "normalize(%q) = %q, want %q", c[1], got, c[2])
  end
  -- clean: a path decoded already (slashes merged, dot segments removed, nothing decoded).
  check(path.clean("//a/%2e%2e/./b/../c?d") == "/a/%2e%2e/c?d", "clean: %q", path.clean("//a/%2e%2e/./b/../c?d"))
  check(path.clean("") == "/" and path.clean("a/..") == "/", "clean: empty and relative")
end

-- A request too large to be checked: 431, no rate-limit headers, a problem body.
do
  local d = http.too_large_decision("request frame of 70012 bytes exceeds max_frame 65536")
  check(not d.allowed and not d.degraded and not d.unreachable and d.reason == "request_too_large",
    "too large: a refusal, not the policy's")
  check(next(http.headers(d)) == nil, "too large: no rate-limit headers, no Retry-After")
  local status, h, body = http.rejection(d)
  check(status == 431, "too large: status %s", tostring(status))
  check(h["Content-Type"] == "application/problem+json" and h["Retry-After"] == nil, "too large: headers")
  check(body == '{"type":"about:blank","title":"Request Header Fields Too Large","status":431,'
    .. '"detail":"This request\'s attributes (its path or header fields) are too large for the rate limiter to check."}', "too large: body %s", body)
end

-- The policy decision: open allows without rate-limit fields, closed answers 503.
do
  local open = http.policy_decision("open", "connection refused")
  check(open.allowed and open.degraded and open.unreachable and next(http.headers(open)) == nil,
    "open policy: allowed, degraded, no headers")
  local closed = http.policy_decision("closed", "timeout")
  local status, h = http.rejection(closed)
  check(not closed.allowed and closed.degraded and status == 503 and h["Retry-After"] == "1"
    and h["RateLimit"] == nil, "closed policy: 503 with Retry-After 1")
end

-- A lease's life until a renewal answers: the shortest window of the concurrency entries
-- (a rate rule's window is not the lease); 0 when none is flagged (an earlier daemon).
do
  local conc = { name = "c", window_ms = 3000, concurrency = true }
  local conc2 = { name = "c2", window_ms = 60000, concurrency = true }
  local rate = { name = "r", window_ms = 1000 }
  for _, c in ipairs({
    { { rules = { conc, rate } }, 3000 }, { { rules = { rate, conc2, conc } }, 3000 },
    { { rules = { rate } }, 0 }, { { rules = {} }, 0 }, { {}, 0 },
  }) do
    local got = http.lease_life_ms(c[1])
    check(got == c[2], "lease_life_ms: got %s, want %s", tostring(got), tostring(c[2]))
  end
end

-- A lease's first renewal: half the shortest window of the decision's rules, at least
-- MIN_RENEWAL_MS; 1 s without a window.
do
  local function d(...)
    local rules = {}
    for i, w in ipairs({ ... }) do rules[i] = { name = "r" .. i, window_ms = w } end
    return { rules = rules }
  end
  for _, c in ipairs({
    { d(2000), 1000 }, { d(60000, 2000, 30000), 1000 }, { d(5), http.MIN_RENEWAL_MS },
    { d(), 1000 }, { { rules = { { name = "x" } } }, 1000 }, { d(0, 3000), 1500 },
  }) do
    local got = http.first_renewal_ms(c[1])
    check(got == c[2], "first_renewal_ms: got %s, want %s", tostring(got), tostring(c[2]))
  end
end

-- The log gate: one line a second, the next saying how many were held back; the busy
-- error codes (the daemon's state, logged at warn).
do
  local gate = http.gate(1)
  local got = {}
  for _, t in ipairs({ 10, 10.2, 10.9, 11.0, 11.5, 13 }) do
    got[#got + 1] = tostring(gate(t))
  end
  check(table.concat(got, " ") == "0 nil nil 2 nil 1", "gate: got %s", table.concat(got, " "))
  check(http.held_note(0) == "" and http.held_note(2):find("2 more", 1, true) ~= nil, "held_note")
  check(http.busy_error("rlsidecar: too_many_connections: 1024 connections") and
    http.busy_error("rlsidecar: shutting_down: bye") and
    not http.busy_error("rlsidecar: bad_request: attrs") and not http.busy_error(nil), "busy_error")
end

-- The HAProxy client's lease renewals (haproxy/rlsidecar.lua), against a stand-in for
-- HAProxy's core: a clock in microseconds that moves only when a task sleeps, a task
-- scheduler, and sockets to a stand-in daemon that answers checks with a lease and
-- renewals as each case says. Lua 5.3 only (HAProxy's runtime; nginx has no core).
if not jit and not ngx then
  -- enc encodes a Lua value as msgpack: the daemon's answers.
  local function enc(v)
    local t = type(v)
    if t == "boolean" then return v and "\xc3" or "\xc2" end
    if t == "number" then return "\xce" .. string.pack(">I4", v) end
    if t == "string" then return string.char(0xd9, #v) .. v end
    local n, parts = 0, {}
    if v[1] ~= nil then
      for _, x in ipairs(v) do parts[#parts + 1] = enc(x) end
      return string.char(0x90 + #v) .. table.concat(parts)
    end
    for k, x in pairs(v) do
      n = n + 1
      parts[#parts + 1] = enc(k) .. enc(x)
    end
    return string.char(0x80 + n) .. table.concat(parts)
  end
  local function frame(v)
    local b = enc(v)
    return string.pack(">I4", #b) .. b
  end

  -- sim loads a fresh copy of the client with a stand-in core. opts.renew(reqs) answers
  -- a connection's renewals (a list of { id, lease }) with a list of answer maps, in the
  -- order they are written; by default each is renewed for its lease: S.lease_ms when the
  -- check took it, else opts.lease_ms.
  local function sim(opts)
    local S = { clock = 1000000000300, tasks = {}, alerts = {}, renewals = {}, releases = {}, running = {}, conns = 0,
      spins = 0, lease_n = 0, lease_of = {}, expiry = {}, wake = {} }
    local calls = 0 -- core.now calls since the running task last yielded
    local sock_mt = {}
    sock_mt.__index = sock_mt
    function sock_mt:settimeout() end
    function sock_mt:connect() S.conns = S.conns + 1; return true end
    function sock_mt:close() end
    function sock_mt:send(data)
      local reqs = {}
      local pos = 1
      while pos <= #data do
        local n = codec.frame_length(data:sub(pos, pos + 3))
        reqs[#reqs + 1] = codec.decode_body(data:sub(pos + 4, pos + 3 + n))
        pos = pos + 4 + n
      end
      local renews = {}
      for _, r in ipairs(reqs) do
        if r.op == "check" then
          S.lease_n = S.lease_n + 1
          local ms = S.lease_ms or opts.lease_ms
          S.lease_of["L" .. S.lease_n] = ms
          S.expiry["L" .. S.lease_n] = S.clock + ms * 1000
          self.out = self.out .. frame({ id = r.id, allowed = true, lease = "L" .. S.lease_n,
            rules = { { name = "c", limit = 10, remaining = 9, window_ms = ms } } })
        elseif r.op == "release" then
          -- answered at once, in the order written (renewals are answered after all
          -- of a connection's frames: none here, the task sends one kind per entry)
          S.releases[r.lease] = S.clock
          local live = S.lease_of[r.lease] ~= nil
          S.lease_of[r.lease] = nil
          self.out = self.out .. frame({ id = r.id, released = live })
        elseif r.op == "renew" then
          renews[#renews + 1] = r
          local l = S.renewals[r.lease] or {}
          l[#l + 1] = S.clock
          S.renewals[r.lease] = l
        end
      end
      if #renews > 0 then
        local answers = opts.renew and opts.renew(renews, S) or nil
        if not answers then
          answers = {}
          for i, r in ipairs(renews) do answers[i] = S.answer(r) end
        end
        for _, a in ipairs(answers) do self.out = self.out .. frame(a) end
      end
      return #data
    end
    -- answer is the daemon's answer to renewal r: a lease past its expiry is gone (the
    -- daemon freed its slot), renewed false.
    function S.answer(r)
      local ms = S.lease_of[r.lease]
      local live = ms and S.clock <= S.expiry[r.lease]
      if live then S.expiry[r.lease] = S.clock + ms * 1000 else S.lease_of[r.lease] = nil end
      return { id = r.id, renewed = live and true or false, expires_ms = live and ms or 0 }
    end
    function sock_mt:receive(n)
      if #self.out < n then return nil, "timeout" end
      local s = self.out:sub(1, n)
      self.out = self.out:sub(n + 1)
      return s
    end
    core = {
      now = function()
        calls = calls + 1
        if calls > 10000 and coroutine.isyieldable() then
          coroutine.yield("spin") -- HAProxy's forced yield (tune.lua.forced-yield)
        end
        return { sec = math.floor(S.clock / 1000000), usec = S.clock % 1000000 }
      end,
      tcp = function()
        if S.tcp_error then
          S.tcp_error = false
          error("socket: out of memory")
        end
        return setmetatable({ out = "" }, sock_mt)
      end,
      msleep = function(ms) coroutine.yield(ms) end,
      register_task = function(f)
        if S.task_error then
          S.task_error = false
          error("Lua out of memory error.")
        end
        S.tasks[#S.tasks + 1] = coroutine.create(f)
      end,
      register_action = function(name, _, f) if name == "rlsidecar" then S.action = f end end,
      register_fetches = function() end,
      Alert = function(m) S.alerts[#S.alerts + 1] = m end,
    }
    package.loaded["haproxy.rlsidecar"] = nil
    dofile(root .. "/clients/lua/haproxy/rlsidecar.lua")
    -- request runs the action for one HTTP/2 request (no pending releases), which takes a
    -- lease; it returns the lease's name. The transaction runs until S.finish(lease): its
    -- private data (the lease's socket) is kept in S.running until then, as HAProxy
    -- keeps a running transaction's.
    function S.request()
      local priv
      local txn = {
        f = {
          src = function() return "127.0.0.1" end, method = function() return "GET" end,
          path = function() return "/" end, req_ver = function() return "2.0" end,
        },
        get_var = function() return nil end, set_var = function() end, unset_var = function() end,
        get_priv = function() return priv end, set_priv = function(_, p) priv = p end,
        Info = function() end, Warning = function() end, Alert = function(_, m) S.alerts[#S.alerts + 1] = m end,
      }
      local ok, err = pcall(S.action, txn, "unix@/x", "open", "50")
      if not ok then S.alerts[#S.alerts + 1] = tostring(err) end
      S.running["L" .. S.lease_n] = priv
      return "L" .. S.lease_n
    end
    -- finish ends lease's transaction: HAProxy frees its Lua context and collects its
    -- garbage, the lease's socket with it.
    function S.finish(lease)
      S.running[lease] = nil
      collectgarbage()
      collectgarbage()
    end
    -- run runs the tasks until the clock has moved by ms: a sleeping task wakes when its
    -- tick comes; a task that spins (does not yield within 10,000 reads of the clock)
    -- is counted in S.spins and resumed 100 us later, as HAProxy would.
    function S.run(ms)
      local stop = S.clock + ms * 1000
      local wake = S.wake
      while S.clock < stop do
        local next_at = stop
        for i, co in ipairs(S.tasks) do
          if coroutine.status(co) == "suspended" and (wake[co] or 0) <= S.clock then
            calls = 0
            local ok, v = coroutine.resume(co)
            if not ok then
              S.alerts[#S.alerts + 1] = "task died: " .. tostring(v)
            elseif v == "spin" then
              S.spins = S.spins + 1
              wake[co] = S.clock + 100
            elseif type(v) == "number" then
              -- HAProxy's timers count whole ms: a sleep ends at the start of the ms
              -- tick it names, run a little later (50 us)
              wake[co] = (math.floor(S.clock / 1000) + math.floor(v)) * 1000 + 50
            end
          end
          if coroutine.status(co) == "suspended" then next_at = math.min(next_at, wake[co] or S.clock) end
        end
        S.clock = math.max(next_at, S.clock + 1)
      end
    end
    return S
  end

  -- renewed_every: whether lease was renewed throughout [from, to] us, never more than
  -- gap_ms apart.
  local function renewed_every(S, lease, gap_ms, from, to)
    local last = from
    for _, t in ipairs(S.renewals[lease] or {}) do
      if t > last + gap_ms * 1000 then return false end
      last = t
    end
    return to - last <= gap_ms * 1000
  end

  -- Answers out of order, an error with id 0 mid-batch: every lease is still renewed.
  do
    local S = sim({ lease_ms = 1000, renew = function(reqs, S)
      local a = {}
      for i = #reqs, 1, -1 do a[#a + 1] = S.answer(reqs[i]) end
      return a
    end })
    local t0 = S.clock
    local leases = { S.request(), S.request(), S.request() }
    S.run(5000)
    for _, l in ipairs(leases) do
      check(S.lease_of[l] and renewed_every(S, l, 600, t0, S.clock), "haproxy renewals out of order: %s not renewed every 600 ms", l)
    end
    local flaky = true
    S = sim({ lease_ms = 1000, renew = function(reqs, S)
      flaky = not flaky
      if flaky or #reqs < 2 then return nil end
      return { S.answer(reqs[1]), { id = 0, error = { code = "shutting_down", message = "bye" } } }
    end })
    t0 = S.clock
    leases = { S.request(), S.request() }
    S.run(5000)
    for _, l in ipairs(leases) do
      check(S.lease_of[l] and renewed_every(S, l, 800, t0, S.clock), "haproxy renewals after an id 0 error: %s not renewed every 800 ms", l)
    end
  end

  -- A transaction that ended (its socket collected) has its lease released at its next
  -- turn, not renewed: the daemon that answers may renew it however long it is asked (a
  -- successor renewing a global lease from Redis, taken from a daemon SIGKILLed, which
  -- never read the close). Before, such a lease was renewed for as long as HAProxy ran.
  do
    local S = sim({ lease_ms = 1000 })
    local t0 = S.clock
    local ended, running = S.request(), S.request()
    S.run(200)
    S.finish(ended)
    S.run(3000)
    check(S.releases[ended] ~= nil, "haproxy: the lease of an ended transaction was not released (renewed %d times)",
      #(S.renewals[ended] or {}))
    local after = 0
    for _, t in ipairs(S.renewals[ended] or {}) do
      if t > (S.releases[ended] or 0) then after = after + 1 end
    end
    check(after == 0, "haproxy: the lease of an ended transaction renewed %d times after its release", after)
    check(S.releases[running] == nil and renewed_every(S, running, 600, t0, S.clock),
      "haproxy: the lease of a running transaction kept renewed beside one that ended")
  end

  -- Many leases due at once: batches of 256 on a connection each, all renewed, in order
  -- of their due times (the heap).
  do
    local S = sim({ lease_ms = 2000 })
    local t0 = S.clock
    for _ = 1, 1000 do S.request() end
    S.run(1001)
    local all = true
    for i = 1, 1000 do
      if #(S.renewals["L" .. i] or {}) ~= 1 then all = false end
    end
    check(all, "haproxy: 1000 leases due at once: each renewed once in the first second")
    check(S.conns == 1000 + 4, "haproxy: 1000 renewals on %d connections, want 4", S.conns - 1000)
    S.run(10000)
    check(renewed_every(S, "L1", 1100, t0, S.clock) and renewed_every(S, "L1000", 1100, t0, S.clock),
      "haproxy: 1000 leases kept renewed")
  end

  -- A Lua error while renewing (core.tcp out of memory) loses no lease.
  do
    local S = sim({ lease_ms = 1000 })
    local t0 = S.clock
    local l = S.request()
    S.tcp_error = true
    S.run(1000)
    S.tcp_error = false
    S.run(3000)
    check(#(S.renewals[l] or {}) > 3, "haproxy: after an error while renewing, %s was renewed %d times in 4 s", l, #(S.renewals[l] or {}))
  end

  -- A task that could not be registered is registered by the next lease.
  do
    local S = sim({ lease_ms = 1000 })
    S.task_error = true
    S.request()
    local l = S.request()
    S.run(2000)
    check(#(S.renewals[l] or {}) > 0, "haproxy: once register_task failed, no lease was renewed (%s)", table.concat(S.alerts, "; "))
  end
  -- A lease shorter than any before, taken while the task sleeps for the longer ones
  -- (up to 1 s), is renewed before it expires.
  do
    local S = sim({ lease_ms = 60000 })
    S.request()
    S.run(100)
    S.lease_ms = 400
    local t0 = S.clock
    local l = S.request()
    S.request() -- a second one in the same turn: no third task
    S.run(3000)
    check(#S.tasks == 2, "haproxy: two 400 ms leases during a sleep: %d tasks, want 2", #S.tasks)
    local first = (S.renewals[l] or {})[1]
    check(first and first - t0 < 400000, "haproxy: a 400 ms lease taken while the task slept was first renewed %s ms on",
      first and tostring((first - t0) / 1000) or "never")
    check(S.lease_of[l] and renewed_every(S, l, 400, t0, S.clock),
      "haproxy: a 400 ms lease taken while the task slept kept renewed (renewals at %s)",
      table.concat(S.renewals[l] or {}, " "))
  end

  core = nil
end

local runtime = (jit and jit.version) or _VERSION
out:write(string.format("%s: %d checks, %d failures\n", runtime, checks, failures))
out:flush()
if failures > 0 then
  error(string.format("%d of %d checks failed", failures, checks), 0)
end
return true
