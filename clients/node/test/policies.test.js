'use strict';
// The policy fields (warning, delayMs, banned) from the real daemon, and the middleware
// holding a delayed request.

const test = require('node:test');
const assert = require('node:assert/strict');
const http = require('http');

const rl = require('..');
const { startDaemon, inOneWindow } = require('./helpers');

const RULES = `
rules:
  - name: quota
    match: { path: /quota }
    key: ip
    algorithm: fixed_window
    limit: { requests: 10, per: 1h }
    warn_at: 0.8
  - name: queue
    match: { path: /queue }
    key: ip
    limit: { requests: 1, per: 300ms }
    delay: 1s
  - name: login
    match: { path: /login }
    key: ip
    limit: { requests: 1, per: 1m }
    penalty: { after: 2, within: 1m, ban: 10m }
`;

test('warning, delayMs and banned from the daemon', async (t) => {
  const d = await startDaemon(t, RULES);
  const c = new rl.Client({ socket: d.socket, timeoutMs: 2000 });
  t.after(() => c.close());
  const warnings = await inOneWindow(3600000, async (n) => { // quota is a fixed window of 1 h
    const got = [];
    for (let i = 0; i < 10; i++) got.push((await c.check({ path: '/quota', ip: `q${n}` })).warning);
    return got;
  });
  assert.deepEqual(warnings, [false, false, false, false, false, false, false, true, true, true]);
  let sent = Date.now();
  const first = await c.check({ path: '/queue', ip: 'a' });
  const second = await c.check({ path: '/queue', ip: 'a' });
  let gap = Date.now() - sent;
  assert.equal(first.delayMs, 0);
  // The second waits for the unit the first took (1 per 300 ms): 300 ms less the time
  // between the two decisions, which is at most gap (Date.now() counts whole ms: 2 ms for
  // that and rounding). It was delayMs >= 250: a gap over 50 ms on a loaded machine
  // failed the test.
  assert.ok(second.allowed && second.delayMs >= Math.max(0, 300 - gap) - 2 && second.delayMs <= 300,
    `delayMs ${second.delayMs}, ${gap} ms between the first check sent and the second answered`);
  assert.equal(second.rules[0].delayMs, second.delayMs);
  const res = [];
  sent = Date.now();
  for (let i = 0; i < 4; i++) res.push(await c.check({ path: '/login', ip: 'a' }));
  gap = Date.now() - sent;
  assert.deepEqual(res.map((r) => r.banned), [false, false, true, true]);
  // The ban (10 min) began at the third decision: what is left of it at the fourth.
  assert.ok(res[3].retryAfterMs >= 600000 - gap - 2 && res[3].retryAfterMs <= 600000 && res[3].rules[0].banned,
    `retryAfterMs ${res[3].retryAfterMs}, ${gap} ms for the four checks`);
});

test('the middleware waits a delay before calling next', async (t) => {
  const d = await startDaemon(t, RULES);
  const c = new rl.Client({ socket: d.socket, timeoutMs: 2000 });
  t.after(() => c.close());
  const mw = rl.middleware(c);
  const srv = http.createServer((req, res) => mw(req, res, () => res.end('hello')));
  await new Promise((r) => srv.listen(0, '127.0.0.1', r));
  t.after(() => new Promise((r) => { srv.closeAllConnections(); srv.close(r); }));
  const url = `http://127.0.0.1:${srv.address().port}/queue`;
  // Timed from before the first request: the second is held until 300 ms after the first
  // was decided. Timed from the second alone (>= 250 ms), the first request's own time
  // after its check, over 50 ms on a loaded machine, shortened the hold.
  const start = Date.now();
  assert.equal((await fetch(url)).status, 200);
  const r = await fetch(url);
  assert.equal(r.status, 200);
  assert.equal(await r.text(), 'hello');
  assert.ok(Date.now() - start >= 290, `both answered ${Date.now() - start} ms after the first was sent`);
});
