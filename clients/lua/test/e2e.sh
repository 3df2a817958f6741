#!/usr/bin/env bash
# End to end through real gateways: the real daemon ($RLSIDECAR_BIN, or built from this
# repo) on a temp socket with a temp rules file, a backend (nginx returning 200), and in
# front of it real nginx (Debian nginx + libnginx-mod-http-lua) and real HAProxy running
# the example configs of clients/lua/examples (paths and ports substituted, and the 50 ms
# timeout raised to 2 s so that a loaded CI machine does not turn decisions into policy
# ones; the silent-sidecar part keeps the example's 50 ms; /burst/ is checked closed,
# within 10 s).
# For each gateway it
# sends a burst with curl and asserts 200s with RateLimit-Policy/RateLimit (and
# RateLimit-Warning once per-user reaches its warn_at), then 429s with Retry-After, the same
# headers (no RateLimit-Warning) and the problem+json body the Go client writes; that
# unchecked paths pass untouched; that one rule on /fast counts /fast, /f%61st, //fast,
# /./fast ... alike through both gateways (HAProxy normalizes its raw path as nginx's $uri
# is, and its ACLs use that path); that a request too large to be checked (a 70,000-byte
# X-User, an attribute; the header buffers raised) is answered 431 by both, not passed by
# the open policy; that an IPv4 client of a dual-stack listener (nginx
# `listen [::]:P ipv6only=off`, HAProxy `bind :::P v4v6`) is sent as its IPv4 address,
# one key through both; that a client of nginx's `listen unix:` server or HAProxy's
# `bind unix@` (no address) is
# checked without ip, not as one shared "unix:" key; that nginx's access() decides a request once across internal
# redirects (the daemon asked once, a concurrency slot taken once and freed), still
# checks a location reached only by one, checks subrequests on their own, and says so
# when the configuration does not name $request_id; that nginx keeps its connection to
# the daemon (one open connection after the burst) and gets a decision right after a
# daemon restart (the pool drops connections the daemon closed); that a concurrency
# rule's slot is held while a proxied request runs, its streamed body included (and for
# each request of a burst whose checks were in flight together, more than nginx's pool
# keeps), and freed
# when it completes or the client aborts it, and that ten leased requests in a row on one
# keep-alive connection each find the slot free; that nginx and HAProxy renew the lease of a request
# longer than it, nginx also after a flood of 1,100 short leased requests (which took its
# pending timers). With a stand-in sidecar (test/held_sidecar.py): that nginx waits for a
# release on a semaphore, not by polling, bounded by its timeout, and that a request held
# for a delay whose client goes away ends then, its lease released; that HAProxy releases
# both leases of a request checked by two lua.rlsidecar lines before the next request on
# its keep-alive connection is checked; that nginx sends a check again after a pooled
# connection's reset (closed unread) but not after end-of-file with no answer (it may have
# been counted), and that a release read and closed on unanswered is sent again (nginx;
# HAProxy with the check it preceded); that HAProxy releases, not renews, the lease of a
# transaction that ended, whoever answers its renewals, and nginx that of a request that
# ended in a location without log(). With a second daemon at --max-conns 1: that nginx and HAProxy back off
# after too_many_connections. Then it stops the daemon
# and asserts the unreachable policies: `open` serves without rate-limit headers,
# `closed` (/login, however spelt) answers 503 with Retry-After: 1 and its problem body.
# Also client:check() itself from a test-only location: inline limits, cost, cost above
# capacity, bad input (refused before sending), an error answer (policy decision and
# error; the connection stays usable), and a request over max_frame (not sent, or
# refused by the daemon: 431 either way); HAProxy's RLSIDECAR_MAX_FRAME; that a
# second lua.rlsidecar line that refuses answers with its own rate-limit headers; and that
# a txn.rlsidecar_user HAProxy holds as an integer is sent as the user.
# Free loopback ports, a temp dir, every process
# stopped on exit. Exits 0 only if everything holds.
#
# Needs go, nginx, libnginx-mod-http-lua, lua-mpack, haproxy (with Lua), curl, python3
# (scripts/test-gateways installs them).
# E2E_KEEP=1 keeps the temporary directory (configs, gateway and daemon logs) for a look.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)" # clients/lua
repo="$(cd "$here/../.." && pwd)"
keep_var=E2E_KEEP
. "$here/test/harness.sh"


# request METHOD URL [USER]: sets status, headers (lower-case names) and body. The URL's
# path is sent as it is (no dot segments removed by curl).
request() {
  local args=(-s --path-as-is --max-time 10 -X "$1" -D "$tmp/h" -o "$tmp/b" -w '%{http_code}')
  [ -n "${3:-}" ] && args+=(-H "X-User: $3")
  status=$(curl "${args[@]}" "$2")
  headers=$(tr -d '\r' <"$tmp/h" | tr 'A-Z' 'a-z')
  body=$(cat "$tmp/b")
}
header() { # header NAME (lower-case): its value in the last response, or ""
  grep -i "^$1: " <<<"$headers" | head -1 | sed "s/^$1: //" || true
}
# header values were lower-cased with the names; compare them case-insensitively.
lc() { tr 'A-Z' 'a-z' <<<"$1"; }

echo "== the daemon${RLSIDECAR_BIN:+ (RLSIDECAR_BIN)}"
daemon_bin "$tmp/rlsidecar"

cat >"$tmp/rules.yaml" <<'EOF'
rules:
  - name: per-user
    key: user
    limit: { requests: 3, per: 60s }
    warn_at: 0.6
  - name: per-ip
    match: { path: "/api/**" }
    key: ip
    limit: { requests: 1000, per: 60s }
  - name: login
    match: { path: /login }
    key: ip
    limit: { requests: 100, per: 60s }
  - name: queue
    match: { path: /api/queue }
    key: ip
    limit: { requests: 1, per: 1s }
    delay: 10s
  - name: fast
    match: { path: /fast }
    key: ip
    limit: { requests: 6, per: 60s }
  - name: once
    match: { path: "/once/**" }
    key: path
    limit: { requests: 10, per: 60s }
  - name: one-slot
    match: { path: "/once/slot/**" }
    key: ip
    concurrency: { max: 1, lease: 60s }
  - name: slow-in-flight
    match: { path: "/slow/**" }
    key: ip
    concurrency: { max: 1, lease: 60s }
  - name: v4-only
    match: { ip: 127.0.0.1, path: "/v4/**" }
    key: ip
    limit: { requests: 1, per: 60s }
  - name: burst-in-flight
    match: { path: "/burst/**" }
    key: ip
    concurrency: { max: 20, lease: 60s }
  - name: long-in-flight
    match: { path: "/long/**" }
    key: ip
    concurrency: { max: 1, lease: 2s }
  - name: costly
    match: { path: "/costly/**" }
    key: ip
    limit: { requests: 5, per: 60s }
  - name: short-in-flight
    match: { path: "/short/**" }
    key: ip
    concurrency: { max: 1, lease: 400ms }
  - name: many-in-flight
    match: { path: "/many/**" }
    key: ip
    concurrency: { max: 5000, lease: 60s }
  - name: twice
    match: { path: "/twice/**" }
    key: ip
    limit: { requests: 1000, per: 60s }
  - name: per-peer
    match: { path: "/peer/**" }
    key: ip
    limit: { requests: 1, per: 60s }
EOF

sock="$tmp/rl.sock"
admin_port=$(free_port)
# --max-attr-len below what the gateways let through: a longer value is attr_too_large.
"$tmp/rlsidecar" serve --config "$tmp/rules.yaml" --socket "$sock" --admin "127.0.0.1:$admin_port" \
  --max-attr-len 40000 >"$tmp/daemon.log" 2>&1 &
daemon_pid=$!
pids+=("$daemon_pid")
wait_for "the daemon" "$tmp/rlsidecar" check --socket "$sock" user=probe-nobody-uses path=/probe

echo "== backend (nginx returning 200)"
backend_port=$(free_port)
mkdir -p "$tmp/backend/logs"
cat >"$tmp/backend/nginx.conf" <<EOF
load_module /usr/lib/nginx/modules/ndk_http_module.so;
load_module /usr/lib/nginx/modules/ngx_http_lua_module.so;
events {}
http {
  access_log off;
  large_client_header_buffers 4 128k;
  client_body_temp_path $tmp/backend; proxy_temp_path $tmp/backend; fastcgi_temp_path $tmp/backend;
  uwsgi_temp_path $tmp/backend; scgi_temp_path $tmp/backend;
  server {
    listen 127.0.0.1:$backend_port;
    location / { return 200 "backend \$uri\n"; }
    location /slow/ { content_by_lua_block { ngx.sleep(1) ngx.say("slow") } }
    location /burst/ { content_by_lua_block { ngx.sleep(8) ngx.say("burst") } }
    location /slow/quick/ { return 200 "quick\n"; }
    location /slow/held/ { content_by_lua_block { ngx.sleep(3) ngx.say("held") } }
    location /long/ { content_by_lua_block { ngx.sleep(5) ngx.say("long") } }
    location /short/ { content_by_lua_block { ngx.sleep(4) ngx.say("short") } }
    location /short/quick/ { return 200 "quick\n"; }
    location /slow/stream/ { content_by_lua_block { ngx.say("start") ngx.flush(true) ngx.sleep(3) ngx.say("end") } }
  }
}
EOF
nginx -e "$tmp/backend.log" -p "$tmp/backend" -c "$tmp/backend/nginx.conf" -g "daemon off; master_process off; pid $tmp/backend/nginx.pid;" 2>>"$tmp/backend.log" &
pids+=($!)
wait_for "the backend" curl -sf "http://127.0.0.1:$backend_port/"

echo "== nginx with clients/lua/examples/nginx.conf"
nginx_port=$(free_port)
nginx_dual_port=$(free_port) # a dual-stack listener too: IPv4 clients seen as ::ffff:a.b.c.d
mkdir -p "$tmp/nginx/logs"
sed -e "s#/usr/share/rlsidecar/lua/#$here/#g" \
  -e "s#/run/rlsidecar/rlsidecar.sock#$sock#g" \
  -e "s#127.0.0.1:9000#127.0.0.1:$backend_port#g" \
  -e "s#listen 127.0.0.1:8080;#listen 127.0.0.1:$nginx_port; listen [::]:$nginx_dual_port ipv6only=off; listen unix:$tmp/nginx-unix.sock;#" \
  -e "s#timeout_ms = 50,#timeout_ms = 2000,#" \
  -e "/^user www-data;/d" \
  -e "s#^error_log /var/log/nginx/error.log warn;#error_log $tmp/nginx.log warn;#" \
  -e "s#^http {#http {\n    client_body_temp_path $tmp/nginx; proxy_temp_path $tmp/nginx; fastcgi_temp_path $tmp/nginx; uwsgi_temp_path $tmp/nginx; scgi_temp_path $tmp/nginx;\n    large_client_header_buffers 4 128k;#" \
  "$here/examples/nginx.conf" >"$tmp/nginx/nginx.conf"
grep -q "^error_log $tmp/nginx.log warn;" "$tmp/nginx/nginx.conf" || { echo "e2e: examples/nginx.conf no longer has error_log ... warn;" >&2; exit 1; }
grep -q "timeout_ms = 2000" "$tmp/nginx/nginx.conf" || { echo "e2e: examples/nginx.conf no longer has timeout_ms = 50," >&2; exit 1; }
# A test-only location beside the example's: client:check() cases against the real daemon.
cat >"$tmp/check-cases.lua" <<'LUA'
local rl = rl_open
local function line(fmt, ...) ngx.say(string.format(fmt, ...)) end
local version, protocol = rl:ping()
line("ping: protocol=%s version=%s", tostring(protocol), tostring(version and version ~= ""))
local inline = { { key = "tenant:acme", limit = 2, window_ms = 60000 } }
local d, err = rl:check({ path = "/inline" }, { limits = inline, cost = 2 })
line("inline: allowed=%s rule=%s limit=%s remaining=%s rules=%d", tostring(d.allowed), d.rule, d.limit, d.remaining, #d.rules)
d = rl:check({ path = "/inline" }, { limits = inline })
line("inline again: allowed=%s rule=%s retry_after_ms>0=%s", tostring(d.allowed), d.rule, tostring(d.retry_after_ms > 0))
d = rl:check({ path = "/inline" }, { limits = { { key = "tenant:big", limit = 2, window_ms = 60000 } }, cost = 3 })
line("cost 3 > capacity 2: allowed=%s reason=%s", tostring(d.allowed), tostring(d.reason))
d, err = rl:check({ path = "/x" }, { limits = { { key = "k", limit = 0, window_ms = 1000 } } })
line("bad input: allowed=%s degraded=%s err=%s", tostring(d.allowed), tostring(d.degraded), tostring(err))
d, err = rl:check({ path = "/x" }, { limits = { { key = "k", limit = 1, window_ms = 1000, algorithm = "leaky" } } })
line("error answer: allowed=%s degraded=%s unreachable=%s err=%s", tostring(d.allowed), tostring(d.degraded),
  tostring(d.unreachable), tostring(err and err:match("^rlsidecar: [a-z_]+")))
local many = {}
for i = 1, 65 do many["a" .. i] = "v" end -- the daemon takes at most 64 attributes
d, err = rl:check(many)
line("too many attributes: allowed=%s status=%s err=%s", tostring(d.allowed), require("rlsidecar.http").rejection(d), tostring(err and err:match("^rlsidecar: [a-z_]+")))
d = rl:check({ path = "/x" })
line("after the error answer: allowed=%s degraded=%s", tostring(d.allowed), tostring(d.degraded))
local http = require "rlsidecar.http"
d, err = rl:check({ path = "/x", blob = string.rep("x", 70000) })
line("too large, not sent: allowed=%s status=%s err=%s", tostring(d.allowed), http.rejection(d), tostring(err and err:match("^rlsidecar: [a-z_]+")))
local big = require("resty.rlsidecar").new({ socket = rl.path, timeout_ms = 2000, max_frame = 1048576 })
d, err = big:check({ path = "/x", blob = string.rep("x", 70000) })
line("too large for the daemon: allowed=%s status=%s err=%s", tostring(d.allowed), http.rejection(d), tostring(err and err:match("^rlsidecar: [a-z_]+")))
d = big:check({ path = "/x" })
line("after it: allowed=%s degraded=%s", tostring(d.allowed), tostring(d.degraded))
-- A server that answers frame_too_large from the header and closes, as the daemon does:
-- a 4 MB frame is still being written when it closes (broken pipe), and its answer is
-- still the 431, not the policy.
local refusing = require("resty.rlsidecar").new({ socket = "@REFUSING@", timeout_ms = 2000, max_frame = 8388608 })
d, err = refusing:check({ path = "/x", blob = string.rep("x", 4000000) })
line("refused while still writing: allowed=%s status=%s err=%s", tostring(d.allowed), http.rejection(d), tostring(err and err:match("^rlsidecar: [a-z_]+")))
LUA
# The refusing server of the last case: it reads a request's length, answers
# frame_too_large (id 0) and closes, unread bytes and all.
refusing="$tmp/refusing.sock"
sed -i "s#@REFUSING@#$refusing#" "$tmp/check-cases.lua"
python3 -c '
import socket, struct, sys
body = (b"\x82\xa2id\x00\xa5error\x82\xa4code\xafframe_too_large\xa7message"
        b"\xd9\x2ca frame of 4000000 bytes is over max 65536 B")
s = socket.socket(socket.AF_UNIX); s.bind(sys.argv[1]); s.listen(64)
while True:
    c, _ = s.accept()
    c.recv(4)
    c.sendall(struct.pack(">I", len(body)) + body)
    c.close()
' "$refusing" &
pids+=($!)
wait_for "the refusing server" test -S "$refusing"
sed -i "s#^        location /static/ {#        location = /__rlsidecar_test { content_by_lua_file $tmp/check-cases.lua; }\n        location /static/ {#" "$tmp/nginx/nginx.conf"
# Test-only locations: a request that passes access() in two locations (an internal
# redirect), one that reaches access() only through an internal redirect, and
# subrequests (auth_request's, sharing the main request's variables, and
# ngx.location.capture's) whose locations call access() too.
cat >"$tmp/once.conf" <<'CONF'
        location /once/redirected/ { access_by_lua_block { rl_open:access() } try_files /nonexistent @once_redirected; }
        location @once_redirected { access_by_lua_block { rl_open:access() } proxy_pass http://app; }
        location /once/slot/ { access_by_lua_block { rl_open:access() } try_files /nonexistent @once_slot; }
        location @once_slot { access_by_lua_block { rl_open:access() } log_by_lua_block { rl_open:log() } proxy_pass http://app; }
        location /once/only-redirected/ { try_files /nonexistent @once_only; }
        location @once_only { access_by_lua_block { rl_open:access() } proxy_pass http://app; }
        location /once/auth/ { auth_request /once/auth-check; access_by_lua_block { rl_open:access() } proxy_pass http://app; }
        location = /once/auth-check { internal; content_by_lua_block { rl_open:access() return ngx.exit(204) } }
        location /once/capture/ {
            access_by_lua_block { rl_open:access() }
            content_by_lua_block { local r = ngx.location.capture("/once/sub/x") ngx.say("sub ", r.status) }
        }
        location /once/sub/ { internal; rewrite_by_lua_block { rl_open:access() } proxy_pass http://app; }
        location /burst/ {
            access_by_lua_block {
                rl_burst = rl_burst or assert(require("resty.rlsidecar").new {
                    socket = rl_open.path, timeout_ms = 10000, on_unavailable = "closed", pool_size = 16,
                })
                rl_burst:access()
            }
            log_by_lua_block { rl_burst:log() }
            proxy_pass http://app;
        }
        location /costly/ {
            access_by_lua_block {
                rl_costly = rl_costly or assert(require("resty.rlsidecar").new {
                    socket = rl_open.path, timeout_ms = 2000, on_unavailable = "open",
                    cost = function() return tonumber(ngx.var.http_x_cost) end,
                })
                rl_costly:access()
            }
            proxy_pass http://app;
        }
CONF
awk -v f="$tmp/once.conf" '/^        location \/static\/ \{/ { while ((getline l < f) > 0) print l } { print }' "$tmp/nginx/nginx.conf" >"$tmp/nginx/nginx.conf.new"
mv "$tmp/nginx/nginx.conf.new" "$tmp/nginx/nginx.conf"
# One process (master_process off): it runs as the invoking user, who owns the socket.
nginx -e "$tmp/nginx.log" -p "$tmp/nginx" -c "$tmp/nginx/nginx.conf" -g "daemon off; master_process off; pid $tmp/nginx/nginx.pid;" 2>>"$tmp/nginx.log" &
pids+=($!)
wait_for "nginx" curl -sf "http://127.0.0.1:$nginx_port/static/x"

echo "== HAProxy with clients/lua/examples/haproxy.cfg"
hap_port=$(free_port)
hap_dual_port=$(free_port)
sed -e "s#/usr/share/rlsidecar/lua/#$here/#g" \
  -e "s#/run/rlsidecar/rlsidecar.sock#$sock#g" \
  -e "s#127.0.0.1:9000#127.0.0.1:$backend_port#g" \
  -e "s#bind 127.0.0.1:8081#bind 127.0.0.1:$hap_port\n    bind :::$hap_dual_port v4v6\n    bind unix@$tmp/haproxy-unix.sock#" \
  -e "s#\(\.sock [a-z]*\) 50\$#\1 2000#" -e "s#\(\.sock [a-z]*\) 50 #\1 2000 #" \
  -e "s#^global#global\n    tune.bufsize 131072\n    stats socket $tmp/haproxy-stats.sock#" \
  -e "s#^    http-request set-var(txn.rlsidecar_user).*#&\n    http-request set-var(txn.rlsidecar_cost) req.fhdr(x-cost) if { req.fhdr(x-cost) -m found }\n    http-request set-var(txn.rlsidecar_user) req.fhdr(x-uid),crc32 if { req.fhdr(x-uid) -m found }#" \
  "$here/examples/haproxy.cfg" >"$tmp/haproxy.cfg"
grep -q "x-uid),crc32" "$tmp/haproxy.cfg" || { echo "e2e: the X-Uid line not added" >&2; exit 1; }
grep -q "txn.rlsidecar_cost" "$tmp/haproxy.cfg" || { echo "e2e: no set-var(txn.rlsidecar_user) line in examples/haproxy.cfg to add the cost after" >&2; exit 1; }
# /gone/ goes to a server that is down: HAProxy answers 503 itself.
sed -i -e "s#^    default_backend app#    use_backend gone if { path_beg /gone/ }\n&#" "$tmp/haproxy.cfg"
grep -q "use_backend gone" "$tmp/haproxy.cfg" || { echo "e2e: no default_backend line in examples/haproxy.cfg" >&2; exit 1; }
# /twice/ is checked a second time, with a user, after the example's check (see below).
sed -i -e "s#^    http-request lua.rlsidecar .* open 2000 unless .*#&\n    http-request set-var(txn.rlsidecar_user) str(hap-twice) if { path_beg /twice/ }\n    http-request lua.rlsidecar unix@$sock open 2000 if { path_beg /twice/ }#" "$tmp/haproxy.cfg"
grep -q "str(hap-twice)" "$tmp/haproxy.cfg" || { echo "e2e: no 'open 2000 unless' line in examples/haproxy.cfg to add the second check after" >&2; exit 1; }
# /burst/ is checked by a line of its own, closed and with a 10 s timeout, in place of the
# example's (see burst_in_flight).
sed -i -e "s#^    http-request lua.rlsidecar \(.* open 2000 unless .*\)#    http-request lua.rlsidecar unix@$sock closed 10000 if { lua.rlsidecar_path -m beg /burst/ }\n    http-request lua.rlsidecar \1 || { lua.rlsidecar_path -m beg /burst/ }#" "$tmp/haproxy.cfg"
grep -q "closed 10000 if { lua.rlsidecar_path -m beg /burst/ }" "$tmp/haproxy.cfg" || { echo "e2e: the check of /burst/ not added" >&2; exit 1; }
# /misconf/ is checked by a line of its own whose POLICY is misspelled (see "misspelled
# POLICY" below), in place of the example's. (Its TIMEOUT_MS is read: an unreadable one
# is 50 ms, which a loaded machine's checks may pass.)
sed -i -e "s#^    http-request lua.rlsidecar \(.* open 2000 unless .*\)#    http-request lua.rlsidecar unix@$sock clsoed 2000 if { lua.rlsidecar_path -m beg /misconf/ }\n    http-request lua.rlsidecar \1 || { lua.rlsidecar_path -m beg /misconf/ }#" "$tmp/haproxy.cfg"
grep -q "clsoed 2000 if { lua.rlsidecar_path -m beg /misconf/ }" "$tmp/haproxy.cfg" || { echo "e2e: the check of /misconf/ not added" >&2; exit 1; }
cat >>"$tmp/haproxy.cfg" <<EOF

backend gone
    retries 0
    server down 127.0.0.1:$(free_port)
EOF
grep -q "rl.sock open 2000" "$tmp/haproxy.cfg" || { echo "e2e: examples/haproxy.cfg no longer has 'open 50'" >&2; exit 1; }
haproxy -db -f "$tmp/haproxy.cfg" >"$tmp/haproxy.log" 2>&1 &
pids+=($!)
wait_for "haproxy" curl -sf "http://127.0.0.1:$hap_port/static/x"

# burst GATEWAY PORT USER: 5 requests as USER to /api/items; per-user admits 3.
burst() {
  local name=$1 port=$2 user=$3 i
  echo "-- $name: a burst of 5 as $user (per-user: 3 per 60 s)"
  local sent t lo
  sent=$(date +%s%N)
  for i in 1 2 3; do
    request GET "http://127.0.0.1:$port/api/items" "$user"
    expect "$name request $i: status" "$status" 200
    expect "$name request $i: body from the backend" "$body" "backend /api/items"
    expect "$name request $i: RateLimit-Policy (deciding rule first)" "$(header ratelimit-policy)" "$(lc '"per-user";q=3;w=60, "per-ip";q=1000;w=60')"
    expect_re "$name request $i: RateLimit" "$(header ratelimit)" "^\"per-user\";r=$((3 - i));t=[0-9]+, \"per-ip\";r=[0-9]+;t=[0-9]+$"
    # t, per-user's reset: full again 20 s a request after the first was decided, less
    # the time until this one's decision (at most the time since the first was sent; 1 ms
    # for rounding), in whole seconds rounded up. It allowed 20i - 1 at least: a burst
    # spread over more than a second on a loaded machine failed the test.
    t=$(header ratelimit | sed -n 's/^"per-user";r=[0-9]*;t=\([0-9]*\),.*/\1/p')
    lo=$(((20000 * i - ($(date +%s%N) - sent) / 1000000 - 1 + 999) / 1000))
    expect "$name request $i: per-user's t, $lo to $((20 * i))" "$((${t:-0} >= lo && ${t:-0} <= 20 * i))" 1
    expect "$name request $i: no Retry-After" "$(header retry-after)" ""
    # warn_at 0.6 of 3: the 2nd and 3rd requests warn.
    expect "$name request $i: RateLimit-Warning" "$(header ratelimit-warning)" "$( ((i >= 2)) && lc '"per-user"')"
  done
  for i in 4 5; do
    request GET "http://127.0.0.1:$port/api/items" "$user"
    expect "$name request $i: status" "$status" 429
    local ra
    ra=$(header retry-after)
    # The next token: 20 s after the first was decided, less the time since (at most the
    # time since it was sent), rounded up, as t above. It was 10 to 20: a burst spread
    # over more than 10 s (load 20) failed the test (Retry-After 8, then 5).
    lo=$(((20000 - ($(date +%s%N) - sent) / 1000000 - 1 + 999) / 1000))
    expect_re "$name request $i: Retry-After" "$ra" '^[0-9]+$'
    expect "$name request $i: Retry-After, $lo to 20 (got $ra)" "$((${ra:-0} >= lo && ${ra:-0} >= 1 && ${ra:-0} <= 20))" 1
    expect "$name request $i: Content-Type" "$(header content-type)" "application/problem+json"
    expect "$name request $i: no RateLimit-Warning on a 429" "$(header ratelimit-warning)" ""
    expect "$name request $i: RateLimit-Policy" "$(header ratelimit-policy)" "$(lc '"per-user";q=3;w=60, "per-ip";q=1000;w=60')"
    # t is the refusing rule's retry, what Retry-After says (not its reset, 5x s).
    expect_re "$name request $i: RateLimit" "$(header ratelimit)" '^"per-user";r=0;t='"$ra"', "per-ip";r=[0-9]+;t=[0-9]+$'
    expect "$name request $i: problem body" "$body" \
      "{\"type\":\"about:blank\",\"title\":\"Too Many Requests\",\"status\":429,\"detail\":\"This request exceeds rate limit \\\"per-user\\\"; retry in $ra seconds.\",\"rule\":\"per-user\",\"retry_after\":$ra}"
  done
  request GET "http://127.0.0.1:$port/static/logo.png" "$user"
  expect "$name unchecked path: status" "$status" 200
  expect "$name unchecked path: no RateLimit" "$(header ratelimit)" ""
  request POST "http://127.0.0.1:$port/login"
  expect "$name /login (closed policy, sidecar up): status" "$status" 200
  expect "$name /login: RateLimit-Policy" "$(header ratelimit-policy)" "$(lc '"login";q=100;w=60')"
}

echo "-- nginx: client:check() with inline limits, cost, bad input and an error answer"
request GET "http://127.0.0.1:$nginx_port/__rlsidecar_test"
expect "check() cases: status" "$status" 200
expect "check() cases" "$body" "$(cat <<'WANT'
ping: protocol=1 version=true
inline: allowed=true rule=tenant:acme limit=2 remaining=0 rules=1
inline again: allowed=false rule=tenant:acme retry_after_ms>0=true
cost 3 > capacity 2: allowed=false reason=cost_exceeds_capacity
bad input: allowed=true degraded=true err=rlsidecar: limits[0]: "limit" must be an integer of at least 1
error answer: allowed=true degraded=true unreachable=false err=rlsidecar: invalid_limit
too many attributes: allowed=false status=431 err=rlsidecar: attr_too_large
after the error answer: allowed=true degraded=false
too large, not sent: allowed=false status=431 err=rlsidecar: frame_too_large
too large for the daemon: allowed=false status=431 err=rlsidecar: frame_too_large
after it: allowed=true degraded=false
refused while still writing: allowed=false status=431 err=rlsidecar: frame_too_large
WANT
)"

burst nginx "$nginx_port" ngx-alice
burst haproxy "$hap_port" hap-alice

echo "-- haproxy: its own answer for an allowed request (503, the server down) carries the headers"
# http-response rules, lua.rlsidecar_headers among them, do not run for HAProxy's own
# answers; the example's http-after-response rules do.
for i in 1 2; do
  request GET "http://127.0.0.1:$hap_port/gone/x" hap-gone
  expect "haproxy, server down, request $i: HAProxy's 503" "$status" 503
  expect "haproxy, server down, request $i: RateLimit-Policy" "$(header ratelimit-policy)" "$(lc '"per-user";q=3;w=60')"
  expect_re "haproxy, server down, request $i: RateLimit" "$(header ratelimit)" "^\"per-user\";r=$((3 - i));t=[0-9]+$"
  expect "haproxy, server down, request $i: RateLimit-Warning" "$(header ratelimit-warning)" "$( ((i >= 2)) && lc '"per-user"')"
done

echo "-- haproxy: a second lua.rlsidecar line that refuses answers with its own headers, not the first's"
# The example's check of /twice/ allows (rule twice); a second line checks it again with a
# user, and per-user (3 a minute) refuses the 4th. The http-after-response rules put the
# first check's figures, left in the header variables, on that 429: RateLimit-Policy
# "twice";q=1000;w=60 under a body naming per-user.
for i in 1 2 3 4; do
  request GET "http://127.0.0.1:$hap_port/twice/x"
done
expect "haproxy second check: status" "$status" 429
expect "haproxy second check: the problem names per-user" "$(grep -o '"rule":"[^"]*"' <<<"$body")" '"rule":"per-user"'
expect "haproxy second check: RateLimit-Policy, the refusing rule first" "$(header ratelimit-policy)" "$(lc '"per-user";q=3;w=60, "twice";q=1000;w=60')"
expect_re "haproxy second check: RateLimit" "$(header ratelimit)" '^"per-user";r=0;t=[0-9]+, "twice";r=[0-9]+;t=[0-9]+$'

echo "-- haproxy: an action with a misspelled POLICY (clsoed) still checks, as closed"
# HAProxy hands the action its arguments only when it runs. Before, each such request went
# through unchecked, past every limit, with an alert each.
misconf_start=$(date +%s)
for i in 1 2 3 4 5 6 7 8 9 10; do
  request GET "http://127.0.0.1:$hap_port/misconf/x" hap-misconf
  if ((i <= 3)); then
    expect "haproxy misspelled POLICY, request $i: status" "$status" 200
    expect_re "haproxy misspelled POLICY, request $i: RateLimit" "$(header ratelimit)" "^\"per-user\";r=$((3 - i));t=[0-9]+"
  else
    expect "haproxy misspelled POLICY, request $i: per-user refuses" "$status" 429
  fi
done
# At most one line a second a Lua state (lua-load-per-thread: one a thread, and HAProxy
# runs a thread a CPU by default): not one a request. Bounded by the seconds the requests
# took (on a machine at load 20 they came about a second apart, and each was alerted).
misconf_s=$(($(date +%s) - misconf_start + 1))
threads=$(nproc)
n=$(grep -c 'got "clsoed" "2000", checked as closed 2000' "$tmp/haproxy.log" || true)
expect "haproxy misspelled POLICY: alerted in $n lines over ${misconf_s} s, at least one, at most one a second a thread ($threads)" \
  "$((n >= 1 && n <= misconf_s * threads && (n < 10 || misconf_s * threads >= 10)))" 1

echo "-- haproxy: txn.rlsidecar_cost (here from an X-Cost header) that is not a cost is a 400, whatever the policy"
# It took the policy ("open": allowed, past every limit) or became cost 1.
cost_status() { # cost_status VALUE: the status of a request as hap-cost with X-Cost: VALUE
  curl -s --max-time 10 -o "$tmp/b" -D "$tmp/h" -w '%{http_code}' -H "X-User: hap-cost" -H "X-Cost: $1" "http://127.0.0.1:$hap_port/api/items"
}
expect "haproxy X-Cost 3: allowed" "$(cost_status 3)" 200
for v in -1 1.5 abc 0x1; do
  expect "haproxy X-Cost $v: 400 (per-user is used up, and the policy is open)" "$(cost_status "$v")" 400
  expect "haproxy X-Cost $v: problem body" "$(cat "$tmp/b")" '{"type":"about:blank","title":"Bad Request","status":400,"detail":"This request'"'"'s cost is not a non-negative integer."}'
done
expect "haproxy X-Cost 99999999999999999999: refused, over any capacity" "$(cost_status 99999999999999999999)" 429
expect "haproxy X-Cost 99999999999999999999: no Retry-After" "$(grep -ci '^retry-after:' "$tmp/h" || true)" 0
expect "haproxy X-Cost 0: asks without consuming; per-user has nothing left" "$(cost_status 0)" 429

echo "-- haproxy: txn.rlsidecar_user set from an integer sample (X-Uid,crc32) is the user"
# HAProxy hands Lua an integer variable as a number, which the encoder refused: every
# such request went to the policy ("open": 200s past per-user's 3 a minute).
for i in 1 2 3 4 5; do
  status=$(curl -s --max-time 10 -o /dev/null -D "$tmp/h" -w '%{http_code}' -H "X-Uid: hap-uid" "http://127.0.0.1:$hap_port/api/items")
  if ((i <= 3)); then
    expect "haproxy integer user, request $i: allowed" "$status" 200
    expect_re "haproxy integer user, request $i: per-user's RateLimit" "$(grep -i '^ratelimit:' "$tmp/h" | tr -d '\r')" "\"per-user\";r=$((3 - i));t=[0-9]+"
  else
    expect "haproxy integer user, request $i: per-user refuses" "$status" 429
  fi
done

echo "-- nginx: a cost function's result that is not a cost is a 400, whatever the policy"
# It went to the policy ("open": allowed, past every limit), as did a cost past 2^53.
ngx_cost_status() { # ngx_cost_status VALUE: the status of /costly/x with X-Cost: VALUE
  curl -s --max-time 10 -o "$tmp/b" -D "$tmp/h" -w '%{http_code}' -H "X-Cost: $1" "http://127.0.0.1:$nginx_port/costly/x"
}
expect "nginx X-Cost 3: allowed" "$(ngx_cost_status 3)" 200
for v in -1 1.5 nan inf; do
  expect "nginx X-Cost $v: 400 (the policy is open)" "$(ngx_cost_status "$v")" 400
  expect "nginx X-Cost $v: problem body" "$(cat "$tmp/b")" '{"type":"about:blank","title":"Bad Request","status":400,"detail":"This request'"'"'s cost is not a non-negative integer."}'
done
expect "nginx X-Cost 99999999999999999999: refused, over any capacity" "$(ngx_cost_status 99999999999999999999)" 429
expect "nginx X-Cost 99999999999999999999: no Retry-After" "$(grep -ci '^retry-after:' "$tmp/h" || true)" 0

echo "-- path: one rule on /fast limits every spelling of it, whichever gateway asks"
# nginx sends $uri; HAProxy normalizes its raw path by the same rule (rlsidecar.path,
# clients/testdata/paths.json). Both count against the one key.
n=0
for gw in "nginx /fast" "haproxy /f%61st" "haproxy //fast" "haproxy /./fast" "haproxy /a/%2e%2E/fast?x=1" "nginx /f%61st"; do
  set -- $gw
  port=$nginx_port
  [ "$1" == haproxy ] && port=$hap_port
  n=$((n + 1))
  request GET "http://127.0.0.1:$port$2"
  expect "$1 $2: status" "$status" 200
  expect_re "$1 $2: counted by the rule on /fast" "$(header ratelimit)" "^\"fast\";r=$((6 - n));t=[0-9]+$"
done
for gw in "haproxy /%66ast" "haproxy /fast/../fast" "nginx //fast"; do
  set -- $gw
  port=$nginx_port
  [ "$1" == haproxy ] && port=$hap_port
  request GET "http://127.0.0.1:$port$2"
  expect "$1 $2: refused by the rule on /fast" "$status/$(grep -o '"rule":"[^"]*"' <<<"$body")" '429/"rule":"fast"'
done
# nginx's $uri, which the nginx client sends, is the path of clients/testdata/paths.json
# for every case nginx accepts (it refuses the others: 400). Asked of the backend, a
# plain nginx (merge_slashes on, the default) answering "backend $uri".
uri_cases=0
while read -r line; do
  uri_cases=$((uri_cases + 1))
  case "$line" in "ok "*) pass "nginx \$uri: ${line#ok }" ;; *) fail "nginx \$uri: $line" ;; esac
done < <(python3 - "$repo/clients/testdata/paths.json" "$backend_port" <<'PY'
import json, socket, sys
for c in json.load(open(sys.argv[1]))["cases"]:
    s = socket.create_connection(("127.0.0.1", int(sys.argv[2])))
    s.sendall(b"GET " + c["raw"].encode() + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    data = b""
    while True:
        d = s.recv(65536)
        if not d:
            break
        data += d
    head, _, body = data.partition(b"\r\n\r\n")
    status = head.split(b" ")[1]
    want = b"backend " + c["path"].encode("latin-1") + b"\n"
    if status == b"400" or (status == b"200" and body == want):
        print("ok %r: %s" % (c["raw"], "refused" if status == b"400" else "same path"))
    else:
        print("%r: %s %r, want %r" % (c["raw"], status.decode(), body, want))
PY
)
expect "nginx \$uri: every case of paths.json asked" "$uri_cases" "$(python3 -c 'import json, sys; print(len(json.load(open(sys.argv[1]))["cases"]))' "$repo/clients/testdata/paths.json")"
# The example's ACLs test the normalized path too (lua.rlsidecar_path): a /static/
# prefix walked back out of is checked, as nginx's locations see it.
request POST "http://127.0.0.1:$hap_port/static/../login"
expect "haproxy /static/../login: checked as /login" "$(header ratelimit-policy)" "$(lc '"login";q=100;w=60')"
request POST "http://127.0.0.1:$nginx_port/static/../login"
expect "nginx /static/../login: checked as /login" "$(header ratelimit-policy)" "$(lc '"login";q=100;w=60')"

echo "-- a request too large to be checked (a 70,000-byte X-User, an attribute): 431, not the open policy"
huge=$(head -c 70000 /dev/zero | tr '\0' u)
for gw in "nginx $nginx_port" "haproxy $hap_port"; do
  set -- $gw
  request GET "http://127.0.0.1:$2/api/items" "$huge"
  expect "$1 too large: status" "$status" 431
  expect "$1 too large: Content-Type" "$(header content-type)" "application/problem+json"
  expect "$1 too large: no RateLimit" "$(header ratelimit)" ""
  expect "$1 too large: problem body" "$body" \
    '{"type":"about:blank","title":"Request Header Fields Too Large","status":431,"detail":"This request'"'"'s attributes (its path or header fields) are too large for the rate limiter to check."}'
  # Sent, but longer than the daemon's --max-attr-len: attr_too_large, a 431 too (it was
  # bad_request, which the open policy let through).
  request GET "http://127.0.0.1:$2/api/items" "${huge:0:50000}"
  expect "$1 over --max-attr-len: status" "$status" 431
  expect "$1 over --max-attr-len: no RateLimit" "$(header ratelimit)" ""
  request GET "http://127.0.0.1:$2/api/items" "$1-ursula"
  expect "$1 after it: checked as usual" "$status/$(header ratelimit | cut -d';' -f1-2)" '200/"per-user";r=2'
done

echo "-- nginx: access() decides once per request, across internal redirects"
# checks_once: the checks the daemon has decided on the rule "once" so far.
checks_once() {
  curl -s "http://127.0.0.1:$admin_port/metrics" | awk '$1 == "rlsidecar_checks_total{rule=\"once\",result=\"allowed\"}" {print $2}'
}
before=$(checks_once)
request GET "http://127.0.0.1:$nginx_port/once/redirected/x"
expect "try_files ... @app, access() in both: status" "$status" 200
expect_re "try_files ... @app, access() in both: counted once" "$(header ratelimit)" '^"once";r=9;t=[0-9]+$'
expect "try_files ... @app, access() in both: the daemon asked once" "$(($(checks_once) - ${before:-0}))" 1
request GET "http://127.0.0.1:$nginx_port/once/redirected/x"
expect_re "try_files ... @app, again: counted once more" "$(header ratelimit)" '^"once";r=8;t=[0-9]+$'
# A concurrency rule's one slot: the request holds it once (a second access() taking a
# second slot would refuse the request itself), and log() in the last location frees it.
for i in 1 2; do
  request GET "http://127.0.0.1:$nginx_port/once/slot/x"
  expect "one slot, access() in both locations, request $i: status" "$status" 200
done
for i in $(seq 20); do # the release follows the response
  inflight=$(curl -s "http://127.0.0.1:$admin_port/metrics" | awk '$1 == "rlsidecar_inflight{rule=\"one-slot\"}" {print $2}')
  [ "$inflight" == 0 ] && break
  sleep 0.05
done
expect "one slot: freed after the request" "$inflight" 0
before=$(checks_once)
request GET "http://127.0.0.1:$nginx_port/once/only-redirected/x"
expect_re "access() only after the internal redirect: checked" "$(header ratelimit)" '^"once";r=9;t=[0-9]+$'
expect "access() only after the internal redirect: the daemon asked once" "$(($(checks_once) - before))" 1
before=$(checks_once)
request GET "http://127.0.0.1:$nginx_port/once/auth/x"
expect "auth_request subrequest and main request: status" "$status" 200
expect_re "auth_request: the main request checked on its own path" "$(header ratelimit)" '^"once";r=9;t=[0-9]+$'
expect "auth_request: the subrequest and the main request each asked once" "$(($(checks_once) - before))" 2
before=$(checks_once)
request GET "http://127.0.0.1:$nginx_port/once/capture/x"
expect "ngx.location.capture: the subrequest checked" "$body" "sub 200"
expect_re "ngx.location.capture: the main request checked" "$(header ratelimit)" '^"once";r=9;t=[0-9]+$'
expect "ngx.location.capture: the subrequest and the main request each asked once" "$(($(checks_once) - before))" 2

echo "-- delay: a queue of 1 per second shared by nginx and HAProxy; each waits delay_ms"
# timed GATEWAY PORT: one request to /api/queue; elapsed is its duration in ms.
timed() {
  local start end
  start=$(date +%s%N)
  request GET "http://127.0.0.1:$2/api/queue"
  end=$(date +%s%N)
  elapsed=$(((end - start) / 1000000))
  expect "$1 /api/queue: status" "$status" 200
}
# delayed_queue: how many of the queue's checks the daemon allowed after a wait.
delayed_queue() {
  curl -s "http://127.0.0.1:$admin_port/metrics" | awk '$1 == "rlsidecar_delayed_total{rule=\"queue\"}" {n = $2} END {print n + 0}'
}
delayed_before=$(delayed_queue)
queue_start=$(date +%s%N)
timed nginx "$nginx_port"
first=$elapsed
delayed_first=$(delayed_queue)
k=0
for gw in "nginx $nginx_port" "haproxy $hap_port" "haproxy $hap_port"; do
  # The k-th next request conforms k s after the first reached the daemon, so it ends no
  # earlier than k s after the first was sent (a sleep is never short; 20 ms for the
  # clocks). Counted from the first request, not from the one before: on a loaded
  # machine a request's own time after its wait delays the next one's arrival, which
  # shortens the next one's wait by as much.
  k=$((k + 1))
  timed $gw
  since=$((($(date +%s%N) - queue_start) / 1000000))
  expect "${gw%% *} /api/queue: held for the delay (took ${elapsed} ms, done ${since} ms after the first was sent)" "$((since >= k * 1000 - 20))" 1
done
# Told no delay by the daemon (its time is no proof: 1,234 ms on a machine at load 20),
# and each of the three after it told one.
expect "the first /api/queue request was not held (took ${first} ms): delayed checks" "$((delayed_first - delayed_before))" 0
expect "the three after it each waited: delayed checks" "$(($(delayed_queue) - delayed_first))" 3

echo "-- nginx pools its connection to the daemon"
conns=$(curl -s "http://127.0.0.1:$admin_port/metrics" | awk '$1 == "rlsidecar_connections" {print $2}')
expect "open connections at the daemon after both bursts (nginx keeps 1; HAProxy closes each)" "$conns" 1

echo "-- ip: an IPv4 client of a dual-stack listener is sent as its IPv4 address"
# The rule v4-only applies to ip 127.0.0.1 only, once a minute: through each gateway's
# dual-stack listener (where the client is ::ffff:127.0.0.1), the second request is
# refused. Both gateways count the one key.
request GET "http://127.0.0.1:$nginx_dual_port/v4/a"
expect "nginx dual-stack: the first request, counted under 127.0.0.1" "$(header ratelimit)" '"v4-only";r=0;t=60'
request GET "http://127.0.0.1:$hap_dual_port/v4/a"
expect "haproxy dual-stack: the same key, refused" "$status" 429

echo "-- ip: a client with no address (a Unix socket listener's) is left out, not one bucket"
# nginx's \$remote_addr for a `listen unix:` server is "unix:". Sent as ip, every request
# through the local proxy in front shared one per-ip bucket: per-peer (1 a minute, key ip)
# refused the second. Left out, a rule keyed on ip does not apply (no rate-limit fields),
# as the Python and Node middlewares leave out such a peer; over TCP it still counts.
# HAProxy's src for a `bind unix@` listener is nil: sent as ip "", likewise one bucket.
for gw in nginx haproxy; do
  for i in 1 2; do
    status=$(curl -s --max-time 10 --unix-socket "$tmp/$gw-unix.sock" -D "$tmp/h" -o /dev/null -w '%{http_code}' "http://gateway/peer/a")
    headers=$(tr -d '\r' <"$tmp/h" | tr 'A-Z' 'a-z')
    expect "$gw unix listener: request $i passes" "$status" 200
    expect "$gw unix listener: request $i has no per-peer fields (ip left out)" "$(header ratelimit)" ""
  done
done
# nginx's request takes the one token (t: 60, the reset); HAProxy's is refused, its t the
# retry: 60 s less the time since nginx's was decided (at most since it was sent), rounded
# up. It was 60 exactly: 59 when the two were over a second apart (load 20).
peer_sent=$(date +%s%N)
for port in "$nginx_port" "$hap_port"; do
  request GET "http://127.0.0.1:$port/peer/a"
  lo=$(((60000 - ($(date +%s%N) - peer_sent) / 1000000 - 1 + 999) / 1000))
  t=$(header ratelimit | sed -n 's/^"per-peer";r=0;t=\([0-9]*\)$/\1/p')
  expect "over TCP (port $port): per-peer counts 127.0.0.1, r=0 and t $lo to 60 ($(header ratelimit))" "$((${t:-0} >= lo && ${t:-0} <= 60))" 1
done

echo "-- concurrency: a lease is held while the proxied request runs, and freed when it completes"
# slots_held RULE: how many slots of RULE the daemon holds now (0 before its first check).
slots_held() {
  local n
  n=$(curl -s "http://127.0.0.1:$admin_port/metrics" | awk -v m="rlsidecar_inflight{rule=\"$1\"}" '$1 == m {print $2}')
  echo "${n:-0}"
}
# wait_held RULE N: waits until RULE holds N slots, up to 5 s; fails when it never does.
# In place of fixed sleeps: a request started in the background may take longer than
# them to be checked on a loaded machine, and a release follows its response (another
# gateway's request right after it may find the slot still held).
wait_held() {
  local i n
  for i in $(seq 100); do
    n=$(slots_held "$1")
    [ "$n" == "$2" ] && return 0
    sleep 0.05
  done
  echo "e2e: $1 held $n slots for 5 s, want $2" >&2
  return 1
}
# in_flight GATEWAY PORT: a 3 s request to /slow/held/ holds the one slot of slow-in-flight;
# a second one meanwhile is refused; once the first completed, the slot is free again
# (the lease is 60 s: only the gateway's release frees it that soon).
in_flight() {
  local name=$1 port=$2
  wait_held slow-in-flight 0 || fail "$name: the slot is free before the first request"
  # 3 s: the checks of /slow/b below come while it runs, on a loaded machine too (with the
  # 1 s of /slow/, one run of many had it done first, and /slow/b passed).
  curl -s --max-time 10 -o /dev/null -w '%{http_code}' "http://127.0.0.1:$port/slow/held/a" >"$tmp/slow-$name" &
  local slow=$!
  wait_held slow-in-flight 1 || fail "$name: the first request holds the slot"
  request GET "http://127.0.0.1:$port/slow/b"
  expect "$name: a second request while the first is in flight" "$status" 429
  expect "$name: its problem names the concurrency rule" "$(grep -o '"rule":"[^"]*"' <<<"$body")" '"rule":"slow-in-flight"'
  # A quota of concurrent requests, with no window (not "1 request per 60 s"); refused,
  # its t is the retry hint (at most 1 s).
  expect "$name: refused, RateLimit-Policy" "$(header ratelimit-policy)" "$(lc '"slow-in-flight";q=1;qu="concurrent-requests"')"
  expect "$name: refused, RateLimit" "$(header ratelimit)" "$(lc '"slow-in-flight";r=0;t=1')"
  expect "$name: refused, Retry-After" "$(header retry-after)" 1
  wait "$slow"
  expect "$name: the first (held 3 s by the backend)" "$(cat "$tmp/slow-$name")" 200
  local i
  for i in $(seq 20); do # the release follows the response; give it a moment
    request GET "http://127.0.0.1:$port/slow/c"
    [ "$status" == 200 ] && break
    sleep 0.05
  done
  expect "$name: after the first completed, the slot is free" "$status" 200
  # Allowed: no t (nothing says when a slot frees).
  expect "$name: allowed, RateLimit-Policy" "$(header ratelimit-policy)" "$(lc '"slow-in-flight";q=1;qu="concurrent-requests"')"
  expect "$name: allowed, RateLimit" "$(header ratelimit)" "$(lc '"slow-in-flight";r=0')"
}
in_flight nginx "$nginx_port"
in_flight haproxy "$hap_port"
# burst GATEWAY PORT: 30 requests at once to /burst/ (8 s each; at most 20 in flight),
# their checks all in flight together (the daemon stalled while the 30 curls start, and
# 0.5 s more, as in a pause): 20 pass, and while they run the daemon holds their 20
# slots — nginx keeps pool_size = 16 idle connections, and a connection holding leases
# must not be one it closes when 30 come back at once — and 10 more are refused. /burst/
# is checked with the closed policy and a 10 s timeout (a location, a line of its own):
# with the example's open policy and the test's 2 s, a loaded machine that took over 1.5 s to
# start the curls had the first checks time out, and the policy let them through without
# a lease (admitted: 22); closed, a check without an answer is a 503, never counted
# admitted, and any 200 is a request the daemon gave a slot. (8 s: the 10 more are checked
# while the 20 run, on a loaded machine too; with 4 s, 1 run of 14 at load 15 had some
# of the 20 done before them: 6 and 9 of 10 refused, through nginx and HAProxy.)
burst_in_flight() {
  local name=$1 port=$2 i curls=()
  wait_held burst-in-flight 0 || fail "$name: the burst's slots are free before it"
  kill -STOP "$daemon_pid"
  for i in $(seq 30); do
    curl -s --max-time 20 -o /dev/null -w '%{http_code}\n' "http://127.0.0.1:$port/burst/$i" >"$tmp/burst-$name-$i" &
    curls+=($!)
  done
  sleep 0.5
  kill -CONT "$daemon_pid"
  wait_held burst-in-flight 20 || true # (the 8 s requests hold their slots meanwhile)
  local slots
  slots=$(slots_held burst-in-flight)
  # The 10 at once, from one curl: one after the other, each a curl of its own, they took
  # 0.4 to 1.3 s apiece at load 15 (scratch: 429s answered 2.7 to 8.4 s after the
  # burst's start), and the last came after the first of the 20 had ended (200s).
  local more ended args=()
  for i in $(seq 10); do args+=(-o /dev/null "http://127.0.0.1:$port/burst/more"); done
  more=$(curl -s --no-progress-meter --parallel --parallel-immediate --parallel-max 10 --max-time 10 -w '%{http_code}\n' "${args[@]}" | grep -c '^429$' || true)
  ended=$(cat "$tmp"/burst-"$name"-* | grep -c '^200$' || true) # of the 20, done by then
  wait "${curls[@]}"
  local ok refused
  ok=$(cat "$tmp"/burst-"$name"-* | grep -c '^200$' || true)
  refused=$(cat "$tmp"/burst-"$name"-* | grep -c '^429$' || true)
  expect "$name: a burst of 30 against max 20 in flight: admitted" "$ok" 20
  expect "$name: a burst of 30 against max 20 in flight: refused (429; not 503, no answer in 10 s)" "$refused" 10
  expect "$name: slots held while the 20 run" "$slots" 20
  expect "$name: 10 more while they run: refused ($ended of the 20 had ended when they were answered)" "$more" 10
}
burst_in_flight nginx "$nginx_port"
burst_in_flight haproxy "$hap_port"
# slot_free_within GATEWAY PORT WHAT: a request to /slow/c passes within 5 s (the lease is
# 60 s: only the gateway's release, or its connection's close, frees the slot that soon).
slot_free_within() {
  local i
  for i in $(seq 100); do
    request GET "http://127.0.0.1:$2/slow/c"
    [ "$status" == 200 ] && break
    sleep 0.05
  done
  expect "$1: $3, the slot is free" "$status" 200
}
# streaming GATEWAY PORT: the backend sends the headers and a first line of /slow/stream/
# at once, the rest 3 s later: the slot stays held while the body is still coming (the
# request has not ended), then is freed. (3 s: the check of /slow/b comes while the body
# does, on a loaded machine too; with 1 s, 1 run of 10 at load 15 had the stream done
# first, and HAProxy's /slow/b passed.)
streaming() {
  local name=$1 port=$2
  wait_held slow-in-flight 0 || fail "$name: the slot is free before the streamed request"
  curl -s --max-time 10 -o /dev/null -w '%{http_code}' "http://127.0.0.1:$port/slow/stream/a" >"$tmp/stream-$name" &
  local slow=$!
  wait_held slow-in-flight 1 || fail "$name: the streamed request holds the slot"
  request GET "http://127.0.0.1:$port/slow/b"
  expect "$name: a request while the first's body is still streaming" "$status" 429
  wait "$slow"
  expect "$name: the streamed request" "$(cat "$tmp/stream-$name")" 200
  slot_free_within "$name" "$port" "after the streamed request completed"
}
streaming nginx "$nginx_port"
streaming haproxy "$hap_port"
# aborted GATEWAY PORT: the client gives up on /slow/a (a 1 s backend) after 0.3 s: the
# request ends, and its slot is freed.
aborted() {
  local name=$1 port=$2
  wait_held slow-in-flight 0 || fail "$name: the slot is free before the aborted request"
  curl -s --max-time 0.3 -o /dev/null "http://127.0.0.1:$port/slow/a" || true
  slot_free_within "$name" "$port" "after the client aborted its request"
}
aborted nginx "$nginx_port"
aborted haproxy "$hap_port"
# keep_alive GATEWAY PORT: ten leased requests one after the other on one client
# connection, each sent the moment the previous response arrived: each finds the slot
# its predecessor held free (freed when that request ended, not when the connection
# closes, and before the next request on the connection is checked).
keep_alive() {
  local codes url="http://127.0.0.1:$2/slow/quick/"
  wait_held slow-in-flight 0 || fail "$1: the slot is free before the keep-alive requests"
  codes=$(curl -s --max-time 10 -w '%{http_code} %{num_connects}\n' -o /dev/null $(printf -- "-o /dev/null $url %.0s" $(seq 9)) "$url" | sort | uniq -c | tr -s ' \n' ' ')
  expect "$1: keep-alive, ten leased requests in a row on one connection (count, status, connects)" "$codes" " 9 200 0 1 200 1 "
}
keep_alive nginx "$nginx_port"
keep_alive haproxy "$hap_port"
echo "-- nginx and HAProxy renew the lease of a request longer than it"
# /long/ takes 5 s at the backend; its rule's lease is 2 s. 4 s in, the first request
# still holds the one slot (nginx: access() renews its lease until log() releases it;
# HAProxy: a task renews it until the daemon answers it gone, and the check's connection
# stays open past the check's 2 s timeout, which HAProxy applies to an idle Lua socket),
# and once it completed the slot is free.
long_lease() {
  local name=$1 port=$2 long i
  curl -s --max-time 15 -o /dev/null -w '%{http_code}' "http://127.0.0.1:$port/long/a" >"$tmp/long-$name" &
  long=$!
  sleep 4
  status=$(curl -s --max-time 2 -o /dev/null -w '%{http_code}' "http://127.0.0.1:$port/long/b" || true)
  expect "$name: a second request 4 s into a 5 s one (lease 2 s): refused, the slot renewed" "$status" 429
  wait "$long"
  expect "$name: the long request" "$(cat "$tmp/long-$name")" 200
  for i in $(seq 50); do
    inflight=$(curl -s "http://127.0.0.1:$admin_port/metrics" | awk '$1 == "rlsidecar_inflight{rule=\"long-in-flight\"}" {print $2}')
    [ "$inflight" == 0 ] && break
    sleep 0.1
  done
  expect "$name: the long request's slot freed when it ended" "$inflight" 0
}
long_lease nginx "$nginx_port"
long_lease haproxy "$hap_port"
echo "-- nginx: a flood of short leased requests leaves the worker its timers"
# 1,100 requests of a few ms under a 60 s lease, then the long request again. Each leased
# request scheduled its own renewal timer at half the lease, 30 s on, pending after the
# request ended: past lua_max_pending_timers (1,024) every access() and log() failed to
# schedule its renewal and release ("too many pending timers"), and the long request's
# 2 s lease ran out while it ran (a second request 4 s in was let through). One tick a
# worker wakes the renewals of the requests still running.
# flood PORT: 1,100 leased requests of a few ms (/many/, a 60 s lease) on 4 keep-alive
# connections.
flood() {
  python3 - "$1" <<'PY'
import http.client, sys, threading
def run(n):
    c = http.client.HTTPConnection("127.0.0.1", int(sys.argv[1]), timeout=10)
    for _ in range(n):
        c.request("GET", "/many/x")
        r = c.getresponse()
        r.read()
        assert r.status == 200, r.status
ts = [threading.Thread(target=run, args=(275,)) for _ in range(4)]
[t.start() for t in ts]
[t.join() for t in ts]
PY
}
flood "$nginx_port"
long_lease nginx "$nginx_port"
expect "nginx: no 'too many pending timers' after the flood" "$(grep -c 'too many pending timers' "$tmp/nginx.log" || true)" 0
echo "-- HAProxy: a flood of short leased requests leaves one renewal task a thread"
# Each leased request had a task of its own, sleeping until its first renewal 30 s on
# (which finds the request ended): 1,100 requests, 1,100 tasks (and their coroutines) at
# once. One task a thread now renews every lease from a heap, and the long request's
# lease is still renewed among the 1,100 waiting.
hap_tasks() {
  python3 - "$tmp/haproxy-stats.sock" <<'PY'
import socket, sys
s = socket.socket(socket.AF_UNIX)
s.connect(sys.argv[1])
s.sendall(b"show info\n")
out = b""
while chunk := s.recv(65536):
    out += chunk
for line in out.decode().splitlines():
    if line.startswith("Tasks:"):
        print(line.split(":", 1)[1].strip())
PY
}
tasks_before=$(hap_tasks)
flood "$hap_port"
tasks_after=$(hap_tasks)
expect "haproxy: tasks after 1,100 leased requests, at most 100 more than the $tasks_before before" "$(( tasks_after - tasks_before <= 100 ))" 1
long_lease haproxy "$hap_port"
inflight=$(curl -s "http://127.0.0.1:$admin_port/metrics" | awk '$1 == "rlsidecar_inflight{rule=\"slow-in-flight\"}" {print $2}')
expect "no slot held after both gateways' requests" "$inflight" 0

echo "-- HAProxy: a lease shorter than any before, taken while the renewal task sleeps, is renewed"
# A fresh HAProxy of one Lua state: a /many/ request (a 60 s lease) starts its renewal
# task, which then sleeps 1 s; a /short/ request (4 s, a 400 ms lease) comes at once,
# on the same connection.
# The task renewed nothing until it woke, and the daemon had freed the slot by then: a
# second /short/ request (/short/quick/, answered at once by the backend) 0.6 s after
# the first took its slot was let through (200), past the rule's max of 1.
# An attempt counts when the second request is answered while the first still runs:
# sent 1.2 s after the first's curl started (a 2 s request), it reached HAProxy after the
# first had ended on a loaded machine (scratch trace at load 17: 2.4 s after the first's
# check; 200 is right then). It is now sent 0.6 s after the first holds the slot (the
# metrics). And a renewal every 200 ms of a 400 ms lease has 200 ms to reach the daemon:
# at load 15 on 2 cores one now and then does not (a process not run for that long; a
# scratch client renewing such a lease every 200 ms lost it in 6 of 268 renewals), and
# the daemon frees the slot, as a lease is for. So up to 3 attempts, each with a HAProxy
# of its own; the bug let the second request through in every one (9 of 9).
short_attempt() { # short_attempt N: sets short_got to "STATUS_B STATUS_A ran|ended"
  local short_port short_pid short_a ran
  wait_held short-in-flight 0 || true
  short_port=$(free_port)
  haproxy_cfg "$tmp/haproxy-short.cfg" "$short_port" "$sock"
  haproxy -f "$tmp/haproxy-short.cfg" -db >"$tmp/haproxy-short-$1.log" 2>&1 &
  short_pid=$!
  pids+=("$short_pid")
  wait_for "the one-state HAProxy" curl -sf -o /dev/null "http://127.0.0.1:$short_port/static/up"
  # /many/ then /short/ from one curl, on one connection: the second right after the
  # first. A curl of its own reached HAProxy 0.6 s after the first's check at load 17
  # (scratch trace): the renewal task then woke before the short lease ran out, and the
  # bug went unseen.
  curl -s --max-time 15 -w '%{http_code} ' -o /dev/null "http://127.0.0.1:$short_port/many/start" \
    -o /dev/null "http://127.0.0.1:$short_port/short/a" >"$tmp/short-a" &
  short_a=$!
  wait_held short-in-flight 1 || true
  sleep 0.6
  local status
  status=$(curl -s --max-time 5 -o /dev/null -w '%{http_code}' "http://127.0.0.1:$short_port/short/quick/b" || true)
  ran=ended
  [ "$(wc -w <"$tmp/short-a")" -lt 2 ] && ran=ran # the first's curl has not written its status yet
  wait "$short_a"
  short_got="$status $(cut -d' ' -f2 "$tmp/short-a") $ran"
  kill "$short_pid"
  wait "$short_pid" 2>/dev/null || true
}
short_tries=""
for attempt in 1 2 3; do
  short_attempt "$attempt"
  short_tries+="[$short_got] "
  [ "$short_got" == "429 200 ran" ] && break
done
expect "haproxy: a second /short/ request 0.6 s into a 4 s one (lease 400 ms), answered while it runs: refused, the slot renewed (attempts: $short_tries)" \
  "$short_got" "429 200 ran"

echo "-- the daemon restarts: nginx's pooled connection is stale, the next check still gets a decision"
kill "$daemon_pid"
wait "$daemon_pid" 2>/dev/null || true
"$tmp/rlsidecar" serve --config "$tmp/rules.yaml" --socket "$sock" --admin "" >>"$tmp/daemon.log" 2>&1 &
daemon_pid=$!
pids+=("$daemon_pid")
wait_for "the restarted daemon" "$tmp/rlsidecar" check --socket "$sock" user=probe-nobody-uses path=/probe
request GET "http://127.0.0.1:$nginx_port/api/items" ngx-carol
expect "nginx after a restart: status" "$status" 200
expect_re "nginx after a restart: decided, not degraded" "$(header ratelimit)" '^"per-user";r=2;t=(19|20), '

echo "-- a sidecar that accepts but never answers: the timeout (50 ms) and the policies"
hole="$tmp/hole.sock"
python3 -c '
import socket, sys, time
s = socket.socket(socket.AF_UNIX); s.bind(sys.argv[1]); s.listen(64)
conns = []
while True:
    c, _ = s.accept(); conns.append(c)   # read nothing, answer nothing
' "$hole" &
pids+=($!)
wait_for "the silent sidecar" test -S "$hole"
hole_port=$(free_port)
mkdir -p "$tmp/nginx-hole/logs"
# Without the example's proxy_set_header X-Request-Id, nothing names $request_id: access()
# must say that it cannot recognize a request across an internal redirect.
sed -e "s#$sock#$hole#g" -e "s#listen 127.0.0.1:$nginx_port;#listen 127.0.0.1:$hole_port;#" -e "s# listen \[::\]:$nginx_dual_port ipv6only=off;##" -e "s# listen unix:$tmp/nginx-unix.sock;##" -e "s#timeout_ms = 2000,#timeout_ms = 50,#" \
  -e '/proxy_set_header X-Request-Id \$request_id;/d' \
  -e "s#^error_log $tmp/nginx.log#error_log $tmp/nginx-hole.log#" \
  -e "s#$tmp/nginx\([;/]\)#$tmp/nginx-hole\1#g" "$tmp/nginx/nginx.conf" >"$tmp/nginx-hole/nginx.conf"
nginx -e "$tmp/nginx-hole.log" -p "$tmp/nginx-hole" -c "$tmp/nginx-hole/nginx.conf" -g "daemon off; master_process off; pid $tmp/nginx-hole/nginx.pid;" 2>>"$tmp/nginx-hole.log" &
pids+=($!)
wait_for "nginx (silent sidecar)" curl -sf "http://127.0.0.1:$hole_port/static/x"
start=$(date +%s%N)
request GET "http://127.0.0.1:$hole_port/api/items" ngx-dave
elapsed_ms=$((($(date +%s%N) - start) / 1000000))
expect "nginx, silent sidecar, open policy: status" "$status" 200
expect "nginx, silent sidecar, open policy: no RateLimit" "$(header ratelimit)" ""
if [ "$elapsed_ms" -ge 40 ] && [ "$elapsed_ms" -lt 2000 ]; then
  pass "nginx, silent sidecar: answered after the timeout (${elapsed_ms} ms)"
else
  fail "nginx, silent sidecar: answered after ${elapsed_ms} ms, want the 50 ms timeout"
fi
request POST "http://127.0.0.1:$hole_port/login"
expect "nginx, silent sidecar, closed policy: status" "$status" 503
expect "nginx, silent sidecar, closed policy: Retry-After" "$(header retry-after)" 1
expect "nginx without \$request_id named: access() says it cannot check once per request" \
  "$(grep -c 'rlsidecar: nginx does not keep \$request_id' "$tmp/nginx-hole.log")" 1
expect "nginx with \$request_id named (the example): no such error" "$(grep -c 'does not keep \$request_id' "$tmp/nginx.log" || true)" 0

hole_hap_port=$(free_port)
# Its max_frame from the environment (RLSIDECAR_MAX_FRAME, as the daemon's --max-frame):
# 300 bytes. A value that is no number stops HAProxy at load.
sed -e "s#$sock#$hole#g" -e "s#bind 127.0.0.1:$hap_port#bind 127.0.0.1:$hole_hap_port#" -e "/bind :::$hap_dual_port v4v6/d" -e "\#bind unix@$tmp/haproxy-unix.sock#d" -e "s#\(hole.sock [a-z]*\) 2000#\1 50#" \
  -e "s#^global#global\n    setenv RLSIDECAR_MAX_FRAME 300#" "$tmp/haproxy.cfg" >"$tmp/haproxy-hole.cfg"
sed -e "s#RLSIDECAR_MAX_FRAME 300#RLSIDECAR_MAX_FRAME 64k#" "$tmp/haproxy-hole.cfg" >"$tmp/haproxy-bad.cfg"
expect_re "haproxy, RLSIDECAR_MAX_FRAME=64k: refused at load" "$(haproxy -c -f "$tmp/haproxy-bad.cfg" 2>&1 || true)" \
  "RLSIDECAR_MAX_FRAME must be a positive integer \\(bytes\\), not 64k"
haproxy -db -f "$tmp/haproxy-hole.cfg" >"$tmp/haproxy-hole.log" 2>&1 &
pids+=($!)
wait_for "haproxy (silent sidecar)" curl -sf "http://127.0.0.1:$hole_hap_port/static/x"
start=$(date +%s%N)
request GET "http://127.0.0.1:$hole_hap_port/api/items" hap-dave
elapsed_ms=$((($(date +%s%N) - start) / 1000000))
expect "haproxy, silent sidecar, open policy: status" "$status" 200
expect "haproxy, silent sidecar, open policy: no RateLimit" "$(header ratelimit)" ""
if [ "$elapsed_ms" -ge 40 ] && [ "$elapsed_ms" -lt 2000 ]; then
  pass "haproxy, silent sidecar: answered after the timeout (${elapsed_ms} ms)"
else
  fail "haproxy, silent sidecar: answered after ${elapsed_ms} ms, want the 50 ms timeout"
fi
request GET "http://127.0.0.1:$hole_hap_port/api/$(head -c 300 /dev/zero | tr '\0' p)"
expect "haproxy, RLSIDECAR_MAX_FRAME=300, a 300-byte path: 431 before asking" "$status" 431
request POST "http://127.0.0.1:$hole_hap_port/login"
expect "haproxy, silent sidecar, closed policy: status" "$status" 503
expect "haproxy, silent sidecar, closed policy: Retry-After" "$(header retry-after)" 1

echo "-- nginx: waiting for a release, and a held request whose client goes away (a stand-in sidecar)"
# clients/lua/test/held_sidecar.py answers every check allowed with a lease, held for
# 5 s on /held/ (a delay), and answers releases 1 s late. nginx runs the example
# config against it (rl_closed's timeout lowered to 200 ms, below the release's 1 s),
# with ngx.sleep counted.
held="$tmp/held.sock"
/usr/bin/python3 "$here/test/held_sidecar.py" "$held" "$tmp/held-events" &
pids+=($!)
wait_for "the stand-in sidecar" test -S "$held"
held_port=$(free_port)
mkdir -p "$tmp/nginx-held/logs"
sed -e "s#$sock#$held#g" -e "s#listen 127.0.0.1:$nginx_port;#listen 127.0.0.1:$held_port;#" -e "s# listen \[::\]:$nginx_dual_port ipv6only=off;##" -e "s# listen unix:$tmp/nginx-unix.sock;##" \
  -e "s#timeout_ms = 2000, on_unavailable = \"closed\"#timeout_ms = 200, on_unavailable = \"closed\"#" \
  -e "s#$tmp/nginx\([;/]\)#$tmp/nginx-held\1#g" \
  -e "s#^    init_by_lua_block {#    init_worker_by_lua_block { SLEEPS = 0 local sleep = ngx.sleep ngx.sleep = function(s) SLEEPS = SLEEPS + 1 return sleep(s) end }\n    init_by_lua_block {#" \
  -e "s#^        location /static/ {#        location = /__sleeps { content_by_lua_block { ngx.print(SLEEPS) } }\n        location /nolog/ { access_by_lua_block { rl_open:access() } proxy_pass http://app; }\n        location /fresh/ { access_by_lua_block { local c = package.loaded.rl_fresh if not c then c = assert(require(\"resty.rlsidecar\").new { socket = \"$tmp/held-link.sock\", timeout_ms = 2000, on_unavailable = \"closed\", attrs = function() return { path = ngx.var.uri, user = ngx.var.http_x_user } end }) package.loaded.rl_fresh = c end c:access() } proxy_pass http://app; }\n        location /static/ {#" \
  -e "s#        location /static/ {#        location /pooled/ { access_by_lua_block { local c = package.loaded.rl_pooled if not c then c = assert(require(\"resty.rlsidecar\").new { socket = \"$held\", timeout_ms = 2000, on_unavailable = \"closed\", attrs = function() return { path = ngx.var.uri, user = ngx.var.http_x_user } end }) package.loaded.rl_pooled = c end c:access() } proxy_pass http://app; }\n        location /static/ {#" \
  "$tmp/nginx/nginx.conf" >"$tmp/nginx-held/nginx.conf"
grep -q 'timeout_ms = 200, on_unavailable = "closed"' "$tmp/nginx-held/nginx.conf" || { echo "e2e: the closed client's timeout not found" >&2; exit 1; }
grep -q "location /pooled/" "$tmp/nginx-held/nginx.conf" || { echo "e2e: the /pooled/ location not added" >&2; exit 1; }
nginx -e "$tmp/nginx-held.log" -p "$tmp/nginx-held" -c "$tmp/nginx-held/nginx.conf" -g "daemon off; master_process off; pid $tmp/nginx-held/nginx.pid;" 2>>"$tmp/nginx-held.log" &
pids+=($!)
wait_for "nginx (stand-in sidecar)" curl -sf "http://127.0.0.1:$held_port/__sleeps"
# The stand-in's events (held-events): check PATH LEASE T, release LEASE IN OUT (ms).
# release_event LEASE: "IN OUT" of the release of LEASE, once the stand-in has answered
# it (up to 5 s); "" when it has not.
release_event() {
  local i
  for i in $(seq 50); do
    awk -v l="$1" '$1 == "release" && $2 == l { print $3, $4; found = 1 } END { exit !found }' "$tmp/held-events" && return 0
    sleep 0.1
  done
}
sleeps_before=$(curl -s "http://127.0.0.1:$held_port/__sleeps")
codes=$(curl -s --max-time 10 -w '%{http_code} %{num_connects}\n' -o /dev/null "http://127.0.0.1:$held_port/slow/quick/" \
  -o /dev/null "http://127.0.0.1:$held_port/slow/quick/" | tr -s ' \n' ' ')
expect "stand-in: two leased requests on one keep-alive connection (status, connects)" "$codes" "200 1 200 0 "
expect "stand-in: the second waited for the first's release without polling (ngx.sleep calls)" \
  "$(($(curl -s "http://127.0.0.1:$held_port/__sleeps") - sleeps_before))" 0
read -r first_lease second_check < <(awk '$1 == "check" && $2 == "/slow/quick/" { n++; if (n == 1) l = $3; if (n == 2) t = $4 } END { print l, t }' "$tmp/held-events")
release_out=$(release_event "$first_lease" | cut -d' ' -f2)
expect "stand-in: the second was checked once the first's release was answered" "$((second_check >= ${release_out:-999999}))" 1
# A waiting bounded by the client's timeout: rl_closed's 200 ms, below the release's 1 s.
codes=$(curl -s --max-time 10 -w '%{http_code}\n' -X POST -o /dev/null "http://127.0.0.1:$held_port/login" \
  -o /dev/null "http://127.0.0.1:$held_port/login" | tr -s ' \n' ' ')
expect "stand-in: two leased /login requests on one connection, rl_closed (200 ms)" "$codes" "200 200 "
read -r first_lease second_check < <(awk '$1 == "check" && $2 == "/login" { n++; if (n == 1) l = $3; if (n == 2) t = $4 } END { print l, t }' "$tmp/held-events")
release_out=$(release_event "$first_lease" | cut -d' ' -f2)
expect "stand-in: the second /login did not wait past its timeout for a release answered 1 s late" \
  "$((second_check < ${release_out:-0}))" 1
# A request held 5 s (delay_ms) whose client gives up after 0.5 s: the request ends then
# (lua_check_client_abort on, in the example), and its lease is released at once, not
# when the 5 s are over.
curl -s --max-time 0.5 -o /dev/null "http://127.0.0.1:$held_port/held/a" || true
read -r held_lease held_check < <(awk '$1 == "check" && $2 == "/held/a" { print $3, $4 }' "$tmp/held-events")
held_release=$(release_event "$held_lease" | cut -d' ' -f1)
expect "stand-in: a held request whose client went away: its lease released within 2 s (of 5 s held; at $((${held_release:-99999} - held_check)) ms)" \
  "$(( ${held_release:-99999} - held_check < 2000 ))" 1

# The pooled-connection cases below go through /pooled/, a closed client of the stand-in
# whose timeout is 2 s: rl_closed's 200 ms (for the waiting above) was passed by checks the
# stand-in answered, on a loaded machine (load 15: three 503s more than end-of-files, and
# one among the farewell's, in 1 of 10 runs).
# A pooled connection the sidecar closed before nginx saw the close (a restart,
# --idle-timeout): the stand-in answers a stale-pool user's check without a lease (its
# connection goes back to the pool) and closes that connection unanswered at its next
# check. The check is sent again on another connection, within its timeout; before, it
# went to the failure policy: /login's 503, with the sidecar up.
codes=""
for i in $(seq 10); do
  codes+=$(curl -s --max-time 5 -o /dev/null -w '%{http_code} ' -X POST -H 'X-User: stale-pool' "http://127.0.0.1:$held_port/pooled/login")
done
expect "stand-in: /login checks meeting pooled connections the sidecar closed: sent again, decided" "$codes" "200 200 200 200 200 200 200 200 200 200 "
expect "stand-in: some met a closed pooled connection (the case was exercised)" "$(($(grep -c '^stale ' "$tmp/held-events" || true) > 0))" 1
# A new connection closed with its check unread (a daemon SIGKILLed, or stopped, having
# accepted it): the check was not read, so it is sent again, once, on another new
# connection (a client of its own, on a link to the stand-in's socket: its pool is
# empty). Before, only a pooled connection's was, and this one went to the policy (503).
ln -s "$held" "$tmp/held-link.sock"
request GET "http://127.0.0.1:$held_port/fresh/a" fresh-reset
expect "stand-in: nginx, a check whose new connection was closed unread: sent again, decided" "$status" 200
expect "stand-in: nginx, a new connection closed unread (the case was exercised)" "$(grep -c '^fresh-reset ' "$tmp/held-events" || true)" 1
# A pooled connection on which the sidecar read the check whole and closed without an
# answer (end-of-file: a daemon that died, or whose drain timed out, while deciding it):
# the check may have been counted, so it is not sent again; the policy decides it
# (/login's 503). Before, nginx sent it again on another connection: counted twice.
codes=""
for i in $(seq 10); do
  codes+=$(curl -s --max-time 5 -o /dev/null -w '%{http_code} ' -X POST -H 'X-User: eof-pool' "http://127.0.0.1:$held_port/pooled/login")
done
eof_checks=$(awk '($1 == "check" && $2 == "eof-pool") || ($1 == "eof" && $2 == "eof-pool") { n++ } END { print n + 0 }' "$tmp/held-events")
eofs=$(grep -c '^eof eof-pool' "$tmp/held-events" || true)
expect "stand-in: 10 /login checks, some met end-of-file unanswered: each sent once (checks the sidecar read)" "$eof_checks" 10
expect "stand-in: some met end-of-file unanswered (the case was exercised)" "$((eofs > 0))" 1
expect "stand-in: each check that met end-of-file was decided by the policy (503s)" "$(grep -o 503 <<<"$codes" | wc -l)" "$eofs"
# The same, with the drain's farewell (an error shutting_down, id 0) as the answer: the
# check was not read, and is sent again on another connection; before, the error went to
# the failure policy (/login's 503).
codes=""
for i in $(seq 10); do
  codes+=$(curl -s --max-time 5 -o /dev/null -w '%{http_code} ' -X POST -H 'X-User: farewell-pool' "http://127.0.0.1:$held_port/pooled/login")
done
expect "stand-in: /login checks answered by a drain's farewell: sent again, decided" "$codes" "200 200 200 200 200 200 200 200 200 200 "
expect "stand-in: some met the farewell (the case was exercised)" "$(($(grep -c '^farewell farewell-pool' "$tmp/held-events" || true) > 0))" 1
# A release the sidecar read whole and closed on without an answer (a daemon SIGKILLed, or
# whose drain timed out, while deciding it): a release is idempotent, so nginx sends it
# again on another connection, and that one frees the slot. Before, it was logged
# ("releasing a lease: ... closed") and dropped: a global lease's slots stayed held in
# Redis for the whole lease with no request running.
curl -s --max-time 5 -o /dev/null -X POST -H 'X-User: eof-release' "http://127.0.0.1:$held_port/login"
eof_lease=$(awk '$1 == "check" && $2 == "/login" { l = $3 } END { print l }' "$tmp/held-events")
release_event "$eof_lease" >/dev/null || true
expect "stand-in: nginx, a release read and closed on unanswered: sent again and answered" \
  "$(grep -c "^eof-release $eof_lease \|^release $eof_lease " "$tmp/held-events" || true)" 2
# HAProxy connects per check: the stand-in answers every other check of farewell-alt with
# the farewell at once (a connection a draining daemon accepted); the check is sent once
# more, and decided.
held_hap_port=$(free_port)
sed -e "s#$sock#$held#g" -e "s#bind 127.0.0.1:$hap_port#bind 127.0.0.1:$held_hap_port#" -e "/bind :::$hap_dual_port v4v6/d" -e "\#bind unix@$tmp/haproxy-unix.sock#d" \
  "$tmp/haproxy.cfg" >"$tmp/haproxy-held.cfg"
haproxy -db -f "$tmp/haproxy-held.cfg" >"$tmp/haproxy-held.log" 2>&1 &
pids+=($!)
wait_for "haproxy (stand-in sidecar)" curl -sf "http://127.0.0.1:$held_hap_port/static/x"
codes=""
for i in $(seq 6); do
  codes+=$(curl -s --max-time 5 -o /dev/null -w '%{http_code} ' -X POST -H 'X-User: farewell-alt' "http://127.0.0.1:$held_hap_port/login")
done
expect "stand-in: haproxy /login checks answered by a drain's farewell: sent once more, decided" "$codes" "200 200 200 200 200 200 "
expect "stand-in: haproxy met the farewell 6 times (the case was exercised)" "$(grep -c '^farewell farewell-alt' "$tmp/held-events" || true)" 6
# The next request on a keep-alive connection first releases the leases of the one before,
# on its check's connection; a draining daemon that accepted that connection answers its
# first frame, the release, with the farewell and reads no more. The check is sent once
# more (to the successor), and decided; before, it was sent on after the farewell, unread,
# and /login (closed) answered 503.
codes=$(curl -s --max-time 10 -w '%{http_code} %{num_connects}\n' -X POST -H 'X-User: farewell-release' -o /dev/null \
  "http://127.0.0.1:$held_hap_port/login" -o /dev/null "http://127.0.0.1:$held_hap_port/login" | tr -s ' \n' ' ')
expect "stand-in: haproxy, a check whose release met a drain's farewell: sent once more, decided (status, connects)" "$codes" "200 1 200 0 "
expect "stand-in: haproxy, the release met the farewell (the case was exercised)" "$(grep -c '^farewell-release ' "$tmp/held-events" || true)" 1
# The same when the release sent first is read and its connection closed without an
# answer (a daemon SIGKILLed, or whose drain timed out, while deciding it): a release is
# idempotent and the check was not sent, so both are sent once more (to the successor),
# and the check decided. Before, /login (closed) answered 503.
codes=$(curl -s --max-time 10 -w '%{http_code} %{num_connects}\n' -X POST -H 'X-User: eof-release' -o /dev/null \
  "http://127.0.0.1:$held_hap_port/login" -o /dev/null "http://127.0.0.1:$held_hap_port/login" | tr -s ' \n' ' ')
expect "stand-in: haproxy, a check whose release was read and closed on unanswered: sent once more, decided (status, connects)" "$codes" "200 1 200 0 "
eof_lease=$(awk '$1 == "eof-release" { l = $2 } END { print l }' "$tmp/held-events")
expect "stand-in: haproxy, that release sent again and answered" "$(grep -c "^release $eof_lease " "$tmp/held-events" || true)" 1
# A lease whose every renewal is answered renewed, whether or not the connection that
# took it is still open (a successor daemon renewing a global lease it finds in Redis,
# taken from a daemon SIGKILLed, which never read that connection's close), taken in a
# location without log(): once the request has ended (nginx closed that connection),
# nginx releases it instead of renewing it. Before, it renewed it for as long as the
# worker ran: a slot held with no request running.
curl -s --max-time 5 -o /dev/null -H 'X-User: renew-any' "http://127.0.0.1:$held_port/nolog/renew-any"
any_lease=$(awk '$1 == "check" && $2 == "/nolog/renew-any" { l = $3 } END { print l }' "$tmp/held-events")
expect_re "stand-in: nginx without log(), the lease of an ended request released, not renewed on (release IN OUT)" \
  "$(release_event "$any_lease")" '^[0-9]+ [0-9]+$'
# The same through HAProxy: once the transaction has ended (its connection collected),
# HAProxy releases it instead of renewing it. Before, it renewed it for as long as
# HAProxy ran. (A HAProxy of its own: the held one's renewal task is busy with the
# leases of the requests above, whose releases the stand-in answers 1 s late.)
any_hap_port=$(free_port)
sed -e "s#bind 127.0.0.1:$held_hap_port#bind 127.0.0.1:$any_hap_port#" -e "s#haproxy-stats.sock#haproxy-any-stats.sock#" "$tmp/haproxy-held.cfg" >"$tmp/haproxy-any.cfg"
haproxy -db -f "$tmp/haproxy-any.cfg" >"$tmp/haproxy-any.log" 2>&1 &
pids+=($!)
wait_for "haproxy (stand-in sidecar, renewals)" curl -sf "http://127.0.0.1:$any_hap_port/static/x"
curl -s --max-time 5 -o /dev/null -H 'X-User: renew-any' "http://127.0.0.1:$any_hap_port/api/renew-any"
any_lease=$(awk '$1 == "check" && $2 == "/api/renew-any" { l = $3 } END { print l }' "$tmp/held-events")
expect_re "stand-in: haproxy, the lease of an ended transaction released, not renewed on (release IN OUT)" \
  "$(release_event "$any_lease")" '^[0-9]+ [0-9]+$'
# A lease of 3 s beside a rate rule of 1 s, its renewals unanswered for the first 1.5 s (a
# daemon stalled or restarting), on a 5 s request: the gateway keeps renewing until the
# lease's own expiry, and the renewal after the outage is answered. Before, the renewals
# stopped once twice the first wait (the rate rule's window, 1 s) had passed unanswered,
# and the lease expired under the running request.
for gw in "nginx $held_port" "haproxy $held_hap_port"; do
  set -- $gw
  curl -s --max-time 10 -o /dev/null -H 'X-User: renew-outage' "http://127.0.0.1:$2/long/$1"
  lease=$(awk -v p="/long/$1" '$1 == "check" && $2 == p { print $3 }' "$tmp/held-events" | tail -1)
  expect "stand-in: $1, a lease renewed after an outage shorter than the lease (longer than the rate window)" \
    "$(($(grep -c "^renewed $lease " "$tmp/held-events" || true) >= 1))" 1
done
# A transaction checked by two lua.rlsidecar lines (/twice/; the stand-in leases every
# check, so each line takes a lease): the next request on the keep-alive connection
# releases both before its own checks. The second line's lease was not noted for
# release, and that request raced the daemon's reading of the close of the connection
# that held it.
codes=$(curl -s --max-time 10 -w '%{http_code} %{num_connects}\n' -o /dev/null "http://127.0.0.1:$held_hap_port/twice/a" \
  -o /dev/null "http://127.0.0.1:$held_hap_port/twice/b" | tr -s ' \n' ' ')
expect "stand-in: haproxy, two requests to /twice/ on one keep-alive connection (status, connects)" "$codes" "200 1 200 0 "
twice_leases=$(awk '$1 == "check" && $2 == "/twice/a" { print $3 }' "$tmp/held-events" | tr '\n' ' ')
expect_re "stand-in: haproxy, the first /twice/ request's two checks each took a lease" "$twice_leases" '^L[0-9]+ L[0-9]+ $'
for lease in $twice_leases; do
  expect "stand-in: haproxy, the next request on the connection released the first's lease $lease" \
    "$([ -n "$(release_event "$lease")" ] && echo released)" released
done

echo "-- nginx and HAProxy back off from a daemon at its --max-conns (too_many_connections)"
# A second real daemon, --max-conns 1, its one connection held by a client that sends
# nothing: every connection past it is answered too_many_connections and closed
# (rlsidecar_connections_closed_total{reason="too_many_connections"} counts them). 100
# requests through each gateway (the open policy: 200s) must not be 100 refused
# connections: the first refusal backs off (10 ms doubling to 1 s), and checks meanwhile
# are decided by the policy without a connect. Before, each check connected and was
# refused again.
capped="$tmp/capped.sock"
capped_admin=$(free_port)
"$tmp/rlsidecar" serve --config "$tmp/rules.yaml" --socket "$capped" --admin "127.0.0.1:$capped_admin" --max-conns 1 \
  >"$tmp/capped.log" 2>&1 &
pids+=($!)
wait_for "the capped daemon" "$tmp/rlsidecar" check --socket "$capped" user=probe-nobody-uses path=/probe
/usr/bin/python3 -c 'import socket, sys, time; s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); time.sleep(3600)' "$capped" &
pids+=($!)
capped_metric() { # capped_metric NAME: its value on the capped daemon's /metrics
  curl -s "http://127.0.0.1:$capped_admin/metrics" | awk -v n="$1" '$1 == n { print $2 }'
}
capped_refused() { capped_metric 'rlsidecar_connections_closed_total{reason="too_many_connections"}'; }
capped_held() { [ "$(capped_metric rlsidecar_connections)" = 1 ]; }
wait_for "the capped daemon's one connection held" capped_held
capped_port=$(free_port)
mkdir -p "$tmp/nginx-capped/logs"
sed -e "s#$held#$capped#g" -e "s#listen 127.0.0.1:$held_port;#listen 127.0.0.1:$capped_port;#" \
  -e "s#$tmp/nginx-held\([;/]\)#$tmp/nginx-capped\1#g" \
  "$tmp/nginx-held/nginx.conf" >"$tmp/nginx-capped/nginx.conf"
nginx -e "$tmp/nginx-capped.log" -p "$tmp/nginx-capped" -c "$tmp/nginx-capped/nginx.conf" -g "daemon off; master_process off; pid $tmp/nginx-capped/nginx.pid;" 2>>"$tmp/nginx-capped.log" &
pids+=($!)
wait_for "nginx (capped daemon)" curl -sf "http://127.0.0.1:$capped_port/__sleeps"
capped_hap_port=$(free_port)
sed -e "s#$held#$capped#g" -e "s#bind 127.0.0.1:$held_hap_port#bind 127.0.0.1:$capped_hap_port#" \
  "$tmp/haproxy-held.cfg" >"$tmp/haproxy-capped.cfg"
haproxy -db -f "$tmp/haproxy-capped.cfg" >"$tmp/haproxy-capped.log" 2>&1 &
pids+=($!)
wait_for "haproxy (capped daemon)" curl -sf "http://127.0.0.1:$capped_hap_port/static/x"
for gw in "nginx $capped_port" "haproxy $capped_hap_port"; do
  set -- $gw
  args=()
  for i in $(seq 100); do args+=(-o /dev/null "http://127.0.0.1:$2/api/items"); done
  before=$(capped_refused)
  codes=$(curl -s --max-time 60 -w '%{http_code}\n' "${args[@]}" | sort | uniq -c | awk '{ print $2 "x" $1 }' | tr '\n' ' ')
  after=$(capped_refused)
  refused=$((after - before))
  expect "capped daemon: $1, 100 requests decided by the open policy" "$codes" "200x100 "
  expect "capped daemon: $1, some connections refused (the case was exercised)" "$((refused > 0))" 1
  expect "capped daemon: $1, backs off: at most 50 of 100 checks connected and were refused (refused $refused)" "$((refused <= 50))" 1
done

echo "-- the daemon stops: the unreachable policies"
kill "$daemon_pid"
wait "$daemon_pid" 2>/dev/null || true
for gw in "nginx $nginx_port" "haproxy $hap_port"; do
  set -- $gw
  request GET "http://127.0.0.1:$2/api/items" "$1-bob"
  expect "$1 open policy: status" "$status" 200
  expect "$1 open policy: body from the backend" "$body" "backend /api/items"
  expect "$1 open policy: no RateLimit" "$(header ratelimit)" ""
  request POST "http://127.0.0.1:$2/login"
  expect "$1 closed policy: status" "$status" 503
  expect "$1 closed policy: Retry-After" "$(header retry-after)" 1
  expect "$1 closed policy: Content-Type" "$(header content-type)" "application/problem+json"
  expect "$1 closed policy: problem body" "$body" \
    '{"type":"about:blank","title":"Service Unavailable","status":503,"detail":"The rate limiter is unavailable and this service does not admit requests without it; retry in 1 second.","retry_after":1}'
  # /login spelled otherwise is the same route: the same closed policy.
  request POST "http://127.0.0.1:$2/log%69n"
  expect "$1 closed policy, /log%69n: status" "$status" 503
done
# nginx logs each connect() that fails itself (the socket file gone: crit), whatever
# lua_socket_log_errors says: the client backs off its connects (10 ms doubling to 1 s),
# so a burst of 100 requests with the daemon away costs a few such lines, not 100.
before=$(grep -c "connect() to unix:$sock failed" "$tmp/nginx.log" || true)
codes=$(curl -s -w '%{http_code} ' $(for i in $(seq 100); do printf -- '-o /dev/null http://127.0.0.1:%s/api/items ' "$nginx_port"; done) | tr -s ' ' '\n' | sort | uniq -c | tr -s ' \n' ' ')
expect "nginx, the daemon away, 100 requests: all by the open policy" "$codes" " 100 200 "
after=$(grep -c "connect() to unix:$sock failed" "$tmp/nginx.log" || true)
expect "nginx, the daemon away, 100 requests: nginx's own connect() lines at most 20 ($((after - before)))" "$((after - before <= 20))" 1
# /misconf/'s line misspells its POLICY (clsoed): it decides as closed, the daemon away.
request GET "http://127.0.0.1:$hap_port/misconf/x" hap-misconf-away
expect "haproxy misspelled POLICY, the daemon away: status (decided as closed)" "$status" 503
# The example's error_log level (warn) lets the client's line about them through: with
# nginx's default (error), a daemon away left no trace in the log.
expect "nginx: the policy's decisions logged (warn)" "$(($(grep -c 'rlsidecar: no decision, policy' "$tmp/nginx.log" || true) > 0))" 1
expect "haproxy: the policy's decisions logged" "$(($(grep -c 'rlsidecar: no decision, policy' "$tmp/haproxy.log" || true) > 0))" 1

if [ "$failures" -ne 0 ]; then
  echo "== $failures checks FAILED"
  for f in "$tmp"/*.log; do echo "--- $f"; tail -20 "$f"; done
  exit 1
fi
echo "== nginx and HAProxy end to end: ok"
