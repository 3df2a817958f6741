# harness.sh: what the end-to-end scripts under clients/lua/test share, sourced after
# `here`, `repo` and `keep_var` are set (keep_var: the environment variable that, set,
# keeps the temporary directory; its name also prefixes the note saying so). Gives $tmp (a
# temp dir), pids (the processes to stop on exit, with cleanup trapped on EXIT), failures
# and pass/fail/expect/expect_re to count them, daemon_bin, free_port and wait_for.
tmp=$(mktemp -d)
pids=()
cleanup() {
  local p
  for p in "${pids[@]-}"; do
    [ -n "$p" ] && kill "$p" 2>/dev/null || true
  done
  for p in "${pids[@]-}"; do
    [ -n "$p" ] && wait "$p" 2>/dev/null || true
  done
  if [ -n "${!keep_var:-}" ]; then echo "$keep_var: kept $tmp" >&2; else rm -rf "$tmp"; fi
}
trap cleanup EXIT

failures=0
pass() { echo "  ok   $*"; }
fail() { echo "  FAIL $*"; failures=$((failures + 1)); }
expect() { # expect WHAT GOT WANT
  if [ "$2" == "$3" ]; then pass "$1"; else fail "$1: got [$2], want [$3]"; fi
}
expect_re() { # expect_re WHAT GOT REGEX
  if [[ "$2" =~ $3 ]]; then pass "$1"; else fail "$1: got [$2], want /$3/"; fi
}

# daemon_bin PATH: puts the daemon at PATH: a copy of $RLSIDECAR_BIN when set (scripts/test
# builds it once for all its scripts), else built from this checkout ($repo).
daemon_bin() {
  if [ -n "${RLSIDECAR_BIN:-}" ]; then
    cp "$RLSIDECAR_BIN" "$1"
  else
    (cd "$repo" && go build -o "$1" ./cmd/rlsidecar)
  fi
}

free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()'
}

wait_for() { # wait_for WHAT COMMAND...: up to 10 s
  local i
  for i in $(seq 100); do
    if "${@:2}" >/dev/null 2>&1; then return 0; fi
    sleep 0.1
  done
  echo "timed out waiting for $1" >&2
  for f in "$tmp"/*.log; do echo "--- $f" >&2; tail -20 "$f" >&2; done
  exit 1
}

# haproxy_cfg FILE PORT SOCKET [LINE...]: writes to FILE the config of a one-thread HAProxy
# listening on PORT that checks every request with the daemon at SOCKET (open policy,
# 2 s), each LINE added to its frontend, its backend the one at $backend_port.
haproxy_cfg() {
  local file=$1 port=$2 socket=$3 line
  shift 3
  {
    cat <<EOF
global
    nbthread 1
    lua-prepend-path $here/?.lua
    lua-load $here/haproxy/rlsidecar.lua
defaults
    mode http
    timeout connect 5s
    timeout client 30s
    timeout server 30s
frontend web
    bind 127.0.0.1:$port
    http-request lua.rlsidecar unix@$socket open 2000
EOF
    for line in "$@"; do echo "    $line"; done
    cat <<EOF
    default_backend app
backend app
    server s1 127.0.0.1:$backend_port
EOF
  } >"$file"
}
