'use strict';
// The path attribute: normalizePath against every case of clients/testdata/paths.json,
// and the middleware sending it for targets as they come on the wire.

const test = require('node:test');
const assert = require('node:assert/strict');
const fs = require('fs');
const http = require('http');
const net = require('net');
const path = require('path');

const rl = require('..');
const { ROOT, standIn, startDaemon, tempDir } = require('./helpers');

const SPEC = JSON.parse(fs.readFileSync(path.join(ROOT, 'clients', 'testdata', 'paths.json'), 'utf8'));

// The spec's paths are bytes written as a JSON string, one code point (at most U+00FF) per byte.
function bytesOf(s) {
  for (const ch of s) assert.ok(ch.codePointAt(0) <= 0xff, `paths.json: ${JSON.stringify(s)} holds a code point that is no byte`);
  return Buffer.from(s, 'latin1');
}

// The bytes a path attribute stands for: a string's UTF-8, a Buffer's own.
function attrBytes(v) {
  return typeof v === 'string' ? Buffer.from(v, 'utf8') : Buffer.from(v);
}

test('normalizePath: every case of paths.json', () => {
  assert.ok(SPEC.cases.length >= 30);
  for (const c of SPEC.cases) {
    const got = rl.normalizePath(c.raw);
    const want = bytesOf(c.path);
    assert.ok(attrBytes(got).equals(want), `${JSON.stringify(c.raw)}: got ${attrBytes(got).toString('hex')}, want ${want.toString('hex')}`);
    // A string whenever the bytes are UTF-8, so that callers nearly always see one.
    const isUtf8 = Buffer.from(want.toString('utf8'), 'utf8').equals(want);
    assert.equal(typeof got === 'string', isUtf8, JSON.stringify(c.raw));
  }
});

test('normalizePath: absolute-form targets and look-alikes', () => {
  const cases = {
    'http://example.com/f%61st?next=/admin': '/fast',
    'HTTPS://example.com:8443//a/../fast#x': '/fast',
    'http://example.com': '/',
    'http://example.com?q=/fast': '/',
    'h2c+x.y-z://h/fast': '/fast',
    '*': '/*',
    'a:b/c': '/a:b/c',
    '/http://example.com/fast': '/http:/example.com/fast',
    '1http://example.com/fast': '/1http:/example.com/fast',
    '/café/./x': '/café/x', // beyond ASCII: its UTF-8 bytes
    '/plain/path': '/plain/path',
  };
  for (const [raw, want] of Object.entries(cases)) assert.equal(rl.normalizePath(raw), want, raw);
  assert.throws(() => rl.normalizePath(undefined), TypeError);
});

// recordingSidecar answers every check as allowed and keeps the bytes of its path attribute.
async function recordingSidecar(t) {
  const seen = [];
  const sock = await standIn(t, 'rec.sock', (req) => {
    seen.push(attrBytes(req.attrs.path));
    return { allowed: true, rule: '', limit: 0, remaining: 0, reset_ms: 0, retry_after_ms: 0, degraded: false, rules: [] };
  });
  return { sock, seen };
}

// serveRaw runs node:http with mw in front of a handler that says ok, and returns a function
// that sends a request line with the target exactly as given and resolves to the status.
async function serveRaw(t, mw) {
  const srv = http.createServer((req, res) => mw(req, res, () => res.end('ok')));
  await new Promise((r) => srv.listen(0, '127.0.0.1', r));
  t.after(() => new Promise((r) => { srv.closeAllConnections(); srv.close(r); }));
  return (target) => new Promise((resolve, reject) => {
    const s = net.connect(srv.address().port, '127.0.0.1');
    let out = '';
    s.on('data', (b) => { out += b; });
    s.on('error', reject);
    s.on('close', () => resolve(Number(out.split(' ')[1])));
    s.write(`GET ${target} HTTP/1.1\r\nHost: example.com\r\nConnection: close\r\n\r\n`);
  });
}

test('the middleware sends the normalized path of the target on the wire', async (t) => {
  const fake = await recordingSidecar(t);
  const c = new rl.Client({ socket: fake.sock, timeoutMs: 5000 });
  t.after(() => c.close());
  const get = await serveRaw(t, rl.middleware(c));
  const cases = [...SPEC.cases, { raw: 'http://example.com//f%61st/./?x', path: '/fast/' }];
  let sent = 0;
  for (const cs of cases) {
    const before = fake.seen.length;
    const status = await get(cs.raw);
    if (status === 400 && fake.seen.length === before) {
      t.diagnostic(`${JSON.stringify(cs.raw)}: node:http refuses it`);
      continue;
    }
    assert.equal(status, 200, JSON.stringify(cs.raw));
    assert.equal(fake.seen.length, before + 1);
    const got = fake.seen[before];
    const want = bytesOf(cs.path);
    assert.ok(got.equals(want), `${JSON.stringify(cs.raw)}: sent ${got.toString('hex')}, want ${want.toString('hex')}`);
    sent++;
  }
  assert.ok(sent >= 30, `only ${sent} targets reached the middleware`);
});

test('a rule on /fast limits every spelling of it', async (t) => {
  const d = await startDaemon(t, `
rules:
  - name: fast
    match: { path: /fast }
    key: ip
    limit: { requests: 1, per: 60s }
`);
  const c = new rl.Client({ socket: d.socket, timeoutMs: 5000 });
  t.after(() => c.close());
  const get = await serveRaw(t, rl.middleware(c));
  const got = [];
  for (const target of ['/fast', '/f%61st', '//fast', '/./fast', '/a/../fast', '/fast?x=1', '/%66ast#y']) got.push(await get(target));
  assert.deepEqual(got, [200, 429, 429, 429, 429, 429, 429]);
  assert.equal(await get('/other'), 200);
});

test('a path that is not UTF-8 reaches the daemon as its bytes', async (t) => {
  const d = await startDaemon(t);
  const c = new rl.Client({ socket: d.socket, timeoutMs: 5000 });
  t.after(() => c.close());
  const ff = rl.normalizePath('/%FF');
  assert.ok(Buffer.isBuffer(ff) && ff.equals(Buffer.from([0x2f, 0xff])));
  // The per-user rule keys on the value's bytes: 2F FF is one key, its lossy string another.
  assert.equal((await c.check({ user: ff })).remaining, 4);
  assert.equal((await c.check({ user: Buffer.from([0x2f, 0xff]) })).remaining, 3);
  assert.equal((await c.check({ user: '/\ufffd' })).remaining, 4);
});
