'use strict';
// A request whose frame would be over maxFrame is not sent: check() rejects with a
// RequestTooLargeError whose decision rejects (431), whatever onUnavailable, and the
// middleware answers 431.

const test = require('node:test');
const assert = require('node:assert/strict');
const http = require('http');
const net = require('net');
const fs = require('fs');
const os = require('os');
const path = require('path');

const rl = require('..');
const proto = require('../lib/proto');
const { MAX_PENDING } = require('../lib/client');
const { startDaemon } = require('./helpers');

// The body the Go client writes (clients/go/http.go, tooLargeBody).
const BODY_431 = '{"type":"about:blank","title":"Request Header Fields Too Large","status":431,'
  + '"detail":"This request\'s attributes (its path or header fields) are too large for the rate limiter to check."}';

function client(t, opts) {
  const c = new rl.Client(opts);
  t.after(() => c.close());
  return c;
}

test('frameBound is never below the encoded length', () => {
  let seed = 7;
  const rnd = (n) => {
    seed = (seed * 1103515245 + 12345) % 2147483648;
    return seed % n;
  };
  const pieces = ['', 'a', 'é', '€', '\u{1F600}', '\ud800', 'x'.repeat(31), 'y'.repeat(32), 'z'.repeat(255), 'w'.repeat(256)];
  const str = () => Array.from({ length: rnd(4) }, () => pieces[rnd(pieces.length)]).join('');
  const num = () => [0, 1, 127, 128, 255, 256, 65535, 65536, 2 ** 32 - 1, 2 ** 32, Number.MAX_SAFE_INTEGER, 2n ** 64n - 1n][rnd(12)];
  for (let i = 0; i < 500; i++) {
    const attrs = {};
    for (let j = rnd(20); j > 0; j--) attrs[str() + j] = rnd(5) === 0 ? Buffer.alloc(rnd(300)) : str();
    const limits = Array.from({ length: rnd(18) }, () => ({ key: str(), limit: num(), window_ms: num(), name: str() }));
    const msg = { id: 2 ** 32 + 1, op: 'check', attrs, limits, cost: num(), lease: str() };
    const n = proto.encode(msg).length - 4;
    assert.ok(proto.frameBound(msg) >= n, `frameBound ${proto.frameBound(msg)} < ${n}`);
  }
});

for (const policy of ['open', 'closed']) {
  test(`a check over maxFrame is not sent and rejects, ${policy}`, async (t) => {
    const d = await startDaemon(t);
    const c = client(t, { socket: d.socket, timeoutMs: 2000, conns: 1, onUnavailable: policy });
    assert.ok((await c.check({ user: 'a' })).allowed);
    const conn = c.slots[0].conn;
    const sent = conn.nextId;
    await assert.rejects(c.check({ user: 'a', ua: 'é'.repeat(40000) }), (e) => {
      assert.ok(e instanceof rl.RequestTooLargeError, String(e));
      assert.ok(e.size > 80000 && e.maxFrame === 65536, String(e.size));
      const x = e.decision;
      assert.ok(!x.allowed && x.tooLarge && !x.unreachable && !x.degraded && x.status === 431);
      const r = x.rejection();
      assert.equal(r.status, 431);
      assert.equal(r.body.toString(), BODY_431);
      assert.deepEqual(Object.keys(r.headers).sort(), ['Content-Length', 'Content-Type']);
      return true;
    });
    assert.equal(conn.nextId, sent); // nothing was sent
    await assert.rejects(c.release('l'.repeat(70000)), rl.RequestTooLargeError);
    assert.equal((await c.check({ user: 'a' })).remaining, 3);
  });
}

// At the limit, the id decides: a body of exactly maxFrame bytes is sent; the same request
// with a longer id is one byte over, and is not.
test('a body of exactly maxFrame', async (t) => {
  const d = await startDaemon(t);
  const max = 300;
  const c = client(t, { socket: d.socket, timeoutMs: 2000, conns: 1, maxFrame: max });
  const attrs = (n) => ({ user: 'u', v: 'x'.repeat(n) });
  let n = 0;
  while (proto.encode(proto.checkMessage(0, attrs(n), 1)).length - 4 < max) n++;
  assert.equal(proto.encode(proto.checkMessage(0, attrs(n), 1)).length - 4, max);
  assert.ok((await c.check(attrs(n))).allowed); // id 1
  await assert.rejects(c.check(attrs(n + 1)), (e) => e instanceof rl.RequestTooLargeError && e.size === max + 1);
  c.slots[0].conn.nextId = 127; // the next id, 128, takes 2 bytes
  await assert.rejects(c.check(attrs(n)), (e) => e instanceof rl.RequestTooLargeError && e.size === max + 1);
  assert.equal((await c.check(attrs(0))).remaining, 3);
});

// Refused at once even when every connection is full: it never waits for room, so it
// cannot reach onUnavailable by timing out.
test('a check over maxFrame does not wait for room', async (t) => {
  const d = await startDaemon(t);
  const c = client(t, { socket: d.socket, timeoutMs: 3000, conns: 1 });
  assert.ok((await c.check({ user: 'a' })).allowed);
  await d.pause();
  try {
    const held = Array.from({ length: MAX_PENDING }, () => c.check({ user: 'held' }));
    const t0 = Date.now();
    await assert.rejects(c.check({ v: 'x'.repeat(1 << 20) }), rl.RequestTooLargeError);
    assert.ok(Date.now() - t0 < 1000, `${Date.now() - t0} ms`);
    d.resume();
    await Promise.all(held);
  } finally {
    d.resume();
  }
});

// serve runs node:http (taking up to 1 MB of headers, as Go's net/http does) with mw in front
// of a handler that says ok; get sends a request line and headers as given.
async function serve(t, mw) {
  const srv = http.createServer({ maxHeaderSize: 1 << 20 }, (req, res) => mw(req, res, () => res.end('ok')));
  await new Promise((r) => srv.listen(0, '127.0.0.1', r));
  t.after(() => new Promise((r) => { srv.closeAllConnections(); srv.close(r); }));
  return (target, headers = '') => new Promise((resolve, reject) => {
    const s = net.connect(srv.address().port, '127.0.0.1');
    const chunks = [];
    s.on('data', (b) => chunks.push(b));
    s.on('error', reject);
    s.on('close', () => {
      const out = Buffer.concat(chunks).toString();
      resolve({ status: Number(out.split(' ')[1]), body: out.slice(out.indexOf('\r\n\r\n') + 4) });
    });
    s.write(`GET ${target} HTTP/1.1\r\nHost: example.com\r\n${headers}Connection: close\r\n\r\n`);
  });
}

test('the middleware answers 431 to attributes too large to check, under open', async (t) => {
  const d = await startDaemon(t);
  const c = client(t, { socket: d.socket, timeoutMs: 2000, onUnavailable: 'open' });
  const errors = [];
  const mws = [
    rl.middleware(c),
    rl.middleware(c, { onError: (e, req, res) => { errors.push(e); res.end('onError'); } }),
    rl.middleware(c, { attrs: (req) => ({ ...rl.defaultAttrs(req), user_agent: req.headers['user-agent'] || '' }) }),
  ];
  for (const [i, mw] of mws.entries()) {
    const get = await serve(t, mw);
    const r = i === 2 ? await get('/', `User-Agent: ${'b'.repeat(100000)}\r\n`) : await get('/' + 'a'.repeat(70000));
    assert.equal(r.status, 431, `middleware ${i}`);
    assert.equal(r.body, BODY_431);
    assert.equal((await get('/short')).status, 200);
  }
  assert.deepEqual(errors, []);
});

test('the sidecar\'s frame_too_large gets a 431 from the middleware too', async (t) => {
  const d = await startDaemon(t);
  const c = client(t, { socket: d.socket, timeoutMs: 2000, onUnavailable: 'open', maxFrame: 1 << 20 });
  const get = await serve(t, rl.middleware(c));
  assert.equal((await get('/' + 'a'.repeat(70000))).status, 431);
});

// The daemon answers frame_too_large from a frame's header and closes while the client is
// still writing the rest: the write then fails (EPIPE), but the answer is already in the
// receive queue, and the check gets it (431), not the policy. A server that does just
// that, so that the write always fails (against the daemon it is a race).
test('refused while still writing: the 431, not the policy', async (t) => {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'rls'));
  t.after(() => fs.rmSync(dir, { recursive: true, force: true }));
  const sock = path.join(dir, 'refuse.sock');
  const srv = net.createServer((c) => {
    c.once('readable', () => {
      c.read(4); // the header only
      c.end(proto.encode({ id: 0, error: { code: 'frame_too_large', message: 'a frame of 4000000 bytes is over 65536' } }));
      c.destroy(); // with the rest unread, as the daemon closes
    });
  });
  await new Promise((r) => srv.listen(sock, r));
  t.after(() => new Promise((r) => srv.close(r)));
  const c = client(t, { socket: sock, timeoutMs: 5000, conns: 1, maxFrame: 1 << 22, onUnavailable: 'open' });
  for (let i = 0; i < 5; i++) {
    await assert.rejects(c.check({ user: 'may', ua: 'x'.repeat(4000000) }), (e) => {
      assert.ok(e instanceof rl.ProtocolError && e.code === 'frame_too_large', String(e));
      assert.ok(!e.decision.allowed && e.decision.status === 431);
      return true;
    });
  }
});

// Against the real daemon, a client whose maxFrame is above the daemon's --max-frame: a
// 4 MB request is refused from its header while the client still writes it. libuv may
// report the failed write (EPIPE) before reading the answer; the client reads it then
// (Conn.readLeft), so every such check gets the 431: before, about 7 in 100 got the
// policy ("connection lost: write EPIPE").
test('refused by the daemon while still writing: the 431 every time', async (t) => {
  const d = await startDaemon(t);
  const c = client(t, { socket: d.socket, timeoutMs: 5000, conns: 1, maxFrame: 1 << 23, onUnavailable: 'open' });
  const big = 'x'.repeat(4000000);
  const got = {};
  for (let i = 0; i < 100; i++) {
    let k;
    try {
      const x = await c.check({ user: 'may', ua: big });
      k = `decision: ${x.cause}`;
    } catch (e) {
      k = e instanceof rl.ProtocolError && e.decision.status === 431 ? '431' : String(e);
    }
    got[k] = (got[k] || 0) + 1;
  }
  assert.deepEqual(got, { 431: 100 });
  assert.equal((await c.check({ user: 'may' })).remaining, 4);
});

// A value longer than the daemon's --max-attr-len (set below what the gateway lets
// through) is answered attr_too_large, on a connection that stays usable, and the
// middleware answers 431 under 'open': it answered bad_request, which onUnavailable
// decided, and every such request passed every limit.
test('the sidecar\'s attr_too_large gets a 431 from the middleware under open', async (t) => {
  const d = await startDaemon(t, undefined, ['--max-attr-len', '100']);
  const c = client(t, { socket: d.socket, timeoutMs: 2000, onUnavailable: 'open', conns: 1 });
  await assert.rejects(c.check({ user: 'u'.repeat(300) }), (e) => {
    assert.ok(e instanceof rl.ProtocolError && e.code === 'attr_too_large', String(e));
    assert.ok(!e.decision.allowed && e.decision.tooLarge && e.decision.status === 431);
    return true;
  });
  assert.ok((await c.check({ user: 'ivy' })).allowed);
  const get = await serve(t, rl.middleware(c));
  for (let i = 0; i < 6; i++) assert.equal((await get('/' + 'a'.repeat(300))).status, 431);
});

// The daemon answers frame_too_large from a frame's header and reads nothing more of the
// connection: the checks pipelined after that frame on it were not read, not decided, and
// go again on a new connection. Before, each got the policy (40 503s here, under
// 'closed': one oversized request among concurrent ones refused the others).
test('checks pipelined after a frame the sidecar refused as too large are sent again', async (t) => {
  const d = await startDaemon(t, undefined, ['--max-frame', '1024']);
  const c = client(t, { socket: d.socket, timeoutMs: 5000, onUnavailable: 'closed', conns: 1, logger: null });
  await c.check({ user: 'warm' }); // the connection, dialed
  const small = (i) => c.check({ user: `u${i}` });
  const ps = [];
  for (let i = 0; i < 10; i++) ps.push(small(i));
  const big = c.check({ user: 'big', path: '/' + 'x'.repeat(2000) });
  for (let i = 10; i < 50; i++) ps.push(small(i));
  await assert.rejects(big, (e) => e instanceof rl.ProtocolError && e.code === 'frame_too_large' && e.decision.status === 431);
  const ds = await Promise.all(ps);
  ds.forEach((x, i) => {
    assert.ok(!x.unreachable, `check ${i}: ${x.cause}`);
    assert.equal(x.remaining, 4, `u${i} counted once`);
  });
});
