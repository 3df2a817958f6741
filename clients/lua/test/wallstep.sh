#!/usr/bin/env bash
# A step of the gateway host's wall clock (NTP stepping it, a VM resumed) while nginx
# renews a lease: real nginx, its wall clock faked by libfaketime (the faketime package)
# and stepped back an hour while a request longer than its lease runs; the real daemon on
# the real clock. The request's slot must stay held (its lease renewed) until it ends, and
# nginx's socket timeouts must not stretch by the step. Before, the renewals were timed on
# ngx.now (the wall clock): after the step back, the next renewal was due an hour later,
# the lease ran out after 1 s, and a second request was admitted past max: 1.
#
# Needs go, nginx, libnginx-mod-http-lua, curl, python3 and faketime. Exits 0 only if
# everything holds. WALLSTEP_KEEP=1 keeps the temporary directory.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)" # clients/lua
repo="$(cd "$here/../.." && pwd)"
faketime_lib=$(ls /usr/lib/*/faketime/libfaketime.so.1 2>/dev/null | head -1 || true)
if [ -z "$faketime_lib" ]; then
  echo "wallstep: libfaketime not found (apt-get install faketime)" >&2
  exit 1
fi
keep_var=WALLSTEP_KEEP
. "$here/test/harness.sh"

daemon_bin "$tmp/rlsidecar"
cat >"$tmp/rules.yaml" <<'EOF'
rules:
  - name: one-at-a-time
    key: user
    concurrency: { max: 1, lease: 1s }
EOF
"$tmp/rlsidecar" serve --socket "$tmp/d.sock" --admin= --config "$tmp/rules.yaml" >"$tmp/daemon.log" 2>&1 &
pids+=($!)
wait_for "the daemon" test -S "$tmp/d.sock"

port=$(free_port)
mkdir -p "$tmp/logs"
cat >"$tmp/nginx.conf" <<CONF
load_module /usr/lib/nginx/modules/ndk_http_module.so;
load_module /usr/lib/nginx/modules/ngx_http_lua_module.so;
daemon off;
# nginx drops the environment but for what env names: libfaketime reads these at each call.
env LD_PRELOAD;
env FAKETIME_TIMESTAMP_FILE;
env FAKETIME_NO_CACHE;
env DONT_FAKE_MONOTONIC;
master_process off;
worker_processes 1;
error_log $tmp/nginx.log warn;
pid $tmp/nginx.pid;
events { worker_connections 64; }
http {
  access_log off;
  lua_package_path "$here/?.lua;;";
  client_body_temp_path $tmp; proxy_temp_path $tmp; fastcgi_temp_path $tmp; uwsgi_temp_path $tmp; scgi_temp_path $tmp;
  init_by_lua_block {
    rl = assert(require("resty.rlsidecar").new {
      socket = "$tmp/d.sock", timeout_ms = 2000, on_unavailable = "closed",
      attrs = function() return { user = ngx.var.http_x_user } end,
    })
  }
  server {
    listen 127.0.0.1:$port;
    add_header X-Request-Id \$request_id; # named, so access() checks a request once
    access_by_lua_block { rl:access() }
    log_by_lua_block { rl:log() }
    location /slow { content_by_lua_block { ngx.sleep(6) ngx.say("slow") } }
    location /probe { content_by_lua_block { ngx.say("probe") } }
    location /now { access_by_lua_block { } log_by_lua_block { } content_by_lua_block { ngx.update_time() ngx.print(math.floor(ngx.now())) } }
  }
}
CONF
# The fake wall clock: an offset read from a file at every call (FAKETIME_NO_CACHE), the
# monotonic clock left real (nginx's timers, the lease's renewals after this change).
echo "+0" >"$tmp/faketime"
LD_PRELOAD="$faketime_lib" FAKETIME_TIMESTAMP_FILE="$tmp/faketime" FAKETIME_NO_CACHE=1 DONT_FAKE_MONOTONIC=1 \
  nginx -p "$tmp" -c "$tmp/nginx.conf" -e "$tmp/nginx.log" >"$tmp/nginx.out" 2>&1 &
pids+=($!)
wait_for "nginx" curl -s -o /dev/null "http://127.0.0.1:$port/probe"

probe() { curl -s -o /dev/null -w '%{http_code}' --max-time 10 -H 'X-User: ann' "http://127.0.0.1:$port/probe"; }

echo "== a 6 s request under a 1 s lease, nginx's wall clock stepped back an hour 0.2 s in"
curl -s -o "$tmp/slow.body" -w '%{http_code}' --max-time 20 -H 'X-User: ann' "http://127.0.0.1:$port/slow" >"$tmp/slow.status" &
slow=$!
sleep 0.2
echo "-1h" >"$tmp/faketime"
behind=$(( $(date +%s) - $(curl -s --max-time 10 "http://127.0.0.1:$port/now") ))
expect "nginx's wall clock an hour behind" "$(( behind >= 3590 && behind <= 3610 ))" 1
# Its slot is held (the lease renewed) all along: each probe is refused by the rule.
for at in 1.5 2.5 3.5; do
  sleep 1 # each probe about a second after the one before (the curl above took some)
  expect "a probe ${at} s in, the slow request running: refused (its slot held)" "$(probe)" 429
done
wait "$slow" || true
expect "the slow request" "$(cat "$tmp/slow.status")" 200
expect "a probe after it: its slot freed" "$(probe)" 200

if [ "$failures" -ne 0 ]; then
  echo "--- nginx.log" >&2
  tail -20 "$tmp/nginx.log" >&2 || true
  echo "wallstep: $failures failed" >&2
  exit 1
fi
echo "wallstep: all passed"
