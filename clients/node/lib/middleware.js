'use strict';
// Connect/Express-style middleware: check every request, answer 429/503 or pass it on with
// the rate-limit headers, as the Go client's Middleware does.

const { ProtocolError, ClosedError } = require('./proto');
const { Decision } = require('./decision');
const { normalizePath } = require('./path');
const { STATUS_CODES } = require('http');
const { monoNow } = require('./client'); // the monotonic clock: a lease's renewals ignore wall clock steps

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
/**
 * header returns the value of request header name (e.g. 'x-user') for an attribute, or
 * undefined when the request has none: the bytes the client sent, as the Go and Lua
 * clients send a header. req.headers holds them read as latin-1, so a non-ASCII value
 * sent as it is (X-User: café) reaches the daemon as other bytes ("cafÃ©"), another key
 * than through any other gateway.
 */
function header(req, name) {
  const v = req.headers && req.headers[name.toLowerCase()];
  if (v === undefined || v === null) return undefined;
  const s = Array.isArray(v) ? v.join(', ') : String(v);
  if (/^[\x00-\x7f]*$/.test(s)) return s; // ASCII: the same bytes either way
  const b = Buffer.from(s, 'latin1');
  const u = b.toString('utf8');
  return Buffer.byteLength(u) === b.length && Buffer.from(u).equals(b) ? u : b; // a string when UTF-8, else the bytes (a msgpack bin)
}

function defaultAttrs(req) {
  const addr = req.socket && req.socket.remoteAddress;
  const path = normalizePath(req.originalUrl || req.url || '');
  // No peer address (the socket closed already): ip is left out, not sent as "" (every
  // such request would share one per-ip bucket).
  if (!addr) return { method: req.method || '', path };
  return { ip: peerIP(addr), method: req.method || '', path };
}

/**
 * Returns (req, res, next) middleware that checks every request with client:
 * allowed → rate-limit headers set, next(), and a concurrency lease released when the
 * response ends (res.end() takes effect once the release is answered) or closes;
 * rejected by a rule → 429 with Retry-After and a problem+json body; no answer → the client's onUnavailable ('open': next() without
 * headers, 'closed': 503 with Retry-After: 1). A ProtocolError (attrs or cost the sidecar
 * refuses) and a closed client follow onUnavailable too, unless onError is given. A request
 * too large to check (RequestTooLargeError, or the sidecar's frame_too_large) gets a 431,
 * whatever onUnavailable and onError. Until a lease is released the middleware renews it
 * (client.renew, each rule's own lease) at about half of what is left of it, so a request
 * that runs longer than its rule's lease (an upload, a stream) keeps its slot; the option
 * renewLeases: false turns that off.
 */
const MIDDLEWARE_OPTIONS = ['attrs', 'cost', 'onError', 'renewLeases'];

function middleware(client, opts = {}) {
  // A misspelled option (renewLease for renewLeases, costFn for cost) would leave its
  // default in force without a word, as the Client's options would: every option is named.
  for (const k of Object.keys(opts ?? {})) {
    if (!MIDDLEWARE_OPTIONS.includes(k)) throw new TypeError(`unknown middleware option ${JSON.stringify(k)} (options: ${MIDDLEWARE_OPTIONS.join(', ')})`);
  }
  const { attrs = defaultAttrs, cost, onError, renewLeases: renewLease = true } = opts ?? {};
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
      if (res.destroyed === true || res.closed === true) {
        // The client went away while its request was being checked: nothing is forwarded
        // for it (as when it goes during a delay), and a lease it took is released now —
        // its 'close' has passed, and a handler that never ends a closed response would
        // otherwise hold the slot, renewed, for good.
        if (d.lease) client.release(d.lease).catch(() => {});
        return;
      }
      const h = d.headers();
      for (const k in h) res.setHeader(k, h[k]);
      let started = false; // the handler runs (next was called)
      const run = () => {
        started = true;
        next();
      };
      if (d.lease && typeof res.once === 'function') {
        // The request is over when the response ends, or when its connection closes
        // before the handler started (during a delay). The response's end waits for the
        // release's answer (at most timeoutMs), as the Go middleware's handler returns
        // only after its release: a client that has the whole response and asks again
        // at once finds the slot free.
        let released = null;
        const renewal = renewLease ? keepLease(client, d.lease, firstRenewal(d), leaseLife(d)) : null;
        const release = () => {
          if (released === null) {
            if (renewal !== null) renewal.stop();
            released = client.release(d.lease).catch(() => {}); // else it expires
          }
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
        const destroy = res.destroy;
        if (typeof destroy === 'function') {
          // The handler destroys its response (res.destroy(), or a stream.pipeline into
          // it whose source failed): the request is over, as when it ends. Node does not
          // call destroy when the client goes away (that is 'close' alone, below), so a
          // handler still running keeps its slot. Before, the slot stayed held until the
          // lease ran out (30 s by default). The destroy takes effect once the release is
          // answered (at most timeoutMs later), as res.end() does: a client that retries
          // the moment its request fails finds the slot free.
          res.destroy = function destroyAfterRelease(...args) {
            res.destroy = destroy;
            if (!started) return destroy.apply(res, args);
            release().then(() => destroy.apply(res, args));
            return res;
          };
        }
        res.once('finish', release);
        res.once('close', () => {
          if (!started || res.writableFinished) {
            release();
            return;
          }
          // The client went away while the handler runs: the work goes on, and so does
          // the slot it holds, until the handler ends the response (res.end, above) —
          // released then, not now: a client that sends requests and hangs up at once
          // must not start more handlers than the rule's max. No more renewals: a
          // handler that never ends a closed response holds the slot until the lease
          // runs out, not for good.
          if (renewal !== null) renewal.stop();
        });
      }
      if (d.delayMs > 0) {
        // A rule's delay: its tokens are reserved; the request waits, unless the client
        // goes away first.
        const timer = setTimeout(run, d.delayMs);
        res.once('close', () => clearTimeout(timer)); // before next ran: the client went away
        return;
      }
      run();
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

// The shortest wait between two renewals of a lease, in ms.
const MIN_RENEWAL = 10;

// firstRenewal is when the middleware first renews d's lease, in ms: half the shortest
// window among d's rules. A concurrency rule's entry has its lease as its window; a rate
// rule's may be shorter, which only brings the first renewal forward (its answer says
// when the lease expires, and the next renewal follows that).
function firstRenewal(d) {
  let w = 0;
  for (const r of d.rules) if (r.windowMs > 0 && (w === 0 || r.windowMs < w)) w = r.windowMs;
  return Math.max((w || 2000) / 2, MIN_RENEWAL);
}

// leaseLife is how long d's lease lasts unless renewed, in ms: the shortest window of its
// concurrency entries (a concurrency rule's window is its lease; a renewal of a lease one
// of whose slots ran out answers renewed: false). 0 when d flags none (an earlier daemon).
function leaseLife(d) {
  let w = 0;
  for (const r of d.rules) if (r.concurrency && r.windowMs > 0 && (w === 0 || r.windowMs < w)) w = r.windowMs;
  return w;
}

// keepLease renews lease with client, first after first ms, then at half of what each
// renewal answers is left of it, until stop() (the release follows it; a renewal under way
// then is answered renewed or not, harmlessly). It stops by itself when a renewal answers
// that the lease is gone, when the client is closed, and when the sidecar does not answer
// until the lease's last known expiry (retrying meanwhile at half of what is left of it).
// Its timer does not keep the process alive. life is the lease's duration (leaseLife), its
// expiry until a renewal answers; 0: 2 × first. Before, that first expiry was always
// 2 × first, the shortest window of all the rules: a rate rule of 10 per second beside a
// lease of a minute made it one second, and a sidecar that did not answer the renewals of
// that second (stalled, restarting) ended them for good, the lease left to expire under
// a request still running.
function keepLease(client, lease, first, life = 0) {
  let timer = null;
  let stopped = false;
  let expires = monoNow() + (life > 0 ? life : 2 * first);
  const schedule = (ms) => {
    timer = setTimeout(renew, Math.max(ms, MIN_RENEWAL));
    if (typeof timer.unref === 'function') timer.unref();
  };
  const renew = () => {
    timer = null;
    client.renew(lease, 0).then(({ renewed, expiresMs }) => {
      if (stopped || !renewed) return;
      expires = monoNow() + expiresMs;
      schedule(expiresMs / 2);
    }, (e) => {
      // A closed client answers every renewal at once: retrying it down to every 10 ms
      // until the lease's expiry was work for nothing.
      if (e instanceof ClosedError) return;
      const left = expires - monoNow();
      if (!stopped && left > 0) schedule(left / 2);
    });
  };
  schedule(first);
  return {
    stop() {
      stopped = true;
      if (timer !== null) clearTimeout(timer);
      timer = null;
    },
  };
}

const UPGRADE_OPTIONS = ['attrs', 'cost', 'renewLeases'];

// rawResponse is an HTTP/1.1 response written on a socket taken over for an upgrade:
// status, headers, Connection: close, then body.
function rawResponse(status, headers, body) {
  let head = `HTTP/1.1 ${status} ${STATUS_CODES[status] || ''}\r\n`;
  for (const k in headers) head += `${k}: ${headers[k]}\r\n`;
  return Buffer.concat([Buffer.from(head + 'Connection: close\r\n\r\n', 'latin1'), body]);
}

function destroyOnError() {
  this.destroy();
}

function refuse(socket, r) {
  if (!socket.destroyed) socket.end(rawResponse(r.status, r.headers, r.body));
}

/**
 * Returns a listener for an http.Server's 'upgrade' event (a WebSocket handshake, which
 * Node hands to that event and never to the request handler, so the middleware never
 * sees it) that checks the request with client as the middleware checks a request, and
 * then calls handler(req, socket, head, decision) — e.g. ws's wss.handleUpgrade —
 * when it is allowed. Refused, it writes the 429 (503, 431) with Retry-After, the
 * rate-limit headers and the problem+json body on the socket and closes it; the handler
 * is not called. Allowed, decision.headers() are the rate-limit headers, for the handler
 * to add to its 101 (ws: its 'headers' event). A concurrency lease is held, and renewed,
 * for as long as the socket is open (the session), and released when it closes. A rule's
 * delay holds the handshake, unless the socket closes first. No answer from the sidecar,
 * a ProtocolError or a closed client: the client's onUnavailable ('open': the handler
 * is called, 'closed': 503). Until the handler is called, an error on the socket (the
 * client reset it) destroys it. Options: attrs (default defaultAttrs: the handshake is
 * a GET to its path), cost, renewLeases.
 */
function upgrade(client, handler, opts = {}) {
  for (const k of Object.keys(opts ?? {})) {
    if (!UPGRADE_OPTIONS.includes(k)) throw new TypeError(`unknown upgrade option ${JSON.stringify(k)} (options: ${UPGRADE_OPTIONS.join(', ')})`);
  }
  const { attrs = defaultAttrs, cost, renewLeases = true } = opts ?? {};
  return function rlsidecarUpgrade(req, socket, head) {
    // Node takes its own 'error' listener off a socket it hands to 'upgrade': a client
    // that reset its connection while its handshake was checked, held for a rule's delay
    // or refused was an unhandled 'error' event, which ended the process. Until the
    // handler has the socket (it listens itself: ws does), an error destroys it.
    socket.on('error', destroyOnError);
    const hand = (d) => {
      socket.off('error', destroyOnError);
      handler(req, socket, head, d);
    };
    let p;
    try {
      p = client.check(attrs(req), { cost: cost ? cost(req) : 1 });
    } catch (e) {
      p = Promise.reject(e);
    }
    p.then((d) => {
      if (!d.allowed) {
        refuse(socket, d.rejection());
        return;
      }
      if (socket.destroyed) {
        // Gone while its handshake was checked: nothing is forwarded, the lease released.
        if (d.lease) client.release(d.lease).catch(() => {});
        return;
      }
      let timer = null;
      if (d.lease) {
        const renewal = renewLeases ? keepLease(client, d.lease, firstRenewal(d), leaseLife(d)) : null;
        socket.once('close', () => {
          if (renewal !== null) renewal.stop();
          client.release(d.lease).catch(() => {}); // else it expires
        });
      }
      const run = () => hand(d);
      if (d.delayMs > 0) {
        timer = setTimeout(run, d.delayMs);
        socket.once('close', () => clearTimeout(timer));
        return;
      }
      run();
    }, (e) => {
      let d = null;
      if (e && e.decision) d = e.decision; // RequestTooLargeError: 431; another ProtocolError: the policy's
      else if (e instanceof ClosedError) d = new Decision({ allowed: client.onUnavailable === 'open', degraded: true, cause: 'client closed' });
      if (d === null) {
        // attrs or cost threw: an error of the application's, a 500 as Express gives one.
        refuse(socket, { status: 500, headers: { 'Content-Length': '0' }, body: Buffer.alloc(0) });
        return;
      }
      if (d.allowed) {
        if (!socket.destroyed) hand(d);
        return;
      }
      refuse(socket, d.rejection());
    });
  };
}

module.exports = { middleware, upgrade, defaultAttrs, peerIP, header };
