'use strict';
// A step of the gateway host's wall clock (NTP stepping it, a VM resumed) while the
// client runs: its waits are timed on the monotonic clock, so a step changes none of
// them. The steps here move Date.now alone, by an hour, as a step of the system clock
// moves it; the tests time themselves with performance.now().

const test = require('node:test');
const assert = require('node:assert/strict');
const net = require('net');
const path = require('path');

const rl = require('..');
const { RULES, startDaemon, tempDir } = require('./helpers');

const HOUR = 3600 * 1000;

// stepWallClock moves Date.now by ms from now on, until the test ends.
function stepWallClock(t, ms) {
  const real = Date.now;
  Date.now = () => real() + ms;
  t.after(() => { Date.now = real; });
}

// answeredWithin checks with c until the sidecar answers one, failing after ms.
async function answeredWithin(c, ms, what) {
  const start = performance.now();
  for (;;) {
    const x = await c.check({ user: 'a' });
    if (!x.unreachable) return x;
    const took = performance.now() - start;
    assert.ok(took < ms, `${Math.round(took)} ms and still unanswered (${x.cause}): ${what}`);
    await new Promise((r) => setTimeout(r, 10));
  }
}

// A slot that failed to dial backs off for 10 ms to 1 s. Before, the end of that wait was
// a Date.now time: a wall clock stepped back an hour after a failed dial (a daemon
// restarting) made every slot back off for the hour, and every check was decided by
// onUnavailable (closed: a 503 each) though the sidecar was back.
test('a failed dial backs off for its wait, not as long as the wall clock stepped back', async (t) => {
  const d = await startDaemon(t, RULES);
  await d.stop();
  const c = new rl.Client({ socket: d.socket, timeoutMs: 2000, onUnavailable: 'closed', conns: 2, logger: null });
  t.after(() => c.close());
  for (let i = 0; i < 2; i++) assert.ok((await c.check({ user: 'a' })).unreachable);
  assert.ok(c.slots.every((s) => s.failures >= 1), 'both slots failed to dial');
  stepWallClock(t, -HOUR);
  await d.start();
  const x = await answeredWithin(c, 5000, 'the slots back off for as long as the wall clock stepped back');
  assert.ok(x.allowed && !x.degraded, JSON.stringify(x));
});

// A connection that answers nothing for max(1 s, 4 × timeoutMs) while checks time out on
// it is given up and redialed. Before, its quiet spell was measured on Date.now: after a
// step back of an hour, a sidecar that stopped answering on it kept it for the hour.
test('a connection the sidecar stopped answering on is given up after a wall clock step back', async (t) => {
  const p = path.join(tempDir(t), 's.sock');
  const held = [];
  const frozen = net.createServer((s) => { held.push(s); s.on('data', () => {}); }); // reads, never answers
  await new Promise((r) => frozen.listen(p, r));
  t.after(() => { for (const s of held) s.destroy(); frozen.close(); });
  const c = new rl.Client({ socket: p, timeoutMs: 20, conns: 1, logger: null });
  t.after(() => c.close());
  assert.ok((await c.check({ user: 'a' })).unreachable); // dials, then times out
  stepWallClock(t, -HOUR);
  const d = await startDaemon(t, RULES);
  require('fs').renameSync(d.socket, p); // a successor takes the path
  c.timeoutMs = 200; // its answers, on a loaded machine
  await answeredWithin(c, 5000, 'the client keeps the frozen sidecar\'s connection');
});
