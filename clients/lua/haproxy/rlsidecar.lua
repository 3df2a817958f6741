-- The rlsidecar client for HAProxy (Lua 5.3/5.4, HAProxy 2.2 and later). Load it with
--
--   global
--     lua-prepend-path /usr/share/rlsidecar/lua/?.lua
--     lua-load /usr/share/rlsidecar/lua/haproxy/rlsidecar.lua
--
-- and use its action in an HTTP frontend, with rules that add its headers to the
-- response (examples/haproxy.cfg):
--
--   http-request  lua.rlsidecar unix@/run/rlsidecar/rlsidecar.sock open 50
--   http-after-response set-header RateLimit-Policy %[var(txn.rlsidecar_ratelimit_policy)] if { var(txn.rlsidecar_ratelimit_policy) -m found }
--   http-after-response set-header RateLimit %[var(txn.rlsidecar_ratelimit)] if { var(txn.rlsidecar_ratelimit) -m found }
--   http-after-response set-header RateLimit-Warning %[var(txn.rlsidecar_ratelimit_warning)] if { var(txn.rlsidecar_ratelimit_warning) -m found }
--
-- (or `http-response lua.rlsidecar_headers`, the action that adds them to the server's
-- responses only, not to HAProxy's own: a 502, a 503, a 504).
-- `lua.rlsidecar SOCKET POLICY TIMEOUT_MS` checks the request's attributes ip (the
-- client address; an IPv4-mapped IPv6 one as its IPv4 address), method and path with the daemon at SOCKET
-- (unix@/path). A rejection is answered at once: 429 with Retry-After, RateLimit-Policy,
-- RateLimit and a problem+json body, exactly as the Go client. An allowed request goes on,
-- and the rules above add RateLimit-Policy and RateLimit to its response. When
-- the sidecar gives no answer within TIMEOUT_MS (or the socket is missing), POLICY
-- decides: `open` lets the request through without rate-limit headers, `closed` answers
-- 503 with Retry-After: 1; the decision is degraded either way and the cause is logged.
-- A POLICY that is neither decides as `closed`, and a TIMEOUT_MS that is not a positive
-- number is 50, with an alert (at most one a second): HAProxy gives an action its
-- arguments only when it runs, too late to refuse the configuration.
--
-- The path is HAProxy's raw path normalized by rlsidecar.path as nginx's $uri is (query
-- dropped, %XX decoded once, slashes merged, dot segments removed: /log%69n, //login and
-- /a/../login are all /login), so a rule limits the same requests through either
-- gateway. The sample fetch `lua.rlsidecar_path` returns that path, for ACLs that choose
-- which requests are checked (a `path_beg /static/` ACL on the raw path would let
-- /static/../login through unchecked).
--
-- A request whose frame is over RLSIDECAR_MAX_FRAME bytes (an environment variable,
-- read when the file is loaded: `setenv RLSIDECAR_MAX_FRAME 131072` in global before
-- lua-load; default 65536, the daemon's default --max-frame, which the daemon reads from
-- the same variable) is not sent: it is answered 431 (Request Header Fields Too Large),
-- whatever POLICY says, and so is one the daemon refuses as frame_too_large.
--
-- Set the transaction variable txn.rlsidecar_user (e.g. `http-request set-var(txn.rlsidecar_user)
-- req.fhdr(x-user)`, the whole header: examples/haproxy.cfg says why) to add a `user` attribute, txn.rlsidecar_api_key for `api_key`, and
-- txn.rlsidecar_cost for the cost.
--
-- Connections: HAProxy's Lua sockets belong to the stream that opened them, so each check
-- opens a connection to the Unix socket, makes one request and closes it (no pool).
-- Concurrency leases: when the answer carries a lease (a concurrency rule's slot), that
-- connection stays open, holding the slot, for as long as the transaction lasts: the
-- response body included (a long download holds its slot to the end), whether the
-- response comes from the server or from HAProxy (a 502, a 504), and whether or not
-- `lua.rlsidecar_headers` runs. The action keeps the socket in the transaction's private
-- data; when the transaction ends (completed, or aborted by the client or the server),
-- HAProxy frees the stream's Lua context and collects its garbage (it forces a collection
-- for a context that opened sockets), which closes the socket, and the daemon frees the
-- leases of a connection that closes (counted `closed` in rlsidecar_leases_total). With
-- keep-alive each request is a transaction of its own, and the next request's check on an
-- HTTP/1 client connection first releases the leases of the one before (see pending), so
-- it does not race the daemon's reading of that close. A transaction longer than its
-- lease keeps its slot: a task renews the lease (see keep_lease) until the daemon answers
-- that it is gone, which it is once the transaction's connection closed, or until it
-- finds that connection collected (the transaction ended), and then releases it. `setenv
-- RLSIDECAR_RENEW_LEASES off` in global, before lua-load, turns the renewals off.
-- Frames are encoded and decoded by rlsidecar.codec, in plain Lua: lua-mpack under Lua 5.3
-- decodes integers as floats, which would print as "5.0" in the headers.

local codec = require "rlsidecar.codec"
local http = require "rlsidecar.http"
local normalize_path = require("rlsidecar.path").normalize

local MAX_FRAME = 1048576 -- the largest answer read

-- HOLD_S is how long, in seconds, a transaction may hold a concurrency lease's connection
-- idle: a day. The transaction's end closes it long before.
local HOLD_S = 86400

-- max_frame: the largest request frame sent (bytes after the length).
local max_frame = 65536
do
  local env = os.getenv("RLSIDECAR_MAX_FRAME")
  if env ~= nil and env ~= "" then
    max_frame = tonumber(env)
    if not max_frame or max_frame < 1 or max_frame % 1 ~= 0 then
      error("rlsidecar: RLSIDECAR_MAX_FRAME must be a positive integer (bytes), not " .. env, 0)
    end
  end
end

-- renew_leases: whether a transaction's lease is renewed while it runs (keep_lease).
local renew_leases = true
do
  local env = os.getenv("RLSIDECAR_RENEW_LEASES")
  if env == "off" or env == "0" or env == "false" then
    renew_leases = false
  elseif env ~= nil and env ~= "" and env ~= "on" and env ~= "1" and env ~= "true" then
    error("rlsidecar: RLSIDECAR_RENEW_LEASES must be on or off, not " .. env, 0)
  end
end

local last_id = 0
local function next_id()
  last_id = last_id % 2147483647 + 1
  return last_id
end

local function now_ms()
  local t = core.now()
  return t.sec * 1000 + t.usec / 1000
end

-- A failed connect to the daemon (socket missing, refused, its accept queue full) and a
-- connection it refuses as it accepts it (too_many_connections: it is at its
-- --max-conns) back off, per Lua state and address: from 10 ms, doubling up to 1 s, a
-- random half to all of each wait, as the Go, Python and Node clients' dials and nginx's.
-- Meanwhile checks are decided by the policy at once, and renewals wait, without a
-- connect; the first answer after the wait ends it. Before, every check connected
-- again: to a daemon at its cap (one more connection it had to accept, answer and
-- close, and refused again), and to one whose accept queue was full (a stalled or
-- overloaded daemon), where HAProxy writes a line of its own for each connect that
-- fails ("Connect() failed for backend LUA-SOCKET: can't connect to destination unix
-- socket, check backlog size on the server."): one a request, with no gate.
local BACKOFF_MIN_MS, BACKOFF_MAX_MS = 10, 1000
local dial_failures = {} -- address -> { n = failures in a row, retry_at = now_ms(), err = the last }

-- dial_failed counts a failed connect to address (why) and sets when the next may be; it
-- returns nil and why.
local function dial_failed(address, why)
  local f = dial_failures[address] or { n = 0 }
  f.n, f.err = f.n + 1, why
  local d = f.n >= 8 and BACKOFF_MAX_MS or math.min(BACKOFF_MIN_MS * 2 ^ (f.n - 1), BACKOFF_MAX_MS)
  f.retry_at = now_ms() + d / 2 + math.random() * d / 2
  dial_failures[address] = f
  return nil, why
end

-- refused counts the daemon's too_many_connections answer e (an error with id 0) as a
-- failed connect; it returns nil and the failure.
local function refused(address, e)
  return dial_failed(address, "reading from " .. address .. ": too_many_connections: " .. tostring(e.message))
end

-- backing_off returns why address is not to be connected to now, or nil.
local function backing_off(address)
  local f = dial_failures[address]
  if f and now_ms() < f.retry_at then
    return "backing off after " .. f.n .. " failed connect(s): " .. f.err
  end
  return nil
end

-- An answer longer than HAProxy's buffer (tune.bufsize, 16,384 bytes by default: about
-- 140 rules deciding one request) reaches a Lua socket one buffer per timeout in HAProxy
-- 2.6: its read waits for the socket's timeout to fire, takes the next bufferful, and
-- waits again. A check whose answer is longer takes its whole TIMEOUT_MS and more (a
-- 228 KB answer under a 300 ms timeout took 3.6 s; with tune.bufsize 262144, 44 ms), or
-- goes to the policy. big_answer says so, at most once a minute a Lua state, naming the
-- fix: before, nothing said why such checks were slow.
local BIG_ANSWER = 8192
local big_gate = http.gate(60)

local function big_answer(address, n, timeout_ms)
  local t = core.now()
  local held = big_gate(t.sec + t.usec / 1e6)
  if held ~= nil then
    core.Warning("rlsidecar: an answer of " .. n .. " bytes from " .. address .. " took the check's whole " ..
      timeout_ms .. " ms or more: HAProxy reads a Lua socket one buffer (tune.bufsize, 16384 bytes by default) " ..
      "per timeout; set tune.bufsize in global above " .. n ..
      (held > 0 and " (and " .. held .. " more such answers since the last line)" or ""))
  end
end

-- roundtrip sends frame to the daemon at address and returns the decoded answer, or nil
-- and an error (and true when the connection broke on a release, before frame was sent:
-- see check). With an answer, the connection stays open and is returned second (the
-- caller closes it): a lease the answer carries is held while its connection is open.
-- With releases (a list of leases), it first releases each on the same connection and
-- waits for its answer (released or not), so that the check sees their slots free. One deadline,
-- timeout_ms from the start, bounds the whole exchange: each step (connect, write, each
-- read) waits for what is left of it, where a timeout set once bounded each step by
-- timeout_ms, several times it in all.
local function roundtrip(address, timeout_ms, frame, id, releases)
  local wait = backing_off(address)
  if wait then
    return nil, wait
  end
  local deadline = now_ms() + timeout_ms
  local sock = core.tcp()
  sock:settimeout(timeout_ms / 1000)
  local ok, err = sock:connect(address)
  if not ok then
    sock:close()
    return dial_failed(address, "connecting to " .. address .. ": " .. tostring(err))
  end
  -- fail closes the connection and names the failure; at the deadline, as the timeout
  -- it is (HAProxy reports a read that timed out as "connection closed."). Within 2 ms
  -- of it: HAProxy's timer fires by its own clock, which an audit saw run up to a
  -- millisecond ahead of now_ms (1,542 of 2,716 timeouts named "connection closed.").
  local function fail(what, e)
    sock:close()
    if now_ms() + 2 >= deadline then
      e = "no answer within " .. timeout_ms .. " ms"
    end
    return nil, what .. " " .. address .. ": " .. tostring(e)
  end
  -- left sets the socket's timeout to what is left of the deadline. Once it has passed,
  -- one more step gets 1 ms, so that an answer already waiting is read rather than
  -- dropped (HAProxy's clock moves once per turn of its scheduler); after that, false.
  local late = false
  local function left()
    local ms = deadline - now_ms()
    if ms < 1 then
      if late then
        return false
      end
      late, ms = true, 1
    end
    sock:settimeout(ms / 1000)
    return true
  end
  -- exchange sends f and returns the answer's body, or nil and the failure (the
  -- connection then closed).
  local function exchange(f)
    if not left() then
      return fail("writing to", "timeout")
    end
    local sent, serr = sock:send(f)
    if not sent then
      return fail("writing to", serr)
    end
    if not left() then
      return fail("reading from", "timeout")
    end
    local head, herr = sock:receive(4)
    if not head or #head < 4 then
      return fail("reading from", herr or "closed")
    end
    local n = codec.frame_length(head)
    if n > MAX_FRAME then
      return fail("reading from", "an answer of " .. n .. " bytes")
    end
    if not left() then
      return fail("reading from", "timeout")
    end
    local body, berr = sock:receive(n)
    if n > BIG_ANSWER and now_ms() + 2 >= deadline then
      big_answer(address, n, timeout_ms)
    end
    if not body or #body < n then
      return fail("reading from", berr or "closed")
    end
    return body
  end
  for _, lease in ipairs(releases or {}) do
    local rframe = codec.encode_request({ id = next_id(), op = "release", lease = lease })
    if rframe then
      local rbody, rerr = exchange(rframe) -- released or not
      if not rbody then
        -- The connection broke (not the deadline): the check was not sent.
        return nil, rerr, now_ms() + 2 < deadline
      end
      local r = codec.decode_body(rbody)
      if type(r) == "table" and r.id == 0 and type(r.error) == "table" then
        -- An error about the connection, not the release: the drain's farewell (a
        -- connection a draining daemon accepted: nothing more is read on it), or
        -- too_many_connections. It is the check's answer: check() sends it again after
        -- the farewell. Before, the check was sent on after it, unread, and met the
        -- close: the policy decided (a 503 under closed) instead of the successor.
        sock:close()
        if r.error.code == "too_many_connections" then
          return refused(address, r.error)
        end
        return r
      end
    end
  end
  local body
  body, err = exchange(frame)
  if not body then
    return nil, err
  end
  local resp
  resp, err = codec.decode_body(body)
  if not resp then
    sock:close()
    return nil, "decoding an answer from " .. address .. ": " .. err
  end
  if type(resp) == "table" and resp.id == 0 and type(resp.error) == "table" then
    -- An error about a request the daemon could not read (frame_too_large: it closes).
    sock:close()
    if resp.error.code == "too_many_connections" then
      return refused(address, resp.error)
    end
    return resp
  end
  if type(resp) ~= "table" or resp.id ~= id then
    sock:close()
    return nil, "an answer to another request from " .. address
  end
  dial_failures[address] = nil -- it answers again
  return resp, sock
end

-- check returns the decision for attrs and cost (see rlsidecar.http) and, for an error
-- answer or bad arguments, an error string. releases: the leases to release first (see
-- pending), or nil.
local function check(address, policy, timeout_ms, attrs, cost, releases)
  local id = next_id()
  local frame, err = codec.encode_request({ id = id, op = "check", attrs = attrs, cost = cost })
  if not frame then
    return http.policy_decision(policy, err), "rlsidecar: " .. err
  end
  if #frame - 4 > max_frame then
    local msg = "rlsidecar: frame_too_large: request frame of " .. (#frame - 4) .. " bytes exceeds max_frame "
      .. max_frame .. "; it was not sent"
    return http.too_large_decision(msg), msg
  end
  local started = now_ms()
  local resp, rerr, unsent = roundtrip(address, timeout_ms, frame, id, releases)
  if not resp and unsent then
    -- A release sent first met a connection that broke: the daemon closed it, read or
    -- not (SIGKILLed, or its drain timed out, while deciding it). A release is idempotent
    -- and the check was not sent: both are sent once more, within what is left of the
    -- timeout, to its successor. Before, the check went to the policy (a 503 under
    -- closed) with the daemon's successor up.
    local rest = timeout_ms - (now_ms() - started)
    if rest >= 1 then
      resp, rerr = roundtrip(address, rest, frame, id, releases)
    end
  end
  if resp and resp.id == 0 and type(resp.error) == "table" and resp.error.code == "shutting_down" then
    -- The daemon drains and did not read this check (its connection was accepted during
    -- the drain, or the drain's farewell came first): sent once more, within what is left
    -- of the timeout, to its successor (systemd's socket keeps the waiting connections
    -- for it; a daemon that made its own socket hands its path over).
    local rest = timeout_ms - (now_ms() - started)
    if rest >= 1 then
      resp, rerr = roundtrip(address, rest, frame, id, releases)
    end
  end
  if not resp then
    return http.policy_decision(policy, rerr)
  end
  local sock = rerr
  if resp.error then
    if sock then sock:close() end
    local msg = "rlsidecar: " .. tostring(resp.error.code) .. ": " .. tostring(resp.error.message)
    if http.too_large_code(resp.error.code) then
      return http.too_large_decision(msg), msg
    end
    local d = http.policy_decision(policy, msg)
    d.unreachable = false
    return d, msg
  end
  if resp.rules == nil then resp.rules = {} end
  if resp.rule == nil then resp.rule = "" end
  if resp.allowed and resp.lease and resp.lease ~= "" then
    -- Holds the lease until the transaction ends (closed with it). HAProxy closes a Lua
    -- socket idle past its timeout, which was the check's (50 ms in the example): the
    -- daemon then freed the slot while the request still ran. HOLD_S bounds it instead.
    sock:settimeout(HOLD_S)
    resp.sock = sock
  else
    sock:close()
  end
  return resp
end

local MIN_RENEWAL_MS = http.MIN_RENEWAL_MS

-- Renewals of the leases of transactions still running: one task a Lua state (a thread's,
-- with lua-load-per-thread) renews every lease that keep_lease gave it, from a heap
-- ordered by when each renewal is due. A task a lease held a coroutine until the lease's
-- first renewal found its transaction ended: at 60 s leases and a few thousand leased
-- requests a second, hundreds of thousands of them at once (165-190 MB, and a third of
-- HAProxy's throughput).
--
-- A lease is renewed first after first_ms, then at half of what each renewal answers is
-- left of it. HAProxy gives Lua no hook at the end of a transaction, so the task learns
-- it from the daemon: when the transaction ends HAProxy closes the connection that took
-- the lease, the daemon frees the lease, and the next renewal answers renewed: false (a
-- lease released by the next request on the client connection, see pending, likewise).
-- An entry holds the lease's id, and the transaction's socket only weakly (a strong
-- reference would keep it open): once the transaction ended and HAProxy collected that
-- socket, the entry's next turn sends a release instead of a renewal, and the entry is
-- dropped. The daemon that took the lease may not be the one that answers: one SIGKILLed
-- (or crashed) never read the close, and its successor (systemd's socket, a blue/green
-- handover) renewed a global lease it found in Redis for as long as it was asked, so a
-- request that ended after the kill held its slot for as long as HAProxy ran (before,
-- a 3 s lease was still held 12 s after its request ended; a keep-alive client's next
-- request released it, see pending, a client that closed its connection never did).
-- A lease whose renewals (or release) go unanswered is dropped at its last known expiry.
local due = {} -- a binary min-heap of entries { due, expires, lease, address, timeout_ms, held }
local renewing = false -- this Lua state's renewal task runs
-- shortest_first_ms: the shortest first renewal any lease was given, which bounds how
-- long the task sleeps (a lease added during a sleep is due after that at the earliest).
local shortest_first_ms = math.huge
-- RENEW_BATCH bounds the renewals sent on one connection at once.
local RENEW_BATCH = 256

local function due_push(e)
  local i = #due + 1
  due[i] = e
  while i > 1 do
    local up = math.floor(i / 2)
    if due[up].due <= e.due then break end
    due[i], due[up] = due[up], e
    i = up
  end
end

local function due_pop()
  local top, n = due[1], #due
  local last = due[n]
  due[n] = nil
  n = n - 1
  if n > 0 then
    local i = 1
    due[1] = last
    while true do
      local l, r, m = 2 * i, 2 * i + 1, i
      if l <= n and due[l].due < due[m].due then m = l end
      if r <= n and due[r].due < due[m].due then m = r end
      if m == i then break end
      due[i], due[m] = due[m], due[i]
      i = m
    end
  end
  return top
end

-- renew_all asks the daemon at address to extend each entry's lease by its rules' own
-- lease times, pipelined on one connection within one timeout_ms. Each entry answered
-- gets renewed (true or false) and left_ms; an entry without an answer (no connection,
-- the timeout, an error answer, the address backing off) keeps renewed nil. A failed
-- connect and a too_many_connections answer back off as a check's do (see dial_failed),
-- and a backoff holds renewals as it holds checks: before, each batch connected whatever
-- the checks had met, and its refusals set no backoff, so a daemon at its --max-conns was
-- refused a connection for every batch of every renewal of every lease (each unanswered
-- renewal comes again at half what is left of its lease: 16 leases of 4 s, 145 refused
-- connections; now 9).
local function renew_all(address, timeout_ms, entries)
  for _, e in ipairs(entries) do
    e.renewed, e.left_ms = nil, nil
  end
  if backing_off(address) then
    return
  end
  local deadline = now_ms() + timeout_ms
  local by_id, frames, waiting = {}, {}, 0
  for _, e in ipairs(entries) do
    local id = next_id()
    -- The transaction ended (its socket collected): released, not renewed (see due).
    e.ended = e.held ~= nil and e.held[1] == nil
    local frame = codec.encode_request({ id = id, op = e.ended and "release" or "renew", lease = e.lease })
    if frame then
      by_id[id] = e
      frames[#frames + 1] = frame
      waiting = waiting + 1
    end
  end
  if waiting == 0 then
    return
  end
  local sock = core.tcp()
  sock:settimeout(timeout_ms / 1000)
  local ok, err = sock:connect(address)
  if not ok then
    sock:close()
    dial_failed(address, "connecting to " .. address .. ": " .. tostring(err))
    return
  end
  -- left sets the socket's timeout to what is left of the deadline; once past it, one
  -- more step gets 1 ms (an answer already waiting is read, see roundtrip), then false.
  local late = false
  local function left()
    local ms = deadline - now_ms()
    if ms < 1 then
      if late then return false end
      late, ms = true, 1
    end
    sock:settimeout(ms / 1000)
    return true
  end
  if left() and sock:send(table.concat(frames)) then
    while waiting > 0 and left() do
      local head = sock:receive(4)
      if not head or #head < 4 then break end
      local n = codec.frame_length(head)
      if n > MAX_FRAME or not left() then break end
      local body = sock:receive(n)
      if not body or #body < n then break end
      local resp = codec.decode_body(body)
      if type(resp) ~= "table" then break end
      if resp.id == 0 then
        -- An error about the connection: the drain's farewell, or too_many_connections.
        if type(resp.error) == "table" and resp.error.code == "too_many_connections" then
          refused(address, resp.error)
        end
        break
      end
      dial_failures[address] = nil -- it answers again
      local e = by_id[resp.id]
      if e then
        by_id[resp.id] = nil
        waiting = waiting - 1
        if e.ended and not resp.error then
          e.renewed, e.left_ms = false, 0 -- released (or already gone): dropped
        elseif not resp.error then
          e.renewed, e.left_ms = resp.renewed == true, tonumber(resp.expires_ms) or 0
        end
      end
    end
  end
  sock:close()
end

-- renew_due renews the entries due by now, a batch at a time per daemon address, and
-- puts back those still held.
local function renew_due()
  local now = now_ms()
  local batches, order = {}, {}
  local n = 0
  while due[1] and due[1].due <= now and n < RENEW_BATCH do
    local e = due_pop()
    local b = batches[e.address]
    if not b then
      b = { timeout_ms = 0 }
      batches[e.address] = b
      order[#order + 1] = e.address
    end
    b[#b + 1] = e
    b.timeout_ms = math.max(b.timeout_ms, e.timeout_ms)
    n = n + 1
  end
  for _, address in ipairs(order) do
    local b = batches[address]
    -- A Lua error (core.tcp out of memory, under tune.lua.maxmem) leaves the batch
    -- unanswered, so that its entries are put back: they were out of the heap, and
    -- renewal_task's pcall dropped them, their leases never renewed again.
    local ok, err = pcall(renew_all, address, b.timeout_ms, b)
    if not ok then
      for _, e in ipairs(b) do e.renewed = nil end
      core.Alert("rlsidecar: renewing leases at " .. address .. ": " .. tostring(err))
    end
    now = now_ms()
    for _, e in ipairs(b) do
      if e.renewed == nil then
        local rest = e.expires - now
        if rest > 0 then
          e.due = now + math.max(math.floor(rest / 2), MIN_RENEWAL_MS)
          due_push(e)
        end
      elseif e.renewed then
        e.expires = now + e.left_ms
        e.due = now + math.max(math.floor(e.left_ms / 2), MIN_RENEWAL_MS)
        due_push(e)
      end
    end
  end
end

-- sleeping: when each renewal task asleep wakes, by task (a table each). A task that
-- renews is not in it: it looks at the heap again before it sleeps.
local sleeping = {}
local main_task -- the renewal task's key in sleeping

local function renew_due_logged()
  local ok, err = pcall(renew_due)
  if not ok then
    core.Alert("rlsidecar: renewing leases: " .. tostring(err))
  end
end

-- renew_until renews the entries as they come due until the heap is empty or stop_at
-- (ms). A sleep lasts at most half the shortest first renewal: a lease added meanwhile
-- is renewed by three quarters of its lease at the latest (one due sooner than that,
-- shorter than any before, has keep_lease start a task for it).
local function renew_until(me, stop_at)
  while due[1] and now_ms() + 1 <= stop_at do
    local now = now_ms()
    local wait = math.min(due[1].due - now, math.floor(shortest_first_ms / 2), 1000, stop_at - now)
    if wait >= 1 then
      sleeping[me] = now + math.floor(wait)
      core.msleep(math.floor(wait))
      sleeping[me] = nil
    end
    renew_due_logged()
  end
  sleeping[me] = nil -- keep_lease's mark of a task not yet run
end

local function renewal_task()
  renew_until(main_task, math.huge)
  renewing = false
end

-- keep_lease has lease renewed while its transaction runs, first after first_ms; until a
-- renewal answers, it expires after life_ms (the lease's duration, http.lease_life_ms),
-- 2 × first_ms when 0. sock is the transaction's connection that holds the lease, kept
-- weakly: once it is collected, the lease is released (see due).
local function keep_lease(address, timeout_ms, lease, first_ms, life_ms, sock)
  local now = now_ms()
  local life = life_ms and life_ms > 0 and life_ms or 2 * first_ms
  local held = setmetatable({ sock }, { __mode = "v" }) -- emptied once the transaction's socket is collected
  due_push({ due = now + first_ms, expires = now + life, lease = lease, address = address, timeout_ms = timeout_ms,
    held = held })
  shortest_first_ms = math.min(shortest_first_ms, first_ms)
  if not renewing then
    -- Registered before the flag is set: register_task raises when HAProxy cannot
    -- allocate the task, and a flag set first stayed set with no task, every later
    -- lease of this Lua state never renewed.
    main_task = {}
    core.register_task(renewal_task)
    renewing = true
    return
  end
  local soonest = math.huge
  for _, at in pairs(sleeping) do
    soonest = math.min(soonest, at)
  end
  local main_wakes = sleeping[main_task]
  if main_wakes and now + first_ms < soonest then
    -- Every task sleeps past this lease's first renewal: its lease is shorter than any
    -- before (their sleeps were bounded by those, up to 1 s), and a 400 ms lease taken
    -- during a 1 s sleep expired before it was first renewed. A task renews beside the
    -- renewal task until that wakes, whose later sleeps are bounded by this lease
    -- (renew_due takes the entries it renews off the heap: two tasks renew different
    -- ones).
    local me = {}
    core.register_task(function()
      renew_until(me, main_wakes)
    end)
    sleeping[me] = now + first_ms -- until it runs: the leases taken meanwhile need no other
  end
end

-- Leases of ended transactions, by HTTP/1 client connection, that the next request on
-- that connection releases before its own check. A transaction's lease is held by its
-- check's connection to the daemon until the transaction ends (HAProxy then closes it,
-- and the daemon frees the connection's leases); but the daemon may read that close
-- after the next request's check, which a client sends the moment the previous response
-- arrives: that check could find the slot still held. HAProxy 2.6 gives Lua no hook at
-- the end of a transaction (filters may not yield, and a release must wait for its
-- answer), so the next transaction on the connection sends the release itself. HTTP/1
-- only: there the next transaction starts once the previous one ended (an HTTP/2
-- connection carries its streams at once). Two generations of at most PENDING entries
-- each, as nginx's client remembers decisions: a connection that closes after a leased
-- request leaves its entry to age out, and a release of a lease already freed is
-- answered released: false, never an error. An entry is the list of the transaction's
-- leases: each lua.rlsidecar line that took one added it (a second line's too: a lease
-- taken only by it was left out, and the next request raced the close).
local PENDING = 4096
local pending, pending_before, n_pending = {}, {}, 0

-- connection_key names the transaction's client connection by its TCP addresses and
-- frontend (two open connections never share them); nil for HTTP/2 and for a listener
-- without ports (a Unix socket's clients would all share one name).
local function connection_key(txn)
  local v = txn.f:req_ver()
  if v ~= "1.1" and v ~= "1.0" then
    return nil
  end
  local sport, dport = tonumber(txn.f:src_port()), tonumber(txn.f:dst_port())
  if not sport or sport == 0 or not dport or dport == 0 then
    return nil
  end
  return tostring(txn.f:src()) .. "|" .. sport .. "|" .. tostring(txn.f:dst()) .. "|" .. dport .. "|"
    .. tostring(txn.f:fe_id())
end

-- take_pending removes and returns key's list of leases, or nil.
local function take_pending(key)
  if not key then return nil end
  local leases = pending[key] or pending_before[key]
  if leases then
    pending[key], pending_before[key] = nil, nil
  end
  return leases
end

-- put_pending adds lease to key's list (the current transaction's: its first check took
-- what the one before left).
local function put_pending(key, lease)
  local leases = pending[key]
  if leases then
    leases[#leases + 1] = lease
    return
  end
  leases = pending_before[key]
  if leases then
    pending_before[key] = nil
    leases[#leases + 1] = lease
  else
    leases = { lease }
  end
  if n_pending >= PENDING then
    pending_before, pending, n_pending = pending, {}, 0
  end
  pending[key] = leases
  n_pending = n_pending + 1
end

local REASONS = { [429] = "Too Many Requests", [431] = "Request Header Fields Too Large", [503] = "Service Unavailable" }

local BAD_COST_BODY = http.BAD_COST_BODY
-- The transaction variables an allowed check's headers are set in (see action).
local HEADER_VARS = {
  ["RateLimit-Policy"] = "txn.rlsidecar_ratelimit_policy",
  ["RateLimit"] = "txn.rlsidecar_ratelimit",
  ["RateLimit-Warning"] = "txn.rlsidecar_ratelimit_warning",
}

-- cost_of returns the cost in txn.rlsidecar_cost (v, as get_var gives it): 1 when not
-- set (nil or ""), the integer it holds when it is one (decimal digits; past 2^53, 2^53:
-- more than any rule's capacity, refused as cost_exceeds_capacity), else nil and why.
-- A value that is not a cost ("-1", "1.5", "abc") took the failure policy, or cost 1.
local function cost_of(v)
  if v == nil or v == "" then
    return 1
  end
  local s = tostring(v)
  if not s:match("^%d+$") then
    return nil, "txn.rlsidecar_cost " .. string.format("%q", s:sub(1, 64)) .. " is not a non-negative integer: refused (400)"
  end
  s = s:gsub("^0+(%d)", "%1")
  if #s > 15 then
    return 9007199254740992
  end
  return tonumber(s)
end

-- log_gate holds the log lines about requests without a decision to one a second a
-- process, each saying how many it stands for (http.gate).
local log_gate = http.gate(1)

-- usage_gate holds the alerts about an action's arguments to one a second a process.
local usage_gate = http.gate(1)

local function action(txn, address, policy, timeout)
  local timeout_ms = tonumber(timeout)
  if (policy ~= "open" and policy ~= "closed") or not timeout_ms or timeout_ms <= 0 then
    -- HAProxy hands a Lua action its arguments only when it runs, so a mistake in them
    -- (clsoed, 50ms) cannot stop the configuration from loading. The request is still
    -- checked: a POLICY that is neither open nor closed decides as closed (the sidecar
    -- away refuses, where a /login meant to fail closed would otherwise fail open), a
    -- TIMEOUT_MS that is not a positive number is 50. Before, every such request went
    -- through unchecked, past every limit, with an alert each.
    local got = string.format("%q %q", tostring(policy), tostring(timeout))
    if policy ~= "open" and policy ~= "closed" then policy = "closed" end
    if not timeout_ms or timeout_ms <= 0 then timeout_ms = 50 end
    local t = core.now()
    local held = usage_gate(t.sec + t.usec / 1e6)
    if held ~= nil then
      core.Alert("rlsidecar: usage: http-request lua.rlsidecar unix@/path open|closed TIMEOUT_MS; got " .. got ..
        ", checked as " .. policy .. " " .. timeout_ms .. http.held_note(held))
    end
  end
  -- A client of a `bind unix@` listener has no address (src is nil): ip is left out, as
  -- every client leaves out a peer with no address (clients/testdata/ips.json). Before,
  -- it was sent as "", and every such client shared that one per-ip bucket.
  local attrs = {}
  local ip = http.peer_ip(txn.f:src())
  if ip ~= "" then attrs[1] = { "ip", ip } end
  attrs[#attrs + 1] = { "method", txn.f:method() or "" }
  attrs[#attrs + 1] = { "path", normalize_path(txn.f:path() or "") }
  -- A variable set from an integer sample (a converter such as crc32, a JWT claim read
  -- as 'int') reaches Lua as a number: sent as its decimal string. Before, the encoder
  -- refused it, and every request went to the policy (under open, past every limit).
  local user = txn:get_var("txn.rlsidecar_user")
  if user and user ~= "" then attrs[#attrs + 1] = { "user", tostring(user) } end
  local key = txn:get_var("txn.rlsidecar_api_key")
  if key and key ~= "" then attrs[#attrs + 1] = { "api_key", tostring(key) } end
  local cost, bad = cost_of(txn:get_var("txn.rlsidecar_cost"))
  if bad then
    -- Not a cost: answered 400 whatever the policy. Under "open" the policy let such a
    -- request past every limit (the encoder refused it, the policy decided), and a
    -- cost set from a request header is the HTTP client's to choose.
    txn:Info("rlsidecar: " .. bad)
    local reply = txn:reply()
    reply:set_status(400, "Bad Request")
    reply:add_header("Content-Type", "application/problem+json")
    reply:set_body(BAD_COST_BODY)
    txn:done(reply)
    return
  end

  -- A second check of this transaction (another lua.rlsidecar line) finds its private
  -- data set, and leaves the pending leases alone: they are this transaction's own.
  -- The connection's name is looked up only when a lease is pending in this process or
  -- the check takes one: a request with no concurrency rule in play fetches nothing more.
  local first = txn:get_priv() == nil
  local conn = first and (next(pending) ~= nil or next(pending_before) ~= nil) and connection_key(txn) or nil
  local d, err = check(address, policy, timeout_ms, attrs, cost, take_pending(conn))
  if d.reason == http.REQUEST_TOO_LARGE then
    txn:Info(err) -- the client's doing
  elseif err or d.unreachable then
    local t = core.now()
    local held = log_gate(t.sec + t.usec / 1e6)
    if held == nil then
      -- held back: at most one line a second a process (http.gate)
    elseif d.unreachable then
      txn:Warning("rlsidecar: no decision, policy " .. policy .. ": " .. tostring(d.cause) .. http.held_note(held))
    elseif http.busy_error(err) then
      txn:Warning(err .. http.held_note(held)) -- too_many_connections, shutting_down
    else
      txn:Alert(err .. http.held_note(held))
    end
  end
  if not first then
    -- The header variables describe this decision only: an earlier check of the
    -- transaction (another lua.rlsidecar line, which allowed: it set the private data)
    -- set them, and the http-after-response rules would put its figures on this answer
    -- (a 429 whose RateLimit-Policy named the rule that allowed, not the one that refused).
    for _, var in pairs(HEADER_VARS) do
      txn:unset_var(var)
    end
  end
  if not d.allowed then
    local status, headers, body = http.rejection(d)
    local reply = txn:reply()
    reply:set_status(status, REASONS[status])
    for k, v in pairs(headers) do
      reply:add_header(k, v)
    end
    reply:set_body(body)
    txn:done(reply)
    return
  end
  -- The private data holds the headers for lua.rlsidecar_headers and, for a concurrency
  -- rule's slot, the open connection that holds it, until the transaction ends: every
  -- such connection of the transaction's checks (a second line's set_priv dropped the
  -- first's, which the garbage collector could then close, freeing its slot early).
  local headers = http.headers(d)
  local p = txn:get_priv()
  local lease_socks = type(p) == "table" and p.lease_socks or {}
  if d.sock then
    lease_socks[#lease_socks + 1] = d.sock
  end
  txn:set_priv({ headers = headers, lease_socks = lease_socks })
  -- And in transaction variables, for http-after-response set-header: those rules run
  -- for every response, HAProxy's own too (a 502, a 503, a 504), where http-response
  -- rules, lua.rlsidecar_headers among them, do not, and HAProxy 2.6 runs no Lua action
  -- there.
  for name, var in pairs(HEADER_VARS) do
    local v = headers[name]
    if v then txn:set_var(var, v) end
  end
  if d.sock then
    conn = conn or connection_key(txn)
    if conn then
      put_pending(conn, d.lease) -- for the next request on this client connection
    end
    if renew_leases then
      keep_lease(address, timeout_ms, d.lease, math.floor(http.first_renewal_ms(d)), http.lease_life_ms(d), d.sock)
    end
  end
  local delay = tonumber(d.delay_ms)
  if delay and delay > 0 then
    core.msleep(math.floor(delay)) -- a rule's delay: its tokens are reserved, the request waits
  end
end

local function add_headers(txn)
  local p = txn:get_priv()
  if type(p) ~= "table" then
    return
  end
  for k, v in pairs(p.headers) do
    txn.http:res_set_header(k, v)
  end
end

-- lua.rlsidecar_path: the request's path as the check sends it (normalized), for ACLs.
core.register_fetches("rlsidecar_path", function(txn)
  return normalize_path(txn.f:path() or "")
end)

core.register_action("rlsidecar", { "http-req" }, action, 3)
core.register_action("rlsidecar_headers", { "http-res" }, add_headers, 0)
