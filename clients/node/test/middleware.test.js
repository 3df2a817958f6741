'use strict';
// The Connect/Express-style middleware behind a real node:http server: the shared header
// table end to end (a fake sidecar sends each case's decision), and the real daemon.

const test = require('node:test');
const assert = require('node:assert/strict');
const fs = require('fs');
const http = require('http');
const path = require('path');

const rl = require('..');
const { ROOT, startDaemon, standIn, tempDir } = require('./helpers');

const CASES = JSON.parse(fs.readFileSync(path.join(ROOT, 'clients', 'testdata', 'http_headers.json'), 'utf8'));

// fakeSidecar answers a check of path /<case name> with that case's decision.
async function fakeSidecar(t) {
  const byName = Object.fromEntries(CASES.map((c) => [c.name, c]));
  return standIn(t, 'fake.sock', (req) => {
    const resp = { ...byName[req.attrs.path.slice(1)].decision, degraded: false };
    if (!resp.reason) delete resp.reason;
    return resp;
  });
}

// serve runs node:http with the middleware in front of a handler that says hello.
async function serve(t, mw) {
  const srv = http.createServer((req, res) => {
    mw(req, res, (err) => {
      if (err) {
        res.statusCode = 500;
        res.end(String(err));
        return;
      }
      res.setHeader('X-Next', '1');
      res.end('hello');
    });
  });
  await new Promise((r) => srv.listen(0, '127.0.0.1', r));
  t.after(() => new Promise((r) => { srv.closeAllConnections(); srv.close(r); }));
  const base = `http://127.0.0.1:${srv.address().port}`;
  return async (p, init) => {
    const r = await fetch(base + p, init);
    return { status: r.status, headers: r.headers, body: Buffer.from(await r.arrayBuffer()) };
  };
}

test('the header table through the middleware', async (t) => {
  const c = new rl.Client({ socket: await fakeSidecar(t), timeoutMs: 2000 });
  t.after(() => c.close());
  const get = await serve(t, rl.middleware(c));
  for (const cs of CASES) {
    const r = await get('/' + cs.name + '?q=1');
    assert.equal(r.status, cs.status, cs.name);
    const want = Object.fromEntries(Object.entries(cs.headers).map(([k, v]) => [k.toLowerCase(), v]));
    for (const k of ['ratelimit-policy', 'ratelimit', 'ratelimit-warning', 'retry-after']) assert.equal(r.headers.get(k), want[k] ?? null, `${cs.name} ${k}`);
    assert.equal(r.headers.get('x-next') === '1', cs.status === 200);
    if (cs.status === 429) {
      assert.equal(r.headers.get('content-type'), 'application/problem+json');
      const p = JSON.parse(r.body);
      assert.equal(p.status, 429);
      assert.equal(p.rule, cs.decision.rule || undefined);
      assert.equal(String(p.retry_after ?? ''), cs.headers['Retry-After'] ?? '');
    } else {
      assert.equal(r.body.toString(), 'hello');
    }
  }
});

const RULES_IP = `
rules:
  - name: per-ip
    match: { path: /api/** }
    key: [ip, method]
    limit: { requests: 2, per: 60s }
`;

test('the real daemon behind the middleware', async (t) => {
  const d = await startDaemon(t, RULES_IP);
  const c = new rl.Client({ socket: d.socket, timeoutMs: 2000 });
  t.after(() => c.close());
  const get = await serve(t, rl.middleware(c, { cost: () => 1 }));
  const rs = [];
  const sent = performance.now();
  for (let i = 0; i < 3; i++) {
    rs.push(await get('/api/x?q=1'));
    if (i === 0) await new Promise((r) => setTimeout(r, 10)); // so the retry is not whole seconds: rounding down would show
  }
  const gapMs = performance.now() - sent;
  assert.deepEqual(rs.map((r) => r.status), [200, 200, 429]);
  assert.equal(rs[0].headers.get('ratelimit'), '"per-ip";r=1;t=30');
  // The next token comes 30 s after the first request was decided, less the time until
  // the third's decision, at most gapMs: 30 s rounded up, or less when the requests took
  // more than a second (it was '30': a loaded machine failed the test). Never 0.
  const ra = Number(rs[2].headers.get('retry-after'));
  assert.ok(Number.isInteger(ra) && ra >= Math.ceil((30000 - gapMs - 1) / 1000) && ra <= 30, `Retry-After ${ra}, ${gapMs} ms`);
  assert.equal(rs[2].headers.get('ratelimit'), `"per-ip";r=0;t=${ra}`);
  assert.deepEqual([JSON.parse(rs[2].body).rule, JSON.parse(rs[2].body).retry_after], ['per-ip', ra]);
  assert.equal((await get('/api/x', { method: 'POST' })).status, 200); // the key is ip and method
  const other = await get('/other');
  assert.ok(other.status === 200 && other.headers.get('ratelimit') === null);
});

test('an attrs value of undefined or null leaves the attribute out (a request without that header)', async (t) => {
  const d = await startDaemon(t);
  const c = new rl.Client({ socket: d.socket, timeoutMs: 2000 });
  t.after(() => c.close());
  for (const absent of [undefined, null]) {
    const get = await serve(t, rl.middleware(c, {
      attrs: (req) => ({ ...rl.defaultAttrs(req), user: req.headers['x-user'] === undefined ? absent : req.headers['x-user'] }),
    }));
    const user = absent === undefined ? 'undef' : 'null';
    const rs = [];
    for (let i = 0; i < 6; i++) rs.push(await get('/api/x', { headers: { 'x-user': user } }));
    assert.deepEqual(rs.map((r) => r.status), [200, 200, 200, 200, 200, 429]);
    // Without the header: no user attribute, so the per-user rule does not apply; not a 500.
    for (let i = 0; i < 6; i++) {
      const r = await get('/api/x');
      assert.equal(r.status, 200, r.body.toString());
      assert.ok(r.body.toString() === 'hello' && r.headers.get('ratelimit') === null);
    }
  }
});

for (const [policy, want] of [['open', 200], ['closed', 503]]) {
  test(`unreachable sidecar, ${policy}`, async (t) => {
    const c = new rl.Client({ socket: path.join(tempDir(t), 'none.sock'), onUnavailable: policy });
    t.after(() => c.close());
    const r = await (await serve(t, rl.middleware(c)))('/api/x');
    assert.equal(r.status, want);
    if (want === 503) assert.ok(r.headers.get('retry-after') === '1' && JSON.parse(r.body).title === 'Service Unavailable');
    else assert.ok(r.body.toString() === 'hello' && r.headers.get('ratelimit') === null);
  });
}

test('a protocol error follows the policy, or onError', async (t) => {
  // A sidecar that answers every check bad_request (a bug in what the caller sent).
  const sock = await standIn(t, 'bad.sock', () => ({ error: { code: 'bad_request', message: 'cost must be an unsigned integer' } }));
  const c = new rl.Client({ socket: sock, timeoutMs: 2000, onUnavailable: 'closed' });
  t.after(() => c.close());
  assert.equal((await (await serve(t, rl.middleware(c)))('/')).status, 503);
  const seen = [];
  const mw = rl.middleware(c, {
    onError: (e, req, res) => { seen.push(e.code); res.statusCode = 400; res.end(); },
  });
  assert.equal((await (await serve(t, mw))('/')).status, 400);
  assert.deepEqual(seen, ['bad_request']);
});

test('too many attributes, or a name too long, is 431 whatever the policy', async (t) => {
  // Attributes taken from the HTTP client's headers: their number and names are its
  // choice. The daemon answered bad_request, which the policy decided: "open" let 100
  // headers past every limit.
  const d = await startDaemon(t);
  const many = Object.fromEntries(Array.from({ length: 100 }, (_, i) => [`a${i}`, 'v']));
  for (const attrs of [many, { ['n'.repeat(300)]: 'v' }]) {
    const c = new rl.Client({ socket: d.socket, timeoutMs: 2000, onUnavailable: 'open' });
    t.after(() => c.close());
    const seen = [];
    const mw = rl.middleware(c, { attrs: () => attrs, onError: (e, req, res) => { seen.push(e.code); res.end(); } });
    assert.equal((await (await serve(t, mw))('/')).status, 431);
    assert.deepEqual(seen, []);
  }
});

test('defaultAttrs', () => {
  assert.deepEqual(rl.defaultAttrs({ method: 'GET', url: '/a/b?x=1', socket: { remoteAddress: '::1' } }),
    { ip: '::1', method: 'GET', path: '/a/b' });
  assert.deepEqual(rl.defaultAttrs({ method: 'GET', url: '/b', originalUrl: '/mount/b?x', socket: {} }),
    { method: 'GET', path: '/mount/b' }); // no peer address: ip left out, not ""
});

for (const [policy, want] of [['open', 200], ['closed', 503]]) {
  test(`a closed client follows the policy, ${policy}`, async (t) => {
    const d = await startDaemon(t);
    const c = new rl.Client({ socket: d.socket, timeoutMs: 2000, onUnavailable: policy });
    await c.close();
    assert.equal((await (await serve(t, rl.middleware(c)))('/api/x')).status, want);
  });
}

// A header value reaches the daemon as the client sent its bytes, as through every other
// gateway: X-User: café (raw UTF-8 on the wire) through node:http and rl.header is the
// key of { user: 'café' }. req.headers['x-user'] sent other bytes ("cafÃ©": latin-1
// encoded again as UTF-8), another key (found by a client audit).
test('rl.header sends the bytes the client sent', async (t) => {
  const d = await startDaemon(t, 'rules:\n  - name: per-user\n    key: user\n    limit: { requests: 3, per: 60s }\n');
  const c = new rl.Client({ socket: d.socket, timeoutMs: 2000 });
  t.after(() => c.close());
  const mw = rl.middleware(c, { attrs: (req) => ({ user: rl.header(req, 'x-user') }) });
  const srv = http.createServer((req, res) => mw(req, res, () => res.end('hello')));
  await new Promise((r) => srv.listen(0, '127.0.0.1', r));
  t.after(() => new Promise((r) => { srv.closeAllConnections(); srv.close(r); }));
  const port = srv.address().port;
  const net = require('net');
  const status = await new Promise((resolve, reject) => {
    const s = net.connect(port, '127.0.0.1');
    let got = '';
    s.on('data', (b) => { got += b.toString('latin1'); });
    s.on('close', () => resolve(Number(got.split(' ')[1]) || got)); // Connection: close: the server ends it
    s.on('error', reject);
    s.write(Buffer.concat([Buffer.from('GET /x HTTP/1.1\r\nHost: h\r\nConnection: close\r\nX-User: '),
      Buffer.from('café', 'utf8'), Buffer.from('\r\n\r\n')]));
  });
  assert.equal(status, 200);
  assert.equal((await c.check({ user: 'café' }, { cost: 0 })).rules[0].remaining, 2, 'the header\'s bytes are the key of café');
  assert.equal(rl.header({ headers: {} }, 'x-user'), undefined);
  assert.equal(rl.header({ headers: { 'x-user': 'ann' } }, 'X-User'), 'ann');
  assert.deepEqual(rl.header({ headers: { 'x-key': '\xff' } }, 'x-key'), Buffer.from([0xff]));
});

test('a misspelled middleware option is refused, not ignored', () => {
  const client = new rl.Client({ socket: '/nonexistent.sock' });
  try {
    // renewLease (for renewLeases) used to leave renewal on without a word.
    for (const bad of ['renewLease', 'costFn', 'onUnavailable']) {
      assert.throws(() => rl.middleware(client, { [bad]: false }), new RegExp(`unknown middleware option "${bad}".*renewLeases`));
    }
    assert.equal(typeof rl.middleware(client, { attrs: rl.defaultAttrs, cost: () => 1, onError: () => {}, renewLeases: false }), 'function');
    assert.equal(typeof rl.middleware(client), 'function');
  } finally {
    client.close();
  }
});
