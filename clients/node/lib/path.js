'use strict';
// The path attribute every rlsidecar client sends (clients/testdata/paths.json holds the
// cases all of them are tested against), as the Go client's NormalizePath.

const SLASH = 0x2f;
const DOT = 0x2e;
const PERCENT = 0x25;
// An absolute-form request target (a proxy request): a scheme, then "://".
const ABSOLUTE = /^[A-Za-z][A-Za-z0-9+.-]*:\/\//;
// A target that normalizes to itself: ASCII, starting with '/', without '%', '?', '#', '//'
// or a segment starting with '.'.
const NEEDS_WORK = /[^\x00-\x7f]|[%?#]|\/\/|\/\.|^[^/]|^$/;
const utf8 = new TextDecoder('utf-8', { fatal: true, ignoreBOM: true });

function hexValue(c) {
  if (c >= 0x30 && c <= 0x39) return c - 0x30;
  if (c >= 0x41 && c <= 0x46) return c - 0x41 + 10;
  if (c >= 0x61 && c <= 0x66) return c - 0x61 + 10;
  return -1;
}

/**
 * Returns the path attribute of a request whose target (as it came on the wire: req.url)
 * is target, so that a rule limits the same requests whichever gateway asks. As nginx's
 * $uri with merge_slashes on: an absolute-form target (`http://host/a?q`) counts from its
 * path; the query (from the first '?') and fragment (from the first '#') are dropped; every
 * valid %XX escape is decoded once (a decoded byte is never decoded again: /a%2541 is
 * /a%41; a decoded '/' or '.' counts as one: /a%2Fb is /a/b; an invalid escape stays);
 * runs of '/' are merged; '.' and '..' segments are removed, a '..' at the root staying
 * there (/a/../b and /../b are /b); a trailing '/' stays; the result starts with '/'. So
 * /log%69n, //login and /a/../login are all /login.
 *
 * The result is a string when its bytes are UTF-8 (nearly always), else a Buffer of them
 * (/%FF is the bytes 2F FF, which no string holds); Client.check sends either as those
 * bytes. Characters beyond ASCII in target count as their UTF-8 bytes.
 */
function normalizePath(target) {
  if (typeof target !== 'string') throw new TypeError(`target must be a string, not ${typeof target}`);
  if (!NEEDS_WORK.test(target)) return target;
  const abs = ABSOLUTE.exec(target);
  if (abs !== null) {
    const rest = target.slice(abs[0].length);
    const j = rest.search(/[/?#]/);
    target = j < 0 ? '' : rest.slice(j);
  }
  const q = target.search(/[?#]/);
  if (q >= 0) target = target.slice(0, q);
  const src = Buffer.from(target, 'utf8');
  // Decode into b, after a '/' when the target has none of its own.
  const b = Buffer.alloc(src.length + 1);
  let n = 0;
  if (src[0] !== SLASH) b[n++] = SLASH;
  for (let i = 0; i < src.length; i++) {
    let c = src[i];
    if (c === PERCENT && i + 2 < src.length) {
      const hi = hexValue(src[i + 1]);
      const lo = hexValue(src[i + 2]);
      if (hi >= 0 && lo >= 0) {
        c = hi * 16 + lo;
        i += 2;
      }
    }
    b[n++] = c;
  }
  // Walk the segments after the leading '/', writing the result over b: it never gets
  // ahead of the segment being read. The result ends with '/' before every segment.
  let out = 1;
  for (let i = 1; i <= n;) {
    let j = i;
    while (j < n && b[j] !== SLASH) j++;
    const len = j - i;
    if (len === 0 || (len === 1 && b[i] === DOT)) {
      // an empty segment (merged slashes, or a trailing '/') or '.': nothing
    } else if (len === 2 && b[i] === DOT && b[i + 1] === DOT) {
      if (out > 1) out = b.lastIndexOf(SLASH, out - 2) + 1; // drop the last segment; at the root, stay
    } else {
      b.copy(b, out, i, j);
      out += len;
      if (j < n) b[out++] = SLASH;
    }
    i = j + 1;
  }
  const bytes = b.subarray(0, out);
  try {
    return utf8.decode(bytes);
  } catch {
    return bytes;
  }
}

module.exports = { normalizePath };
