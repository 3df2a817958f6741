'use strict';
// Connect/Express-style middleware: check every request, answer 429/503 or pass it on with
// the rate-limit headers, as the Go client's Middleware does.

const { ProtocolError, ClosedError } = require('./proto');
const { Decision } = require('./decision');
const { normalizePath } = require('./path');

const MAPPED = /^::ffff:((?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)(?:\.(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)){3})$/i;

/**
 * The ip attribute every rlsidecar client sends for a peer address (without a port): the
 * address itself, except that an IPv4-mapped IPv6 address ('::ffff:' before a dotted
 * quad) is sent as the IPv4 address it maps. A server's default listen() is dual-stack,
 * and there an IPv4 client's remoteAddress is '::ffff:203.0.113.7', which the Go client and
 * nginx send as '203.0.113.7': one form, one key per client whichever gateway asks
 * (clients/testdata/ips.json).
 */
function peerIP(addr) {
  const m = MAPPED.exec(addr);
  return m ? m[1] : addr;
}

/**
 * The default attributes: ip (the peer's address, as peerIP gives it), method, and path: normalizePath of the
 * request target (req.originalUrl, which Express keeps whole under a mount point, else
 * req.url), so that /f%61st, //fast and /a/../fast are all /fast, as every rlsidecar
 * client sends them.
 */
function defaultAttrs(req) {
  return {
    ip: peerIP((req.socket && req.socket.remoteAddress) || ''),
    method: req.method || '',
    path: normalizePath(req.originalUrl || req.url || ''),
  };
}

/**
 * Returns (req, res, next) middleware that checks every request with client:
 * allowed → rate-limit headers set, next(), and a concurrency lease released when the
 * response ends (res.end() takes effect once the release is answered) or closes;
 * rejected by a rule → 429 with Retry-After and a problem+json body; no answer → the client's onUnavailable ('open': next() without
 * headers, 'closed': 503 with Retry-After: 1). A ProtocolError (attrs or cost the sidecar
 * refuses) and a closed client follow onUnavailable too, unless onError is given. A request
 * too large to check (RequestTooLargeError, or the sidecar's frame_too_large) gets a 431,
 * whatever onUnavailable and onError.
 */
function middleware(client, { attrs = defaultAttrs, cost, onError } = {}) {
  return function rlsidecarMiddleware(req, res, next) {
    let p;
    try {
      p = client.check(attrs(req), { cost: cost ? cost(req) : 1 });
    } catch (e) {
      return next(e);
    }
    p.then((d) => {
      if (!d.allowed) {
        const r = d.rejection();
        res.statusCode = r.status;
        for (const k in r.headers) res.setHeader(k, r.headers[k]);
        res.end(r.body);
        return;
      }
      const h = d.headers();
      for (const k in h) res.setHeader(k, h[k]);
      if (d.lease && typeof res.once === 'function') {
        // The request is over when the response ends or its connection closes. The
        // response's end waits for the release's answer (at most timeoutMs), as the Go
        // middleware's handler returns only after its release: a client that has the
        // whole response and asks again at once finds the slot free.
        let released = null;
        const release = () => {
          if (released === null) released = client.release(d.lease).catch(() => {}); // else it expires
          return released;
        };
        const end = res.end;
        if (typeof end === 'function') {
          let ending = null;
          res.end = function endAfterRelease(...args) {
            if (ending === null) {
              ending = release().then(() => {
                res.end = end;
                end.apply(res, args);
              });
            }
            return res;
          };
        }
        res.once('finish', release);
        res.once('close', release);
      }
      if (d.delayMs > 0) {
        // A rule's delay: its tokens are reserved; the request waits, unless the client
        // goes away first.
        const timer = setTimeout(next, d.delayMs);
        res.once('close', () => clearTimeout(timer)); // before next ran: the client went away
        return;
      }
      next();
    }, (e) => {
      if (e && e.decision && e.decision.tooLarge) {
        // Attributes too large to check (a long path or header): 431, whatever the policy.
        const r = e.decision.rejection();
        res.statusCode = r.status;
        for (const k in r.headers) res.setHeader(k, r.headers[k]);
        res.end(r.body);
        return;
      }
      if ((e instanceof ProtocolError || e instanceof ClosedError) && !onError) {
        const d = e instanceof ProtocolError ? e.decision
          : new Decision({ allowed: client.onUnavailable === 'open', degraded: true, cause: 'client closed' });
        if (d.allowed) return next();
        const r = d.rejection();
        res.statusCode = r.status;
        for (const k in r.headers) res.setHeader(k, r.headers[k]);
        res.end(r.body);
        return;
      }
      if (onError) return onError(e, req, res, next);
      next(e);
    });
  };
}

module.exports = { middleware, defaultAttrs, peerIP };
