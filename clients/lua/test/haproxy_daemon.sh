#!/usr/bin/env bash
# HAProxy's action against a daemon it cannot connect to, or whose answers are longer than
# HAProxy's buffer, through real HAProxy (one thread, one Lua state) and the real daemon:
#
# - A daemon whose accept queue is full (a stand-in: a socket listening with a backlog of
#   0, its one place taken by a connection never accepted). HAProxy writes a line of its
#   own for each connect that fails there ("Connect() failed for backend LUA-SOCKET: ...
#   check backlog size on the server."). 100 requests must not be 100 connects, 100 such
#   lines: the first failure backs off (10 ms doubling to 1 s) and checks meanwhile are
#   decided by the policy without a connect. Once a real daemon serves that path, a check
#   gets its decision again within a few seconds (the backoff ends).
# - A real daemon at its --max-conns while HAProxy renews the leases of requests in
#   flight: their renewals, refused too_many_connections, must back off as checks do, not
#   connect again for each batch (each unanswered renewal comes again at half what is left
#   of its lease, about ten a lease before it expires). Once the daemon has room again, a
#   check gets its decision.
# - An answer longer than HAProxy's default buffer (tune.bufsize, 16 KB: 200 rules decide
#   the request): HAProxy 2.6 reads it one buffer per socket timeout, so the check takes
#   its whole TIMEOUT_MS. The action must say so in HAProxy's log, naming tune.bufsize.
#
# Needs go, haproxy (with Lua), curl and python3. Exits 0 only if everything holds.
# HAPROXY_DAEMON_KEEP=1 keeps the temporary directory.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)" # clients/lua
repo="$(cd "$here/../.." && pwd)"
keep_var=HAPROXY_DAEMON_KEEP
. "$here/test/harness.sh"

daemon_bin "$tmp/rlsidecar"
cat >"$tmp/rules.yaml" <<'EOF'
rules:
  - name: per-path
    match: { path: "/api/**" }
    key: path
    limit: { requests: 1000, per: 60s }
  - name: held
    match: { path: "/hold/**" }
    key: path
    concurrency: { max: 100, lease: 4s }
EOF

# The backend: /hold/ answers after 10 s, anything else at once.
backend_port=$(free_port)
python3 - "$backend_port" >"$tmp/backend.log" 2>&1 <<'PY' &
import http.server, sys, time
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path.startswith("/hold/"):
            time.sleep(10)
        body = b"backend " + self.path.encode() + b"\n"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
PY
pids+=($!)
wait_for "the backend" curl -sf "http://127.0.0.1:$backend_port/"

# haproxy_for NAME SOCKET: starts HAProxy checking every request with the daemon at SOCKET
# (open policy, 2 s), on a port it sets in hap_port; its log is $tmp/haproxy-NAME.log.
haproxy_for() {
  hap_port=$(free_port)
  haproxy_cfg "$tmp/haproxy-$1.cfg" "$hap_port" "$2" \
    'http-after-response set-header RateLimit %[var(txn.rlsidecar_ratelimit)] if { var(txn.rlsidecar_ratelimit) -m found }'
  haproxy -db -f "$tmp/haproxy-$1.cfg" >"$tmp/haproxy-$1.log" 2>&1 &
  pids+=($!)
  wait_for "haproxy ($1)" curl -sf -o /dev/null "http://127.0.0.1:$hap_port/api/up"
}

# hundred PORT: the statuses of 100 requests in a row, as "200x100 ".
hundred() {
  local args=() i
  for i in $(seq 100); do args+=(-o /dev/null "http://127.0.0.1:$1/api/items"); done
  curl -s --max-time 60 -w '%{http_code}\n' "${args[@]}" | sort | uniq -c | awk '{ print $2 "x" $1 }' | tr '\n' ' '
}

# decided PORT PATH: whether a request got the daemon's decision (a RateLimit header).
decided() {
  curl -s -D - -o /dev/null --max-time 5 "http://127.0.0.1:$1$2" | grep -qi '^ratelimit:'
}

echo "-- a daemon whose accept queue is full: HAProxy's failed connects back off"
full="$tmp/full.sock"
python3 - "$full" >"$tmp/full.log" 2>&1 <<'PY' &
import socket, sys, time
s = socket.socket(socket.AF_UNIX)
s.bind(sys.argv[1])
s.listen(0)
c = socket.socket(socket.AF_UNIX)
c.connect(sys.argv[1])  # takes the queue's one place; never accepted
print("full", flush=True)
time.sleep(3600)
PY
full_pid=$!
pids+=("$full_pid")
wait_for "the full stand-in" grep -q full "$tmp/full.log"
haproxy_for full "$full"
codes=$(hundred "$hap_port")
expect "full queue: 100 requests decided by the open policy" "$codes" "200x100 "
lines=$(grep -c "Connect() failed for backend LUA-SOCKET" "$tmp/haproxy-full.log" || true)
expect "full queue: HAProxy's own connect failure lines, some (the case was exercised)" "$((lines > 0))" 1
expect "full queue: at most 20 of 100 checks connected and failed ($lines lines)" "$((lines <= 20))" 1
kill "$full_pid"
wait "$full_pid" 2>/dev/null || true
rm -f "$full"
"$tmp/rlsidecar" serve --config "$tmp/rules.yaml" --socket "$full" --admin= >"$tmp/daemon-full.log" 2>&1 &
pids+=($!)
wait_for "a daemon on the full stand-in's path" "$tmp/rlsidecar" check --socket "$full" path=/probe
wait_for "haproxy's check decided again once a daemon serves the path" decided "$hap_port" /api/again
pass "full queue: decided again once a daemon serves the path"

echo "-- a daemon at its --max-conns: lease renewals back off from too_many_connections"
# 16 requests hold a 4 s lease each (the backend answers /hold/ after 10 s), taken 30 ms
# apart: their renewals are due apart, from 2 s on. Their 16 connections and 4 idle ones
# fill the daemon's 20; each renewal's connection is then refused until the leases expire.
capped="$tmp/capped.sock"
capped_admin=$(free_port)
"$tmp/rlsidecar" serve --config "$tmp/rules.yaml" --socket "$capped" --admin "127.0.0.1:$capped_admin" --max-conns 20 \
  >"$tmp/daemon-capped.log" 2>&1 &
pids+=($!)
wait_for "the capped daemon" "$tmp/rlsidecar" check --socket "$capped" path=/probe
capped_metric() { # capped_metric NAME: its value on the capped daemon's /metrics
  curl -s "http://127.0.0.1:$capped_admin/metrics" | awk -v n="$1" '$1 == n { print $2 }'
}
capped_refused() { capped_metric 'rlsidecar_connections_closed_total{reason="too_many_connections"}'; }
capped_at() { [ "$(capped_metric rlsidecar_connections)" = "$1" ]; }
capped_held() { [ "$(capped_metric 'rlsidecar_inflight{rule="held"}')" = "$1" ]; }
haproxy_for capped "$capped"
python3 - "$capped" 4 >"$tmp/idle.log" 2>&1 <<'PY' &
import socket, sys, time
cs = []
for _ in range(int(sys.argv[2])):
    c = socket.socket(socket.AF_UNIX)
    c.connect(sys.argv[1])
    cs.append(c)
time.sleep(3600)
PY
idle_pid=$!
pids+=("$idle_pid")
wait_for "4 idle connections" capped_at 4
# The 16 from one process, its threads 30 ms apart: a curl and a sleep of their own each
# took up to 3 s to start at load 13-17, and a check that came after the first lease's
# first renewal (2 s) met that renewal's connection beside the 4 idle and 15 held: it was
# refused (too_many_connections) and decided by the policy, without a lease ("timed out
# waiting for 16 leases held", 1 run in 3 at load 13).
python3 - "$hap_port" >"$tmp/holds.log" 2>&1 <<'PY' &
import http.client, sys, threading, time
def hold(i):
    c = http.client.HTTPConnection("127.0.0.1", int(sys.argv[1]), timeout=30)
    c.request("GET", "/hold/%d" % i)
    c.getresponse().read()
ts = []
for i in range(1, 17):
    ts.append(threading.Thread(target=hold, args=(i,)))
    ts[-1].start()
    time.sleep(0.03)
[t.join() for t in ts]
PY
holds=($!)
pids+=($!)
wait_for "16 leases held" capped_held 16
wait_for "the daemon at its 20 connections" capped_at 20
before=$(capped_refused)
# Past every lease's expiry (4 s after it was taken): every renewal has been tried.
sleep 5
after=$(capped_refused)
refused=$((after - before))
expect "capped daemon: renewals refused (the case was exercised)" "$((refused > 0))" 1
expect "capped daemon: renewals back off: at most 40 refused connections for 16 leases (refused $refused)" "$((refused <= 40))" 1
kill "$idle_pid"
wait "$idle_pid" 2>/dev/null || true
wait_for "haproxy's check decided again once the daemon has room" decided "$hap_port" /api/room
pass "capped daemon: decided again once it has room"
for p in "${holds[@]}"; do wait "$p" 2>/dev/null || true; done

echo "-- an answer longer than HAProxy's buffer: the action names tune.bufsize"
python3 - "$tmp/big.yaml" <<'PY'
import sys
with open(sys.argv[1], "w") as f:
    f.write("rules:\n")
    for i in range(200):
        f.write("  - name: big-%04d-a-rule-name-of-some-length\n    match: { path: \"/big/**\" }\n    key: ip\n"
                "    limit: { requests: 1000, per: 60s }\n" % i)
PY
big="$tmp/big.sock"
"$tmp/rlsidecar" serve --config "$tmp/big.yaml" --socket "$big" --admin= >"$tmp/daemon-big.log" 2>&1 &
pids+=($!)
wait_for "the daemon of 200 rules" "$tmp/rlsidecar" check --socket "$big" path=/probe
haproxy_for big "$big"
curl -s -o /dev/null --max-time 20 "http://127.0.0.1:$hap_port/big/x" || true
big_named() { grep -q 'set tune.bufsize in global above' "$tmp/haproxy-big.log"; }
if big_named; then pass "big answer: HAProxy's log names tune.bufsize"; else fail "big answer: HAProxy's log names tune.bufsize"; fi

if [ "$failures" -ne 0 ]; then
  echo "== $failures checks FAILED"
  for f in "$tmp"/*.log; do echo "--- $f"; tail -20 "$f"; done
  exit 1
fi
echo "== HAProxy against a daemon it cannot reach or whose answers are long: ok"
