'use strict';
// The ip attribute: peerIP against every case of clients/testdata/ips.json, and, end to
// end, an IPv4 client of a server on Node's default (dual-stack) listen() counted under
// its IPv4 address by the real daemon, as the Go client and nginx count it.

const test = require('node:test');
const assert = require('node:assert/strict');
const fs = require('fs');
const http = require('http');
const path = require('path');

const rl = require('..');
const { ROOT, startDaemon } = require('./helpers');

const SPEC = JSON.parse(fs.readFileSync(path.join(ROOT, 'clients', 'testdata', 'ips.json'), 'utf8'));

test('peerIP and defaultAttrs: every case of ips.json', () => {
  assert.ok(SPEC.cases.length >= 10);
  for (const c of SPEC.cases) {
    assert.equal(rl.peerIP(c.peer), c.ip, JSON.stringify(c.peer));
    const attrs = rl.defaultAttrs({ method: 'GET', url: '/', socket: { remoteAddress: c.peer } });
    if (c.peer === '') assert.ok(!('ip' in attrs), 'no peer address: ip left out, not ""');
    else assert.equal(attrs.ip, c.ip, JSON.stringify(c.peer));
  }
});

test('an IPv4 client of a dual-stack server is limited under its IPv4 address', async (t) => {
  // A rule that applies to 127.0.0.1 only, once a minute.
  const d = await startDaemon(t, `
rules:
  - name: loopback-v4
    match: { ip: 127.0.0.1 }
    key: ip
    limit: { requests: 1, per: 60s }
`);
  const c = new rl.Client({ socket: d.socket, timeoutMs: 2000 });
  t.after(() => c.close());
  const mw = rl.middleware(c);
  const srv = http.createServer((req, res) => mw(req, res, () => { res.end('ok'); }));
  await new Promise((resolve) => srv.listen(0, resolve)); // no host: '::', dual-stack
  t.after(() => new Promise((resolve) => srv.close(resolve)));
  if (srv.address().address !== '::') {
    t.skip(`listen() chose ${srv.address().address}, not a dual-stack '::' (no IPv6 here)`);
    return;
  }
  const get = () => new Promise((resolve, reject) => {
    http.get({ host: '127.0.0.1', port: srv.address().port, path: '/', agent: false }, (res) => {
      res.resume();
      res.on('end', () => resolve(res));
    }).on('error', reject);
  });
  const first = await get();
  assert.equal(first.statusCode, 200);
  assert.equal(first.headers['ratelimit'], '"loopback-v4";r=0;t=60');
  assert.equal((await get()).statusCode, 429);
});
