#!/usr/bin/env bash
# Runs test/unit.lua under both runtimes the Lua clients target: Lua 5.3 (HAProxy's) and
# nginx's LuaJIT (lua-nginx-module: nginx starts with no server, runs the tests in
# init_by_lua and exits with their result, so no port is needed; the nginx client's
# lua-mpack decoder is tested too). Exits non-zero when any check fails. Needs lua5.3, lua-cjson, lua-mpack, nginx and
# libnginx-mod-http-lua (scripts/test-gateways installs them).
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"   # clients/lua
repo="$(cd "$here/../.." && pwd)"

echo "-- lua5.3"
(cd "$here" && LUA_PATH="$here/?.lua;;" lua5.3 test/unit.lua "$repo")

echo "-- nginx (LuaJIT)"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/logs"
cat >"$tmp/nginx.conf" <<CONF
load_module /usr/lib/nginx/modules/ndk_http_module.so;
load_module /usr/lib/nginx/modules/ngx_http_lua_module.so;
error_log stderr notice;
pid $tmp/nginx.pid;
events {}
http {
  lua_package_path "$here/?.lua;;";
  init_by_lua_block {
    arg = { "$repo" }
    local ok, err = pcall(dofile, "$here/test/unit.lua")
    if not ok then io.stderr:write(tostring(err), "\\n") end
    os.exit(ok and 0 or 1)
  }
}
CONF
timeout 60 nginx -e stderr -p "$tmp" -c "$tmp/nginx.conf" -g 'daemon off; master_process off;'
