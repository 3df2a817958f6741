-- rlsidecar.path: the `path` attribute of a request, from its target as it came on the
-- wire, normalized the way nginx's $uri is (merge_slashes on), so that a rule on /login
-- limits /log%69n, //login and /a/../login alike, whichever gateway asks. The rule and
-- its cases are in clients/testdata/paths.json (test/unit.lua checks every one):
--
--   - the query and the fragment are dropped (from the first "?" or "#");
--   - every valid %XX is decoded, once: a decoded byte is never decoded again, and a
--     decoded "/" or "." counts as one; an invalid escape stays as it is;
--   - runs of "/" are merged into one;
--   - "." and ".." segments are removed, a ".." at the root staying at the root;
--   - the result always starts with "/" (and ends with "/" when the target did, or when
--     its last segment was "." or "..").
--
-- A target in absolute form (http://host/path, as a proxy sends it) is taken from the
-- path on, as nginx does.
--
-- The HAProxy client uses it on `txn.f:path()` (HAProxy's path is raw). The nginx client
-- sends $uri, which nginx has normalized by the same rule.
--
-- Pure functions on byte strings: Lua 5.1 - 5.4 and LuaJIT; safe to share.

local find, sub, char, concat = string.find, string.sub, string.char, table.concat
local gsub, tonumber = string.gsub, tonumber

local M = {}

local function unescape(hex)
  return char(tonumber(hex, 16))
end

-- clean returns path (bytes, decoded already) with runs of "/" merged and "." and ".."
-- segments removed, starting with "/". Nothing is decoded and nothing is cut: a "?" or a
-- "%2e" in path is a byte of a segment like any other.
function M.clean(path)
  local out, n = {}, 0
  local dir = false -- the last segment was "", "." or "..": the result ends with "/"
  local pos, len = 1, #path
  while true do
    local slash = find(path, "/", pos, true)
    local seg = sub(path, pos, (slash or len + 1) - 1)
    if seg == "" or seg == "." then
      dir = true
    elseif seg == ".." then
      if n > 0 then
        out[n] = nil
        n = n - 1
      end
      dir = true
    else
      n = n + 1
      out[n] = seg
      dir = false
    end
    if not slash then break end
    pos = slash + 1
  end
  if n == 0 then
    return "/"
  end
  return "/" .. concat(out, "/") .. (dir and "/" or "")
end

-- normalize returns the `path` attribute of the request target raw (bytes as received:
-- "/caf%C3%A9?x=1" gives "/caf\195\169"). A target that is normalized already (the
-- common case) is returned as it is, without building a new string.
function M.normalize(raw)
  if sub(raw, 1, 1) == "/" and not find(raw, "[%%?#]") and not find(raw, "//", 1, true)
      and not find(raw, "/.", 1, true) then
    return raw
  end
  local s = raw
  local _, scheme_end = find(s, "^%a[%w+.-]*://")
  if scheme_end then -- absolute form: the path starts after the authority
    local p = find(s, "[/?#]", scheme_end + 1)
    s = p and sub(s, p) or ""
  end
  local q = find(s, "[?#]")
  if q then
    s = sub(s, 1, q - 1)
  end
  s = gsub(s, "%%(%x%x)", unescape)
  return M.clean(s)
end

return M
