-- resty.rlsidecar: the rlsidecar client for nginx / OpenResty (lua-nginx-module).
--
--   local rlsidecar = require "resty.rlsidecar"
--   local limiter = rlsidecar.new{ socket = "/run/rlsidecar/rlsidecar.sock" }
--   -- in access_by_lua_block:
--   limiter:access()  -- 429 / 503 and exit, or set the rate-limit headers and continue
--
-- Model. One check is one request/response on a cosocket to the daemon's Unix socket.
-- Connections are kept in nginx's per-worker pool (setkeepalive), so a check normally
-- reuses an open connection: no connect, one write, one read. A client object holds only
-- settings; it is safe to create once (init_by_lua, a module upvalue) and share between
-- requests of a worker.
--
-- When the sidecar gives no answer (socket missing, refused, closed, no answer within
-- timeout_ms), check returns the policy decision: allowed under on_unavailable = "open"
-- (the default), rejected with 503 under "closed"; degraded and unreachable either way,
-- with cause saying why. The connection is then closed, never pooled, so a late answer
-- cannot be read by the next request.
--
-- Requests are encoded and answers decoded by rlsidecar.codec (canonical bytes, checked
-- against proto/testdata/vectors.json), or with Debian's lua-mpack (decoder option).

local codec = require "rlsidecar.codec"
local http = require "rlsidecar.http"
local semaphore = require "ngx.semaphore" -- lua-resty-core, which lua-nginx-module 0.10.16+ requires

local ngx = ngx
local type, tostring, pairs, ipairs, setmetatable, next = type, tostring, pairs, ipairs, setmetatable, next

-- clock is the client's clock for every time it measures (a check's deadline, when a lease
-- is renewed, the log gates), in seconds: nginx's monotonic clock (resty.core.time's
-- monotonic_time, lua-resty-core 0.1.22 and later), which a step of the wall clock does
-- not move; ngx.now, the wall clock, only where that is missing. Timed on ngx.now, a step
-- back of an hour put every lease's next renewal an hour away: each lease then ran out
-- while its request still ran, and the slot was given to another request past the rule's
-- max (test/wallstep.sh).
local clock = ngx.now
do
  local ok, t = pcall(require, "resty.core.time")
  if ok and type(t) == "table" and type(t.monotonic_time) == "function" then
    clock = t.monotonic_time
  end
end

local _M = { _VERSION = "1.0.0" }
local mt = { __index = _M }

-- MAX_FRAME is the largest answer this client reads; a longer one means the stream is
-- not the daemon's, and the connection is dropped.
local MAX_FRAME = 1048576

-- DEFAULT_MAX_FRAME is the largest request frame (after the length) the daemon accepts
-- by default (serve --max-frame): max_frame's default.
local DEFAULT_MAX_FRAME = 65536

-- Answers are decoded by rlsidecar.codec: under LuaJIT it decodes a two-rule answer in
-- about 2.5 µs, against 11.9 µs for Debian's lua-mpack (C, but called through the Lua C
-- API, which LuaJIT does not compile), measured in the same nginx by
-- test/decode_bench.sh (on a shared machine; the ratio is the claim). lua-mpack stays
-- available: decoder = "lua-mpack" in new().
local mpack_ok, mpack = pcall(require, "mpack")
local unpacker = mpack_ok and mpack.Unpacker and mpack.Unpacker() or nil

-- mpack_decode_body decodes one answer with lua-mpack; nil when it is not installed.
local function mpack_decode_body(body)
  local ok, v, pos = pcall(unpacker, body)
  if not ok then
    return nil, "msgpack: " .. tostring(v)
  end
  if pos ~= #body + 1 or type(v) ~= "table" then
    return nil, "msgpack: not one map"
  end
  return v
end
_M.mpack_decode_body = unpacker and mpack_decode_body or nil

local decode_body = codec.decode_body
_M.decode_body = decode_body

-- new returns a client. opts:
--   socket          path of the daemon's socket, with or without "unix:" (required)
--   timeout_ms      connect, send and read timeout of one check (default 50)
--   on_unavailable  "open" (default) or "closed": the decision when the sidecar gives
--                   no answer
--   pool_size       idle connections kept per worker (default 16)
--   keepalive_ms    how long an idle connection stays in the pool (default 60000)
--   attrs           function() returning the attributes of the current request, a map
--                   or a list of {name, value}; default: ip, method, path
--   cost            function() returning the current request's cost (default 1)
--   decoder         "lua" (default: rlsidecar.codec) or "lua-mpack"
--   max_frame       the largest request frame sent, in bytes after the length (default
--                   65536, the daemon's default --max-frame): a larger request is not
--                   sent but refused with 431
--   renew_leases    renew a request's concurrency lease while it runs (default true; see
--                   keep_lease)
-- It returns nil and an error for bad options, an unknown one included.
local OPTIONS = { "socket", "timeout_ms", "on_unavailable", "pool_size", "keepalive_ms", "attrs", "cost",
  "decoder", "max_frame", "renew_leases" }
local is_option = {}
for _, k in ipairs(OPTIONS) do
  is_option[k] = true
end

function _M.new(opts)
  if type(opts) == "table" then
    -- A misspelled option (timeout for timeout_ms, the Node client's onUnavailable)
    -- would leave its default in force without a word: a location meant to fail closed
    -- would fail open. Every option is named, as the Node client's are.
    for k in pairs(opts) do
      if not is_option[k] then
        return nil, "rlsidecar.new: unknown option " .. string.format("%q", tostring(k)) ..
          " (options: " .. table.concat(OPTIONS, ", ") .. ")"
      end
    end
  end
  if type(opts) ~= "table" or type(opts.socket) ~= "string" or opts.socket == "" then
    return nil, "rlsidecar.new: opts.socket (the daemon's socket path) is required"
  end
  local path = opts.socket
  if path:sub(1, 5) ~= "unix:" then
    path = "unix:" .. path
  end
  local policy = opts.on_unavailable or "open"
  if policy ~= "open" and policy ~= "closed" then
    return nil, 'rlsidecar.new: on_unavailable must be "open" or "closed", not ' .. tostring(policy)
  end
  local timeout = opts.timeout_ms or 50
  if type(timeout) ~= "number" or timeout <= 0 then
    return nil, "rlsidecar.new: timeout_ms must be a positive number"
  end
  for _, f in pairs({ "attrs", "cost" }) do
    if opts[f] ~= nil and type(opts[f]) ~= "function" then
      return nil, "rlsidecar.new: opts." .. f .. " must be a function"
    end
  end
  local max_frame = opts.max_frame or DEFAULT_MAX_FRAME
  if type(max_frame) ~= "number" or max_frame < 1 or max_frame % 1 ~= 0 then
    return nil, "rlsidecar.new: max_frame must be a positive integer (bytes)"
  end
  -- Each option of the wrong type is refused here, not taken: pool_size = "16" failed a
  -- comparison, a Lua error, on a check's retry, and renew_leases = "false" renewed.
  local pool_size = opts.pool_size or 16
  if type(pool_size) ~= "number" or pool_size < 1 or pool_size % 1 ~= 0 then
    return nil, "rlsidecar.new: pool_size must be a positive integer"
  end
  local keepalive = opts.keepalive_ms or 60000
  if type(keepalive) ~= "number" or keepalive < 0 or keepalive % 1 ~= 0 then
    return nil, "rlsidecar.new: keepalive_ms must be a whole number of milliseconds"
  end
  if opts.renew_leases ~= nil and type(opts.renew_leases) ~= "boolean" then
    return nil, "rlsidecar.new: renew_leases must be true or false"
  end
  local decode = decode_body
  if opts.decoder == "lua-mpack" then
    if not unpacker then
      return nil, "rlsidecar.new: decoder lua-mpack: " .. tostring(mpack)
    end
    decode = mpack_decode_body
  elseif opts.decoder ~= nil and opts.decoder ~= "lua" then
    return nil, 'rlsidecar.new: decoder must be "lua" or "lua-mpack"'
  end
  return setmetatable({
    decode = decode,
    path = path,
    connect_opts = { pool = "rlsidecar:" .. path },
    timeout = timeout,
    policy = policy,
    pool_size = pool_size,
    keepalive = keepalive,
    attrs = opts.attrs,
    cost = opts.cost,
    max_frame = max_frame,
    renew_leases = opts.renew_leases ~= false,
  }, mt)
end

-- next_id numbers the requests of this worker; ids stay below 2^31.
local last_id = 0
local function next_id()
  last_id = last_id % 2147483647 + 1
  return last_id
end

-- drop closes sock and returns roundtrip's failure.
local function drop(sock, what, path, err)
  sock:close()
  return nil, what .. " " .. path .. ": " .. tostring(err), true
end

-- Connections holding leases, kept referenced until long after their request ended (two
-- generations of at most HOLD each): see hold.
local HOLD = 8192
local held, held_before, n_held = {}, {}, 0

-- hold keeps sock, whose check took a concurrency lease, out of the keepalive pool for
-- the rest of the current request. The daemon frees a connection's leases when it
-- closes, and the pool closes connections: past pool_size idle ones (a burst of checks
-- in flight together returns more than that), or after keepalive_ms idle; a pooled
-- connection holding leases would free slots of requests still running. nginx closes
-- the socket when the request that opened it ends (its cleanup, before the log phase),
-- which frees the lease even without log(). The references (ngx.ctx, and a table that
-- survives an internal redirect's new ngx.ctx) keep the garbage collector from closing
-- it sooner.
local function hold(sock)
  local ctx = ngx.ctx
  local socks = ctx.rlsidecar_lease_socks
  if socks then
    socks[#socks + 1] = sock
  else
    ctx.rlsidecar_lease_socks = { sock }
  end
  if n_held >= HOLD then
    held_before, held, n_held = held, {}, 0
  end
  n_held = n_held + 1
  held[n_held] = sock
end

-- left sets sock's timeouts to what is left until the deadline (dl.at, seconds as clock
-- gives them): one deadline bounds the whole exchange, where timeouts set once would
-- bound each step (connect, write, each read) by timeout_ms, several times it in all. Once it
-- has passed, one more step gets 1 ms, so that an answer already waiting on the socket
-- is read rather than dropped (nginx's clock moves once per turn of its event loop:
-- other requests' work in the same turn can pass the deadline without the daemon being
-- late); after that, false.
local function left(sock, dl)
  local ms = math.floor((dl.at - clock()) * 1000)
  if ms < 1 then
    if dl.late then
      return false
    end
    dl.late, ms = true, 1
  end
  sock:settimeouts(ms, ms, ms)
  return true
end

-- recv reads n bytes from sock by deadline: nil, the error ("timeout", "closed") and how
-- many bytes came otherwise. nginx re-arms a read's timer whenever bytes arrive, so a
-- peer writing its answer a byte at a time would hold one receive(n) for as long as it
-- liked; each receiveany waits for what is left of the deadline only. (A whole answer
-- arrives in one piece from the daemon, which writes it with one system call.)
local function recv(sock, n, deadline)
  local parts, got = nil, 0
  while true do
    if not left(sock, deadline) then
      return nil, "timeout", got
    end
    local b, err = sock:receiveany(n - got)
    if not b then
      return nil, err, got
    end
    if got == 0 and #b == n then
      return b
    end
    parts = parts or {}
    parts[#parts + 1] = b
    got = got + #b
    if got >= n then
      return table.concat(parts)
    end
  end
end

-- read_answer reads one answer from sock by deadline and decodes it: the answer map, or
-- nil and {what failed, why}.
local function read_answer(sock, decode, deadline)
  local head, err, got = recv(sock, 4, deadline)
  if not head then
    return nil, { "reading from", err, first = got == 0 }
  end
  local n = codec.frame_length(head)
  if n > MAX_FRAME then
    return nil, { "reading from", "an answer of " .. n .. " bytes" }
  end
  local body
  body, err = recv(sock, n, deadline)
  if not body then
    return nil, { "reading from", err }
  end
  local resp
  resp, err = decode(body)
  if type(resp) ~= "table" then
    return nil, { "decoding an answer from", err or "not a map" }
  end
  return resp
end

-- refusal returns the answer the daemon wrote before it stopped reading a request still
-- being written (an error about a request it could not read: id 0, frame_too_large),
-- closing sock; or nil when there is none.
local function refusal(sock, decode, deadline)
  local resp = read_answer(sock, decode, deadline)
  if resp and resp.id == 0 and type(resp.error) == "table" then
    sock:close()
    return resp
  end
  return nil
end

-- stale reports whether err, a failure to write a request on sock (writing true) or to
-- read the first byte of its answer, says the daemon had closed the connection without
-- reading the request: one taken from the pool (reused) whose close nginx had not seen
-- yet (a graceful restart, --idle-timeout). The request was not decided then, so it is
-- sent again on another connection. That is so when the write fails (nothing of the
-- frame was taken), and when the read is reset: on a Unix socket a peer that closes
-- with bytes unread resets the connection, and the daemon reads a frame whole before
-- deciding it. Not after end-of-file ("closed") on the read: the daemon then took every
-- byte sent and closed without answering (it died, or a drain timed out, while deciding
-- a request it may have counted), and a resend could count the check twice
-- (proto/PROTOCOL.md: only what the drain's farewell leaves unanswered is unread). Before,
-- that end-of-file was sent again too, as the Go, Python, Node and HAProxy clients never do.
-- A new connection whose write fails or whose read is reset was closed unread as well:
-- by a daemon that died (SIGKILL) or stopped having accepted it. stale returns "new"
-- for it, and roundtrip sends the request again once (a daemon that closes every
-- connection it accepts is not connected to again and again). Before, such a request
-- went to the policy: a SIGKILL of a socket-activated daemon under load answered three
-- /glob/ and /lease/ checks of a closed client 503 ("writing to ...: broken pipe") that
-- its successor, up at once on the same socket, would have decided (scratch probe).
local function stale(sock, err, writing)
  if err ~= "connection reset by peer" and not (writing and (err == "broken pipe" or err == "closed")) then
    return false
  end
  local n = sock:getreusedtimes()
  if n == 0 then
    return "new"
  end
  return n ~= nil and n > 0
end

-- resendable reports whether a release (idempotent: a second one answers released: false)
-- is sent again after err, a failure to write it or to read its answer: the connection
-- broke (the daemon closed it, died or was restarted), whether or not the daemon had read
-- the release, on a pooled connection or a new one; not after a timeout (the deadline has
-- passed). As the Go, Python and Node clients do: a release the daemon read and then
-- closed on unanswered (SIGKILL while deciding it, a drain that timed out), not sent
-- again, left a global lease's slots held in Redis for the whole lease, with no request
-- running (a SIGKILL under load left one of a rule's four slots held: one request in four
-- refused until the lease ran out).
local function resendable(err)
  return err == "closed" or err == "connection reset by peer" or err == "broken pipe"
end

-- Failed connects back off, per worker and socket path: from 10 ms, doubling up to 1 s,
-- a random half to all of each wait (as the Go, Python and Node clients' dials). While a
-- path backs off, its checks are decided by the policy at once, without a connect. nginx
-- logs each connect() that fails itself, whatever lua_socket_log_errors says (at error
-- for a refused one, at crit for a missing socket file): before, a daemon away logged
-- one line a request (5,800 in a second's restart under 20 clients), now about one a
-- second a worker. The first answer after a failure ends the backoff. A connection the
-- daemon refuses as it accepts it (too_many_connections: it is at its --max-conns) is a
-- failed connect too, as in the Go, Python and Node clients: before, every check connected
-- again to a daemon at its cap, and was refused again.
local BACKOFF_MIN, BACKOFF_MAX = 0.010, 1.0
local dial_failures = {} -- path -> { n = failed connects in a row, retry_at = clock() seconds, err = the last }

local function backoff(n)
  local d = n >= 8 and BACKOFF_MAX or math.min(BACKOFF_MIN * 2 ^ (n - 1), BACKOFF_MAX)
  return d / 2 + math.random() * d / 2
end

-- dial_failed counts a failed connect to self's socket (why) and sets when the next may be.
local function dial_failed(self, why)
  local f = dial_failures[self.path] or { n = 0 }
  f.n, f.err = f.n + 1, why
  f.retry_at = clock() + backoff(f.n)
  dial_failures[self.path] = f
end

-- refused returns attempt's failure when resp, an error with id 0, is the daemon's
-- too_many_connections: the connection (closed) refused as it was accepted, a failed
-- connect, backed off and decided by the policy (unreachable). Else nil.
local function refused(self, resp)
  local e = resp.error
  if e.code ~= "too_many_connections" then
    return nil
  end
  local why = "reading from " .. self.path .. ": too_many_connections: " .. tostring(e.message)
  dial_failed(self, why)
  return why
end

-- attempt is one try of roundtrip on a connection from the pool or a new one; retry
-- (its fourth value) says the connection was a stale pooled one (see stale), or, for a
-- release (idem), that it broke (see resendable).
local function attempt(self, frame, id, deadline, idem)
  local sock = ngx.socket.tcp()
  if not left(sock, deadline) then
    return nil, "connecting to " .. self.path .. ": timeout", true
  end
  local ok, err = sock:connect(self.path, self.connect_opts)
  if not ok then
    local why = "connecting to " .. self.path .. ": " .. tostring(err)
    dial_failed(self, why)
    return nil, why, true
  end
  if not left(sock, deadline) then
    return drop(sock, "writing to", self.path, "timeout")
  end
  ok, err = sock:send(frame)
  if not ok then
    -- The daemon refuses a frame over its --max-frame from its header: it answers
    -- frame_too_large and closes, and the rest of a large frame then fails to go (broken
    -- pipe, connection reset). Its answer is still readable: that refusal, not the failure
    -- policy, is the request's answer. (Not after a send that timed out: the daemon is
    -- stalled, and the request has had its time.)
    local resp = err ~= "timeout" and refusal(sock, self.decode, deadline)
    if resp then
      local why = refused(self, resp)
      if why then
        return nil, why, true
      end
      return resp
    end
    local retry = stale(sock, err, true) or (idem and resendable(err))
    local r1, r2, r3 = drop(sock, "writing to", self.path, err)
    return r1, r2, r3, retry
  end
  local resp
  resp, err = read_answer(sock, self.decode, deadline)
  if not resp then
    local retry = (err.first and stale(sock, err[2])) or (idem and resendable(err[2]))
    local r1, r2, r3 = drop(sock, err[1], self.path, err[2])
    return r1, r2, r3, retry
  end
  if resp.id ~= id then
    if resp.id == 0 and type(resp.error) == "table" then
      sock:close() -- an error about a request the daemon could not read (frame_too_large: it closes)
      if resp.error.code == "shutting_down" then
        -- The drain's farewell (or a connection it accepted and does not serve): the
        -- request was not read, so not decided: sent again on another connection.
        return nil, "reading from " .. self.path .. ": shutting_down", true, true
      end
      local why = refused(self, resp)
      if why then
        return nil, why, true
      end
      return resp
    end
    return drop(sock, "reading from", self.path, "an answer to request " .. tostring(resp.id) .. ", not " .. id)
  end
  local lease = resp.lease
  if lease ~= nil and lease ~= "" then
    hold(sock)
  else
    sock:setkeepalive(self.keepalive, self.pool_size)
  end
  return resp
end

-- roundtrip sends one encoded frame and returns the decoded answer, or nil, an error
-- and whether the failure is the transport's (the socket is then closed). A check's
-- answer that takes a lease leaves its connection held (see hold), not pooled. A request
-- that found its pooled connection closed by the daemon (a restart, --idle-timeout) is
-- sent again on the next one, a new one once the pool is empty, all within the one
-- deadline: before, it went to the failure policy (a closed rule's 503) while the
-- daemon was up. idem: the frame is a release, sent again whenever its connection broke
-- (see resendable).
function _M.roundtrip(self, frame, id, idem)
  ngx.update_time() -- the cached clock may be a whole event-loop turn old
  local now = clock()
  local f = dial_failures[self.path]
  if f and now < f.retry_at then
    return nil, "backing off after " .. f.n .. " failed attempt(s): " .. f.err, true
  end
  local deadline = { at = now + self.timeout / 1000, late = false }
  local tries, new_retried = 0, false
  while true do
    local resp, err, transport, retry = attempt(self, frame, id, deadline, idem)
    tries = tries + 1
    if retry == "new" then
      if new_retried and not idem then
        retry = false
      end
      new_retried = true
    end
    if resp and dial_failures[self.path] then
      dial_failures[self.path] = nil -- it answers again
    end
    if not retry or tries > self.pool_size then
      return resp, err, transport
    end
  end
end

-- check asks the sidecar whether a request with attrs (a map, or a list of {name, value}
-- to keep their order) may pass. opts: cost (default 1), limits (inline limits, see
-- proto/PROTOCOL.md). It returns a decision (see rlsidecar.http) and nil; or, when the
-- sidecar answered with an error (a bug in what was sent: bad_request, invalid_limit,
-- ...) or the arguments are invalid, the policy decision and the error as a string.
-- A request whose frame is over max_frame is not sent: the decision refuses it (reason
-- request_too_large, a 431 by rlsidecar.http.rejection) and the error says so; the same
-- when the daemon answers frame_too_large (its --max-frame is smaller) or attr_too_large
-- (a value longer than its --max-attr-len).
function _M.check(self, attrs, opts)
  local id = next_id()
  local frame, err = codec.encode_request({ id = id, op = "check", attrs = attrs,
    cost = opts and opts.cost, limits = opts and opts.limits })
  if not frame then
    return http.policy_decision(self.policy, err), "rlsidecar: " .. err
  end
  if #frame - 4 > self.max_frame then
    local msg = "rlsidecar: frame_too_large: request frame of " .. (#frame - 4) .. " bytes exceeds max_frame "
      .. self.max_frame .. "; it was not sent"
    return http.too_large_decision(msg), msg
  end
  local resp, rerr = self:roundtrip(frame, id)
  if not resp then
    return http.policy_decision(self.policy, rerr), nil
  end
  if resp.error then
    local e = resp.error
    local msg = "rlsidecar: " .. tostring(e.code) .. ": " .. tostring(e.message)
    if http.too_large_code(e.code) then
      return http.too_large_decision(msg), msg
    end
    local d = http.policy_decision(self.policy, msg)
    d.unreachable = false
    return d, msg
  end
  if resp.rules == nil then resp.rules = {} end
  if resp.rule == nil then resp.rule = "" end
  return resp, nil
end

-- call sends req (a ping, a release or a renew) and returns its answer, or nil and an
-- error when it could not be encoded, the sidecar did not answer, or it answered an error.
local function call(self, req)
  local id = next_id()
  req.id = id
  local frame, err = codec.encode_request(req)
  if not frame then
    return nil, "rlsidecar: " .. err
  end
  local resp, rerr = self:roundtrip(frame, id, req.op == "release")
  if not resp then
    return nil, rerr
  end
  if resp.error then
    return nil, "rlsidecar: " .. tostring(resp.error.code) .. ": " .. tostring(resp.error.message)
  end
  return resp
end

-- ping asks the daemon for its version: it returns the version string and the protocol
-- number, or nil and an error (health checks; it does not consult the policy).
function _M.ping(self)
  local resp, err = call(self, { op = "ping" })
  if not resp then
    return nil, err
  end
  return resp.version, resp.protocol
end

-- release frees the slots a concurrency lease (decision.lease) holds: it returns true
-- when it did, false when the lease was unknown, expired or already released, or nil and
-- an error when the sidecar did not answer. Cosockets are not available in the log
-- phase: release from a later phase that has them, or from ngx.timer.at(0, ...) in
-- log_by_lua. The sidecar also frees a lease when the connection that took it closes:
-- check() keeps that connection out of the keepalive pool, and nginx closes it when
-- the request that made the check ends (see hold).
function _M.release(self, lease)
  if lease == nil or lease == "" then
    return false
  end
  local resp, err = call(self, { op = "release", lease = lease })
  if not resp then
    return nil, err
  end
  return resp.released == true
end

-- renew extends a live lease to lease_ms from now (nil or 0: each of its rules' own
-- lease): it returns whether it did and the lease's time left in ms (0 when it was
-- unknown, expired or released), or nil and an error when the sidecar did not answer.
function _M.renew(self, lease, lease_ms)
  local resp, err = call(self, { op = "renew", lease = lease, lease_ms = lease_ms })
  if not resp then
    return nil, err
  end
  return resp.renewed == true, tonumber(resp.expires_ms) or 0
end

-- Leases access() renews (see keep_lease), until log() releases them: lease -> { self =
-- the client, due = when it is to be renewed at the latest, from = when it may be renewed
-- at the earliest, expires = its last known expiry (clock() seconds), busy = a renewal is
-- under way }.
local renewing = {}

-- MIN_RENEWAL is the shortest wait between two renewals of a lease, in seconds.
local MIN_RENEWAL = http.MIN_RENEWAL_MS / 1000

-- RENEW_PARALLEL is how many renewals one tick has under way at once.
local RENEW_PARALLEL = 32

-- first_renewal is when access() first renews d's lease, in seconds (see
-- http.first_renewal_ms).
local function first_renewal(d)
  return http.first_renewal_ms(d) / 1000
end

-- set_due schedules e's next renewal wait seconds after now: due then, from a quarter of
-- the wait earlier (a tick renews every lease past its from, so that leases due close
-- together share one tick).
local function set_due(e, now, wait)
  if wait < MIN_RENEWAL then wait = MIN_RENEWAL end
  e.due = now + wait
  e.from = now + wait * 0.75
end

-- The renewals of a worker are woken by one timer, the tick, at the earliest due among
-- them: before, each leased request scheduled a timer of its own at its first renewal
-- (half its shortest window), still pending after the request ended (a timer cannot be
-- cancelled). A leased request of 20 ms under a 60 s lease held a pending timer for 30 s,
-- so about 34 leased requests a second took a worker's lua_max_pending_timers (1,024),
-- and then every access() and log() of the worker failed to schedule its renewal and
-- its release ("too many pending timers", logged each time) and a request longer than
-- its lease lost its slot while it ran. Now the timers pending are the ticks (one, or a
-- few when a nearer due arrives), and renewing holds only the leases of requests still
-- running (log() removes its own).
local tick_at -- when the nearest pending tick fires (clock() seconds), or nil
local tick_log_gate = http.gate(1)
local tick

local function wake_by(at)
  if tick_at and tick_at <= at then
    return
  end
  local wait = at - clock()
  if wait < 0 then wait = 0 end
  local ok, err = ngx.timer.at(wait, tick, at)
  if not ok then
    local held = tick_log_gate(clock())
    if held then
      ngx.log(ngx.ERR, "rlsidecar: scheduling lease renewals: ", err, http.held_note(held))
    end
    return
  end
  tick_at = at
end

-- renew_one renews lease (its entry e) and sets its next due, as the sidecar answered:
-- renewed, at half of what is left; gone (released, expired, or freed with the
-- connection that took it: without log(), nginx closes it as the request ends), no more;
-- no answer, at half of what is left of its last known expiry, none once that has passed.
-- A lease whose request has ended (without log(): nginx closed the connection that took
-- it, e.sock) is released instead, and dropped once that is answered: the daemon that
-- answers may not be the one that took it. One SIGKILLed never read the close, and its
-- successor (systemd's socket, a blue/green handover) renews a global lease it finds in
-- Redis for as long as it is asked: before, such a lease was renewed for as long as the
-- worker ran (scratch probe: a 2 s request under a 3 s global lease, the daemon
-- SIGKILLed 1 s in, the slot still held in Redis 12 s after the request ended).
local function renew_one(lease, e)
  if e.sock and e.sock:getreusedtimes() == nil then -- closed: nil, "closed"
    local released = e.self:release(lease)
    if renewing[lease] ~= e then
      return
    end
    e.busy = false
    ngx.update_time()
    local now = clock()
    local left = e.expires - now
    if released ~= nil or left <= 0 then
      renewing[lease] = nil
      return
    end
    set_due(e, now, left / 2)
    wake_by(e.due)
    return
  end
  local renewed, left_ms = e.self:renew(lease)
  if renewing[lease] ~= e then
    return -- released meanwhile
  end
  e.busy = false
  ngx.update_time()
  local now = clock()
  if renewed == nil then
    local left = e.expires - now
    if left <= 0 then
      renewing[lease] = nil
      return
    end
    set_due(e, now, left / 2)
  elseif not renewed then
    renewing[lease] = nil
    return
  else
    e.expires = now + left_ms / 1000
    set_due(e, now, left_ms / 2000)
  end
  wake_by(e.due)
end

tick = function(premature, at)
  if tick_at == at then
    tick_at = nil
  end
  if premature then
    return -- the worker is exiting
  end
  ngx.update_time()
  local now = clock()
  local due, nearest = {}, nil
  for lease, e in pairs(renewing) do
    if not e.busy then
      if e.from <= now then
        e.busy = true
        due[#due + 1] = lease
      elseif not nearest or e.due < nearest then
        nearest = e.due
      end
    end
  end
  if nearest then
    wake_by(nearest)
  end
  -- The due renewals, RENEW_PARALLEL at a time, in light threads of this timer.
  local i = 1
  while i <= #due do
    local threads = {}
    for k = i, math.min(i + RENEW_PARALLEL - 1, #due) do
      local lease = due[k]
      local e = renewing[lease]
      if e then
        local th, err = ngx.thread.spawn(renew_one, lease, e)
        if th then
          threads[#threads + 1] = th
        else
          e.busy = false
          ngx.log(ngx.ERR, "rlsidecar: renewing a lease: ", err)
        end
      end
    end
    for _, th in ipairs(threads) do
      ngx.thread.wait(th)
    end
    i = i + RENEW_PARALLEL
  end
end

-- keep_lease renews lease, first after first seconds, then at half of what each renewal
-- answers is left of it, until log() releases it (renewing[lease] cleared). It stops by
-- itself when a renewal answers that the lease is gone (without log(), nginx closes the
-- connection that took it as the request ends, and the daemon frees it), and when the
-- sidecar does not answer until the lease's last known expiry: life seconds (the lease's
-- duration, http.lease_life_ms) until a renewal answers, 2 × first when 0. sock: the
-- connection that took it (see renew_one). See tick.
local function keep_lease(self, lease, first, life, sock)
  local now = clock()
  local e = { self = self, expires = now + (life and life > 0 and life or 2 * first), busy = false, sock = sock }
  set_due(e, now, first)
  renewing[lease] = e
  wake_by(e.due)
end

-- Releases under way, by client connection ($connection): log() cannot release before
-- the response has gone (cosockets are not available after the content phase), so a
-- client that sends its next request on the same connection the moment a response
-- arrives could be checked before the release reached the daemon, and find the slot
-- still held. access() waits for its connection's releases first (at most timeout_ms).
-- An entry is { n = releases not yet answered, sema = an ngx.semaphore, made by the
-- first request that waits }; the release that brings n to 0 removes the entry and
-- wakes every request waiting on sema (HTTP/2 streams share a connection).
local releasing = {}

-- released counts one release of conn's as answered (or failed), and wakes the requests
-- waiting for conn's releases when it was the last.
local function released(conn)
  local r = releasing[conn]
  if not r then
    return
  end
  r.n = r.n - 1
  if r.n > 0 then
    return
  end
  releasing[conn] = nil
  local sema = r.sema
  if sema then
    local waiting = -sema:count()
    if waiting > 0 then
      sema:post(waiting)
    end
  end
end

-- log releases the lease access() kept for the current request (a concurrency rule's
-- slot), once the request has ended; call it from log_by_lua_block beside every
-- access_by_lua_block that calls access():
--
--   location /v1/exports/ {
--     access_by_lua_block { rl_open:access() }
--     log_by_lua_block    { rl_open:log() }
--     proxy_pass http://app;
--   }
--
-- Cosockets are not available in the log phase, so the release runs in a zero-delay
-- timer (ngx.timer.at), after the response has gone to the client. (Without log(), the
-- slot is freed when nginx closes, as the request ends, the connection that took it: see
-- hold; log() makes it an explicit release, counted released, that the next request on
-- the client connection waits for.) It returns true when a release was scheduled. The next request on the same client connection waits in
-- access() until the release is answered (see releasing).
function _M.log(self)
  local ctx = ngx.ctx
  local lease = ctx.rlsidecar_lease
  if not lease then
    return false
  end
  ctx.rlsidecar_lease = nil
  renewing[lease] = nil
  local conn = ngx.var.connection
  local ok, err = ngx.timer.at(0, function(premature)
    if not premature then
      local _, rerr = self:release(lease)
      if rerr then
        ngx.log(ngx.WARN, "rlsidecar: releasing a lease: ", rerr)
      end
    end
    released(conn)
  end)
  if not ok then
    ngx.log(ngx.ERR, "rlsidecar: scheduling a lease release: ", err)
    return false
  end
  local r = releasing[conn]
  if r then
    r.n = r.n + 1
  else
    releasing[conn] = { n = 1 }
  end
  return true
end

-- wait_releases waits, at most timeout_ms, until the releases log() scheduled for
-- earlier requests of the current client connection are answered: it sleeps on the
-- connection's semaphore, which the last of them posts (no polling).
local function wait_releases(timeout_ms)
  if next(releasing) == nil then
    return -- none under way in this worker: no variable looked up
  end
  local r = releasing[ngx.var.connection]
  if not r then
    return
  end
  local sema = r.sema
  if not sema then
    local err
    sema, err = semaphore.new()
    if not sema then
      ngx.log(ngx.ERR, "rlsidecar: waiting for a lease release: ", err)
      return
    end
    r.sema = sema
  end
  sema:wait(timeout_ms / 1000) -- woken by released(), or "timeout"
end

-- client_ip returns the ip attribute of the current request: $remote_addr as
-- rlsidecar.http.peer_ip gives it (an IPv4-mapped IPv6 address as its IPv4 address), or
-- nil when the client has no address: a request to a `listen unix:...` server, whose
-- $remote_addr is "unix:" (unless real_ip set it from the proxy's header). nil leaves
-- the attribute out of a check, as the other clients leave out a Unix socket's peer
-- (clients/testdata/ips.json): sent as "unix:", every request behind the local proxy
-- shared one per-ip bucket, and a per-ip rule limited all clients together.
function _M.client_ip()
  local addr = ngx.var.remote_addr
  if addr == nil or addr == "" or addr:sub(1, 5) == "unix:" then
    return nil
  end
  return http.peer_ip(addr)
end

-- default_attrs are the attributes of the current request: ip (client_ip; left out when
-- the client has no address), method and path (without the query), sorted by name, as
-- the Go client's DefaultAttrs.
function _M.default_attrs()
  local ip = _M.client_ip()
  if ip == nil then
    return { { "method", ngx.req.get_method() }, { "path", ngx.var.uri or "" } }
  end
  return {
    { "ip", ip },
    { "method", ngx.req.get_method() },
    { "path", ngx.var.uri or "" },
  }
end

-- Requests this worker has decided, by $request_id, so that access() decides a request
-- once however many locations it passes through: ngx.ctx does not survive an internal
-- redirect (try_files ... @app, error_page, rewrite ... last, index), $request_id does.
-- Two generations of at most REMEMBER entries each: when the current one is full it
-- becomes the previous one and the one before is dropped, so a request is remembered
-- for at least the REMEMBER checks that follow it (a second access() after more than
-- that would ask the daemon again: counted twice, as before, never let through). An
-- entry is the response access() gave, not the whole decision: about 330 bytes (a
-- decision with its rules is over 1 KB), at most 5.5 MB a worker.
local REMEMBER = 8192
local decided, decided_before, n_decided = {}, {}, 0

local function remember(id, e)
  if n_decided >= REMEMBER then
    decided_before, decided, n_decided = decided, {}, 0
  end
  decided[id] = e
  n_decided = n_decided + 1
end

-- answer returns what access() does for the decision d, to apply and remember: a
-- refusal's status, headers and body, or an allowed request's headers, lease and delay.
local function answer(d)
  if not d.allowed then
    local status, headers, body = http.rejection(d)
    return { allowed = false, status = status, headers = headers, body = body }
  end
  local lease = d.lease
  if lease == "" then lease = nil end
  return { allowed = true, headers = http.headers(d), lease = lease, delay_ms = tonumber(d.delay_ms),
    renew_in = lease and first_renewal(d), life = lease and http.lease_life_ms(d) / 1000 }
end

-- nil until the first access(); then whether nginx keeps $request_id for the request.
local request_id_kept

-- request_key returns the key access() remembers the current request's decision by, or
-- nil when there is none: in a subrequest (checked on its own: its location and
-- attributes are not the main request's, and auth_request's share the main request's
-- $request_id), or when nginx does not keep $request_id. nginx computes $request_id
-- once per request and keeps it across internal redirects only when the configuration
-- names it (proxy_set_header X-Request-Id $request_id, a log_format, ...); otherwise
-- every read is a new random id, access() cannot recognize a request it has seen, and it
-- says so once per worker.
local function request_key()
  if ngx.is_subrequest then
    return nil
  end
  local id = ngx.var.request_id
  if request_id_kept == nil then
    request_id_kept = id ~= nil and ngx.var.request_id == id
    if not request_id_kept then
      ngx.log(ngx.ERR, "rlsidecar: nginx does not keep $request_id for the request (the configuration does not ",
        "name it), so access() checks a request again in each location an internal redirect takes it to; ",
        "add e.g. proxy_set_header X-Request-Id $request_id; to the server block")
    end
  end
  if request_id_kept then
    return id
  end
  return nil
end

-- abort_held ends a request whose client went away while access() held it (a delay).
local function abort_held()
  return ngx.exit(499)
end

-- apply gives the current request the answer e (from answer), by client self. again: e
-- was remembered, it was given already in an earlier location (no second wait, and its
-- lease renewed already).
local function apply(self, e, again)
  if not e.allowed then
    for k, v in pairs(e.headers) do
      ngx.header[k] = v
    end
    ngx.header["Content-Length"] = #e.body
    ngx.status = e.status
    ngx.print(e.body)
    return ngx.exit(e.status)
  end
  for k, v in pairs(e.headers) do
    ngx.header[k] = v
  end
  if e.lease then
    -- A concurrency rule's slot: held until log() releases it when the request ends
    -- (after an internal redirect too: ngx.ctx is new there).
    ngx.ctx.rlsidecar_lease = e.lease
    if not again and self.renew_leases then
      local socks = ngx.ctx.rlsidecar_lease_socks -- the last is this check's (hold)
      keep_lease(self, e.lease, e.renew_in, e.life, socks and socks[#socks])
    end
  end
  local delay = e.delay_ms
  if not again and delay and delay > 0 then
    -- With lua_check_client_abort on, a client that goes away while its request is held
    -- ends the request (499) at once: nothing is forwarded for it, and its lease is
    -- freed as the request ends (log(), or the close of the connection that took it).
    -- ngx.on_abort fails when the directive is off (or a handler is registered already);
    -- the request is then held to the end of its delay, as nginx cannot see the client go.
    ngx.on_abort(abort_held)
    ngx.sleep(delay / 1000)
  end
end

-- access checks the current request and acts on the decision; call it from
-- access_by_lua_block:
--   - rejected: 429 with Retry-After, RateLimit-Policy, RateLimit and a problem+json body,
--     and the request ends;
--   - allowed: RateLimit-Policy and RateLimit are set on the response, and the request
--     goes on (to proxy_pass, ...), after ngx.sleep(delay_ms) when a rule with delay
--     asks for a wait (its tokens are reserved: nginx's limit_req without nodelay, shared
--     by every gateway of the daemon); with `lua_check_client_abort on;` a client that
--     goes away during that wait ends the request (499, nothing forwarded, its lease
--     freed), without it the request is held to the end of the wait;
--   - no answer from the sidecar: "open" goes on without rate-limit headers, "closed"
--     answers 503 with Retry-After: 1 and a problem+json body;
--   - too large to be checked (its frame over max_frame, e.g. a huge header the attrs
--     function sends): 431 and a problem+json body, whatever the policy, logged at info
--     (the client's doing, as nginx logs a too long header line).
-- An error answer is logged and follows the policy. It returns the decision (the second
-- time for a request, see below, { allowed = ..., again = true }).
--
-- A request is checked once: the daemon's decision is remembered by $request_id (see
-- request_key), and a later access() for the same request, in another location after an
-- internal redirect (with this client or another), applies it again — the same status,
-- headers and body, the lease kept for log(), no second wait — without asking the
-- daemon, and returns { allowed = ..., again = true }. The policy's answer when the daemon gave none is not remembered: the next
-- location asks again and follows its own client's policy. A subrequest is checked on
-- its own, each time. Its log lines about a request without a decision are at most one
-- a second a worker, each saying how many it stands for.
local log_gate = http.gate(1)

function _M.access(self)
  local key = request_key()
  if key then
    local e = decided[key] or decided_before[key]
    if e then
      apply(self, e, true)
      return { allowed = e.allowed, again = true }
    end
  end
  wait_releases(self.timeout)
  local attrs = self.attrs and self.attrs() or _M.default_attrs()
  local cost = self.cost and self.cost() or nil
  if http.bad_cost(cost) then
    -- Not a cost (a cost function reading a header: "-1", "1.5", "nan"): 400 whatever the
    -- policy, as HAProxy's action answers. Before, the encoder refused it and the policy
    -- decided: under "open", such a request passed every limit.
    ngx.log(ngx.INFO, "rlsidecar: the cost function's ", tostring(cost), " is not a non-negative integer: refused (400)")
    ngx.header["Content-Type"] = "application/problem+json"
    ngx.header["Content-Length"] = #http.BAD_COST_BODY
    ngx.status = 400
    ngx.print(http.BAD_COST_BODY)
    return ngx.exit(400)
  end
  local d, err = self:check(attrs, { cost = cost })
  if d.reason == http.REQUEST_TOO_LARGE then
    ngx.log(ngx.INFO, err)
  elseif err or d.unreachable then
    local held = log_gate(clock())
    if held == nil then
      -- held back: at most one line a second a worker (http.gate)
    elseif d.unreachable then
      ngx.log(ngx.WARN, "rlsidecar: no decision, policy ", self.policy, ": ", d.cause, http.held_note(held))
    elseif http.busy_error(err) then
      ngx.log(ngx.WARN, err, http.held_note(held))
    else
      ngx.log(ngx.ERR, err, http.held_note(held))
    end
  end
  local e = answer(d)
  if key and not err and not d.unreachable then
    remember(key, e)
  end
  apply(self, e, false)
  return d
end

return _M
