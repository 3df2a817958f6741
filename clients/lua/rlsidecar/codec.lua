-- rlsidecar.codec: the rlsidecar wire format (proto/PROTOCOL.md) in plain Lua.
--
-- A frame is a 4-byte big-endian length, then one msgpack map. This module encodes
-- requests in the canonical field order of the Go encoder (id, op, attrs, limits, cost),
-- so its bytes equal proto/testdata/vectors.json, and decodes any msgpack value the
-- daemon sends. It runs unchanged on LuaJIT / Lua 5.1 (nginx/OpenResty) and on Lua 5.3
-- and 5.4 (HAProxy): it uses only arithmetic, never bit operators or string.pack, and
-- decodes integers as Lua integers where the runtime has them (so 5 prints as "5", not
-- "5.0", which is lua-mpack's behaviour under 5.3).
--
-- Numbers are Lua numbers: an unsigned integer above 2^53 (only the largest request ids
-- come near) decodes to the nearest float, and encode refuses ids above 2^53.
--
-- Pure functions, no state: safe to share between requests and coroutines.

local byte, char, sub, concat = string.byte, string.char, string.sub, table.concat
local floor, type, tostring, pairs, ipairs = math.floor, type, tostring, pairs, ipairs
local sort = table.sort
local unpack = unpack or table.unpack -- 5.1 / 5.2+

local M = {}

-- MAX_SAFE is the largest integer every runtime represents exactly (2^53).
M.MAX_SAFE = 9007199254740992

-- Canonical request field order (proto/PROTOCOL.md, "Canonical encodings").
local LIMIT_OPTIONAL = { "burst", "algorithm", "mode", "name" }

local function is_uint(n)
  return type(n) == "number" and n >= 0 and n <= M.MAX_SAFE and floor(n) == n
end
M.is_uint = is_uint

local function be(n, width)
  -- n as width (2, 4 or 8... any) big-endian bytes; n is a non-negative integer below 256^width.
  if width == 2 then
    return char(floor(n / 256) % 256, n % 256)
  elseif width == 4 then
    return char(floor(n / 16777216) % 256, floor(n / 65536) % 256, floor(n / 256) % 256, n % 256)
  end
  local t = {}
  for i = width, 1, -1 do
    t[i] = n % 256
    n = floor(n / 256)
  end
  return char(unpack(t))
end

local function put_uint(buf, n)
  if n < 128 then
    buf[#buf + 1] = char(n)
  elseif n < 256 then
    buf[#buf + 1] = "\204" .. char(n)
  elseif n < 65536 then
    buf[#buf + 1] = "\205" .. be(n, 2)
  elseif n < 4294967296 then
    buf[#buf + 1] = "\206" .. be(n, 4)
  else
    buf[#buf + 1] = "\207" .. be(floor(n / 4294967296), 4) .. be(n % 4294967296, 4)
  end
end

local function put_str(buf, s)
  local n = #s
  if n < 32 then
    buf[#buf + 1] = char(0xa0 + n)
  elseif n < 256 then
    buf[#buf + 1] = "\217" .. char(n)
  elseif n < 65536 then
    buf[#buf + 1] = "\218" .. be(n, 2)
  else
    buf[#buf + 1] = "\219" .. be(n, 4)
  end
  buf[#buf + 1] = s
end

local function put_header(buf, n, fix, w16)
  if n < 16 then
    buf[#buf + 1] = char(fix + n)
  else
    buf[#buf + 1] = w16 .. be(n, 2)
  end
end

-- put_attrs appends attrs: an array of {name, value} pairs in its order, then its
-- name = value fields sorted by name (so equal maps give equal bytes). A table may hold
-- both: default_attrs() returns pairs, and `a.user = x` on it adds a field, which was
-- dropped without a word before (the rule keyed on user never applied); a field wins
-- over a pair of the same name. It returns the number of attributes, or nil and an
-- error naming the bad entry (the caller then sends nothing).
local function put_attrs(buf, attrs)
  if type(attrs) ~= "table" then
    return nil, "attrs must be a table, not a " .. type(attrs)
  end
  local npairs = #attrs
  for i = 1, npairs do
    local p = attrs[i]
    if type(p) ~= "table" or type(p[1]) ~= "string" or type(p[2]) ~= "string" then
      return nil, "attrs[" .. i .. "] must be a {name, value} pair of strings"
    end
  end
  local names
  for k, v in pairs(attrs) do
    if type(k) == "number" and k >= 1 and k <= npairs and k % 1 == 0 then
      -- a pair, checked above
    elseif type(k) ~= "string" then
      return nil, "attribute names must be strings, not " .. type(k)
    elseif type(v) ~= "string" then
      return nil, "attribute " .. k .. " must be a string, not " .. type(v)
    else
      names = names or {}
      names[#names + 1] = k
    end
  end
  local n = npairs + (names and #names or 0)
  if names then
    sort(names)
    for i = 1, npairs do
      if attrs[attrs[i][1]] ~= nil then
        n = n - 1 -- a field of the same name replaces the pair
      end
    end
  end
  if n == 0 then
    return 0
  end
  put_str(buf, "attrs")
  put_header(buf, n, 0x80, "\222")
  for i = 1, npairs do
    local p = attrs[i]
    if not names or attrs[p[1]] == nil then
      put_str(buf, p[1]); put_str(buf, p[2])
    end
  end
  if names then
    for i = 1, #names do
      put_str(buf, names[i]); put_str(buf, attrs[names[i]])
    end
  end
  return n
end

local function put_limit(buf, i, l)
  local where = "limits[" .. (i - 1) .. "]"
  if type(l) ~= "table" then
    return where .. " must be a table"
  end
  if type(l.key) ~= "string" or l.key == "" then
    return where .. ': "key" must be a non-empty string'
  end
  if not is_uint(l.limit) or l.limit < 1 then
    return where .. ': "limit" must be an integer of at least 1'
  end
  if not is_uint(l.window_ms) or l.window_ms < 1 then
    return where .. ': "window_ms" must be an integer of at least 1'
  end
  local n = 3
  for _, f in ipairs(LIMIT_OPTIONAL) do
    if l[f] ~= nil then n = n + 1 end
  end
  put_header(buf, n, 0x80, "\222")
  put_str(buf, "key"); put_str(buf, l.key)
  put_str(buf, "limit"); put_uint(buf, l.limit)
  put_str(buf, "window_ms"); put_uint(buf, l.window_ms)
  if l.burst ~= nil then
    if not is_uint(l.burst) then
      return where .. ': "burst" must be a non-negative integer'
    end
    put_str(buf, "burst"); put_uint(buf, l.burst)
  end
  for _, f in ipairs({ "algorithm", "mode", "name" }) do
    if l[f] ~= nil then
      if type(l[f]) ~= "string" then
        return where .. ': "' .. f .. '" must be a string'
      end
      put_str(buf, f); put_str(buf, l[f])
    end
  end
  return nil
end

-- encode_request returns the whole frame (length prefix included) of req =
-- {id = uint, op = "check"|"ping"|..., attrs = map or {{name, value}, ...},
-- limits = {{key=, limit=, window_ms=, burst=, algorithm=, mode=, name=}, ...},
-- cost = uint (default 1; past 2^53, 2^53)}; or nil and an error naming the bad field.
function M.encode_request(req)
  local id, cost = req.id or 0, req.cost
  if cost == nil then cost = 1 end
  if type(cost) == "number" and cost > M.MAX_SAFE and cost < math.huge then
    -- Past 2^53 (every such number is an integer): 2^53, more than any rule's capacity,
    -- refused as cost_exceeds_capacity, as HAProxy's action and the other clients do with
    -- a cost past what they send. Refused here, the request went to the failure policy,
    -- which under "open" let it past every limit.
    cost = M.MAX_SAFE
  end
  if not is_uint(id) then
    return nil, '"id" must be an integer from 0 to 2^53'
  end
  if type(req.op) ~= "string" or req.op == "" then
    return nil, '"op" must be a non-empty string'
  end
  if not is_uint(cost) then
    return nil, '"cost" must be a non-negative integer'
  end
  local limits = req.limits or {}
  if type(limits) ~= "table" then
    return nil, '"limits" must be a table'
  end
  -- The map header counts the fields, known only after attrs is written: leave its
  -- slot and fill it in at the end.
  local buf = { "" }
  put_str(buf, "id"); put_uint(buf, id)
  put_str(buf, "op"); put_str(buf, req.op)
  local n = 2
  if req.attrs ~= nil then
    local na, err = put_attrs(buf, req.attrs)
    if not na then
      return nil, err
    end
    if na > 0 then n = n + 1 end
  end
  if #limits > 0 then
    n = n + 1
    put_str(buf, "limits")
    put_header(buf, #limits, 0x90, "\220")
    for i, l in ipairs(limits) do
      local lerr = put_limit(buf, i, l)
      if lerr then
        return nil, lerr
      end
    end
  end
  if cost ~= 1 then
    n = n + 1
    put_str(buf, "cost"); put_uint(buf, cost)
  end
  -- release and renew (concurrency leases): the lease token, and a renew's duration.
  if req.lease ~= nil and req.lease ~= "" then
    if type(req.lease) ~= "string" then
      return nil, '"lease" must be a string'
    end
    n = n + 1
    put_str(buf, "lease"); put_str(buf, req.lease)
  end
  if req.lease_ms ~= nil and req.lease_ms ~= 0 then
    if not is_uint(req.lease_ms) then
      return nil, '"lease_ms" must be a non-negative integer'
    end
    n = n + 1
    put_str(buf, "lease_ms"); put_uint(buf, req.lease_ms)
  end
  buf[1] = char(0x80 + n)
  local body = concat(buf)
  return be(#body, 4) .. body
end

-- frame_length returns the length announced by a 4-byte frame header.
function M.frame_length(h)
  local a, b, c, d = byte(h, 1, 4)
  return ((a * 256 + b) * 256 + c) * 256 + d
end

-- Decoding. Integers are built with integer arithmetic (256, not 2^8, which is a float
-- in Lua 5.3), so they stay integers where the runtime has them.

local function uint_at(s, pos, width)
  local n = 0
  for i = pos, pos + width - 1 do
    n = n * 256 + byte(s, i)
  end
  return n
end

local function uint64_at(s, pos)
  local hi, lo = uint_at(s, pos, 4), uint_at(s, pos + 4, 4)
  if hi >= 2097152 then -- >= 2^53: not an exact integer anywhere; the nearest float
    return hi * 4294967296.0 + lo
  end
  return hi * 4294967296 + lo
end

local function float_at(s, pos, width)
  -- IEEE 754 big-endian, for completeness: the daemon sends no floats.
  local b = { byte(s, pos, pos + width - 1) }
  local sign = b[1] >= 128 and -1 or 1
  local e, m, mbits, bias, emax
  if width == 4 then
    e = (b[1] % 128) * 2 + floor(b[2] / 128)
    m = ((b[2] % 128) * 256 + b[3]) * 256 + b[4]
    mbits, bias, emax = 23, 127, 255
  else
    e = (b[1] % 128) * 16 + floor(b[2] / 16)
    m = b[2] % 16
    for i = 3, 8 do m = m * 256 + b[i] end
    mbits, bias, emax = 52, 1023, 2047
  end
  if e == 0 then
    return sign * m * 2 ^ (1 - bias - mbits)
  elseif e == emax then
    return m == 0 and sign * math.huge or 0 / 0
  end
  return sign * (1 + m / 2 ^ mbits) * 2 ^ (e - bias)
end

local decode

local function decode_array(s, pos, n)
  local t = {}
  for i = 1, n do
    local v
    v, pos = decode(s, pos)
    t[i] = v
  end
  return t, pos
end

local function decode_map(s, pos, n)
  local t = {}
  for _ = 1, n do
    local k, v
    k, pos = decode(s, pos)
    v, pos = decode(s, pos)
    if k ~= nil then t[k] = v end
  end
  return t, pos
end

local TRUNCATED = "msgpack: truncated"

-- decode returns the msgpack value starting at s[pos] and the position after it. It
-- raises an error (a string starting "msgpack:") on truncated or unsupported input.
-- The common types come first, and nothing is allocated but the values themselves: it
-- runs once per check on the gateway's hot path.
function decode(s, pos)
  local t = byte(s, pos)
  if t == nil then
    error(TRUNCATED, 0)
  end
  if t < 0x80 then
    return t, pos + 1
  elseif t >= 0xa0 and t < 0xc0 then
    local e = pos + t - 0xa0
    if e > #s then error(TRUNCATED, 0) end
    return sub(s, pos + 1, e), e + 1
  elseif t < 0x90 then
    return decode_map(s, pos + 1, t - 0x80)
  elseif t < 0xa0 then
    return decode_array(s, pos + 1, t - 0x90)
  elseif t == 0xc2 then
    return false, pos + 1
  elseif t == 0xc3 then
    return true, pos + 1
  elseif t == 0xcc then
    if pos + 1 > #s then error(TRUNCATED, 0) end
    return byte(s, pos + 1), pos + 2
  elseif t == 0xcd then
    if pos + 2 > #s then error(TRUNCATED, 0) end
    local a, b = byte(s, pos + 1, pos + 2)
    return a * 256 + b, pos + 3
  elseif t == 0xce then
    if pos + 4 > #s then error(TRUNCATED, 0) end
    return uint_at(s, pos + 1, 4), pos + 5
  elseif t == 0xcf then
    if pos + 8 > #s then error(TRUNCATED, 0) end
    return uint64_at(s, pos + 1), pos + 9
  elseif t >= 0xe0 then
    return t - 256, pos + 1
  elseif t == 0xc0 then
    return nil, pos + 1
  elseif t >= 0xd0 and t <= 0xd3 then
    local w = (t == 0xd0) and 1 or (t == 0xd1) and 2 or (t == 0xd2) and 4 or 8
    if pos + w > #s then error(TRUNCATED, 0) end
    if byte(s, pos + 1) < 128 then
      return (w == 8) and uint64_at(s, pos + 1) or uint_at(s, pos + 1, w), pos + 1 + w
    end
    -- negative: -(256^w - n), computed in 32-bit halves so it stays exact
    local hi, lo = 0, uint_at(s, pos + 1, w)
    if w == 8 then
      hi, lo = uint_at(s, pos + 1, 4), uint_at(s, pos + 5, 4)
    end
    local top = (w == 8) and 4294967295 or 0
    local span = (w == 1) and 256 or (w == 2) and 65536 or 4294967296
    return -((top - hi) * 4294967296 + (span - lo)), pos + 1 + w
  elseif t == 0xca or t == 0xcb then
    local w = (t == 0xca) and 4 or 8
    if pos + w > #s then error(TRUNCATED, 0) end
    return float_at(s, pos + 1, w), pos + 1 + w
  elseif t == 0xd9 or t == 0xda or t == 0xdb or t == 0xc4 or t == 0xc5 or t == 0xc6 then
    local w = (t == 0xd9 or t == 0xc4) and 1 or (t == 0xda or t == 0xc5) and 2 or 4
    if pos + w > #s then error(TRUNCATED, 0) end
    local e = pos + w + uint_at(s, pos + 1, w)
    if e > #s then error(TRUNCATED, 0) end
    return sub(s, pos + 1 + w, e), e + 1
  elseif t == 0xdc or t == 0xdd then
    local w = (t == 0xdc) and 2 or 4
    if pos + w > #s then error(TRUNCATED, 0) end
    return decode_array(s, pos + 1 + w, uint_at(s, pos + 1, w))
  elseif t == 0xde or t == 0xdf then
    local w = (t == 0xde) and 2 or 4
    if pos + w > #s then error(TRUNCATED, 0) end
    return decode_map(s, pos + 1 + w, uint_at(s, pos + 1, w))
  end
  error(string.format("msgpack: unsupported type byte 0x%02x", t), 0)
end

-- decode_body returns the one msgpack value that body holds, or nil and an error when
-- body is malformed, truncated or has trailing bytes.
function M.decode_body(body)
  local ok, v, pos = pcall(decode, body, 1)
  if not ok then
    return nil, v
  end
  if pos ~= #body + 1 then
    return nil, "msgpack: " .. (#body + 1 - pos) .. " trailing bytes"
  end
  return v
end

return M
