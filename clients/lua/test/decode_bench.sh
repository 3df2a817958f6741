#!/usr/bin/env bash
# CPU cost of the Lua client's pure functions inside nginx's LuaJIT (no I/O): encoding a
# check with four attributes, decoding the two-rule answer of proto/testdata/vectors.json
# with rlsidecar.codec and with Debian's lua-mpack, and building its headers. nginx starts
# with no server, runs the loops in init_by_lua and exits. µs per call (os.clock: CPU
# time), best of 5 runs of 20,000 calls each.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
repo="$(cd "$here/../.." && pwd)"
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
    local cjson = require "cjson"
    local codec = require "rlsidecar.codec"
    local http = require "rlsidecar.http"
    local resty = require "resty.rlsidecar"
    local f = assert(io.open("$repo/proto/testdata/vectors.json"))
    local vectors = cjson.decode(f:read("*a"))
    f:close()
    local hex
    for _, v in ipairs(vectors.responses) do
      if v.name == "check-allowed" then hex = v.hex end
    end
    local body = hex:gsub("..", function(x) return string.char(tonumber(x, 16)) end):sub(5)
    local N = 20000
    local function bench(name, fn)
      local best = math.huge
      for _ = 1, 5 do
        local c0 = os.clock()
        for i = 1, N do fn(i) end
        best = math.min(best, (os.clock() - c0) / N * 1e6)
      end
      io.stdout:write(string.format("  %-44s %6.2f µs\\n", name, best))
    end
    local ok, err = pcall(function()
      bench("encode a check (4 attributes)", function(i)
        codec.encode_request({ id = i, op = "check", attrs = { ip = "127.0.0.1", method = "GET", path = "/api/x", user = "u" .. i } })
      end)
      bench("decode a 2-rule answer: rlsidecar.codec", function() codec.decode_body(body) end)
      if resty.mpack_decode_body then
        bench("decode a 2-rule answer: lua-mpack", function() resty.mpack_decode_body(body) end)
      end
      local d = codec.decode_body(body)
      bench("RateLimit-Policy and RateLimit for it", function() http.headers(d) end)
    end)
    if not ok then io.stderr:write(tostring(err), "\\n") end
    io.stdout:flush()
    os.exit(ok and 0 or 1)
  }
}
CONF
echo "nginx LuaJIT, CPU per call:"
timeout 120 nginx -e stderr -p "$tmp" -c "$tmp/nginx.conf" -g 'daemon off; master_process off;'
