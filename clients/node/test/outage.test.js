'use strict';
// The outage log: a sidecar that gives no answer (a wrong socket path, a socket the
// gateway may not open, a stopped daemon) is logged, not silently failed open.

const test = require('node:test');
const assert = require('node:assert/strict');
const path = require('path');

const rl = require('..');
const { OUTAGE_LOG_INTERVAL } = require('../lib/client');
const { RULES, startDaemon, tempDir, waitFor } = require('./helpers');

function logged(t, opts) {
  const lines = [];
  const c = new rl.Client({ ...opts, logger: { warn: (m) => lines.push(m) } });
  t.after(() => c.close());
  let now = 1_700_000_000_000;
  c.outage.now = () => now;
  return { c, lines, tick: (ms) => { now += ms; } };
}

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

for (const policy of ['open', 'closed']) {
  test(`an unreachable sidecar is logged, rate limited, and its return too (${policy})`, async (t) => {
    const d = await startDaemon(t, RULES);
    await d.stop();
    // 2 s: the 20 checks after the restart must be answered, not timed out on a loaded
    // machine (the default, 50 ms); with the daemon stopped, they fail at once either way.
    const { c, lines, tick } = logged(t, { socket: d.socket, timeoutMs: 2000, onUnavailable: policy });
    for (let i = 0; i < 5; i++) assert.ok((await c.check({ user: 'a' })).unreachable);
    assert.equal(lines.length, 1, lines.join('\n'));
    const want = policy === 'open' ? 'requests pass without rate limiting' : 'requests are refused';
    assert.ok(lines[0].includes(`sidecar at ${d.socket} unreachable`) && lines[0].includes(want) &&
      lines[0].includes(`onUnavailable '${policy}'`) && lines[0].includes('(1 check decided by the policy'), lines[0]);

    tick(OUTAGE_LOG_INTERVAL - 1);
    await c.check({ user: 'a' });
    assert.equal(lines.length, 1, lines.join('\n'));
    tick(1);
    await c.check({ user: 'a' });
    assert.equal(lines.length, 2, lines.join('\n'));
    assert.ok(lines[1].includes('still unreachable') && lines[1].includes('(6 checks decided by the policy since the last line)'), lines[1]);

    await d.start();
    const deadline = Date.now() + 5000;
    while ((await c.check({ user: 'a' })).unreachable && Date.now() < deadline) {
      tick(1);
      await sleep(5);
    }
    assert.equal(lines.length, 3, lines.join('\n'));
    assert.ok(lines[2].includes(`sidecar at ${d.socket} answers again`), lines[2]);
    for (let i = 0; i < 20; i++) assert.ok(!(await c.check({ user: `u${i}` })).unreachable);
    assert.equal(lines.length, 3, lines.join('\n'));
  });
}

test('a sidecar that fails and answers by turns does not flood the log', async (t) => {
  const d = await startDaemon(t);
  const { c, lines, tick } = logged(t, { socket: d.socket, timeoutMs: 2000 });
  for (let i = 0; i < 100; i++) {
    tick(10);
    c.unreachable('no answer within the timeout'); // as a check that timed out
    tick(10);
    assert.ok(!(await c.check({ user: `u${i}` })).unreachable);
  }
  assert.equal(lines.length, 2, lines.join('\n')); // 2 s: one failure line, one recovery line
  tick(OUTAGE_LOG_INTERVAL);
  c.unreachable('no answer within the timeout');
  assert.equal(lines.length, 3, lines.join('\n'));
  assert.ok(lines[2].includes('(100 checks decided by the policy since the last line)'), lines[2]);
});

test('the outage log goes to console.warn by default; logger: null silences it', async (t) => {
  const got = [];
  const warn = console.warn;
  console.warn = (...a) => got.push(a.join(' '));
  try {
    const sock = path.join(tempDir(t), 'typo.sockk');
    const c = new rl.Client({ socket: sock });
    t.after(() => c.close());
    const mw = rl.middleware(c);
    let passed = 0;
    for (let i = 0; i < 3; i++) {
      // eslint-disable-next-line no-await-in-loop
      await new Promise((resolve) => mw({ method: 'GET', url: '/', socket: {} }, {}, () => { passed++; resolve(); }));
    }
    assert.equal(passed, 3);
    assert.equal(got.length, 1, got.join('\n'));
    assert.ok(got[0].includes(`sidecar at ${sock} unreachable; requests pass without rate limiting`), got[0]);

    const quiet = new rl.Client({ socket: sock, logger: null });
    t.after(() => quiet.close());
    assert.ok((await quiet.check({ user: 'a' })).unreachable);
    assert.equal(got.length, 1, got.join('\n'));
  } finally {
    console.warn = warn;
  }
  assert.throws(() => new rl.Client({ socket: '/x', logger: {} }), TypeError);
});

// A sidecar that stops answering on its connections (frozen; or an old one stopped while
// its successor took the socket, in a blue/green switch) loses them: a connection that
// answers nothing for max(1 s, 4 × timeoutMs) while checks time out on it is closed, and
// the next check redials, reaching whoever serves the socket now. Before, the client kept sending on the
// silent connections until the old process ended (systemd's watchdog: 30 s).
test('a connection the sidecar stopped answering on is given up and redialed', async (t) => {
  const { p, c } = await frozenSidecar(t);
  for (let i = 0; i < 2; i++) assert.ok((await c.check({ user: 'a' })).unreachable);
  await switchSidecar(t, c, p, 'connections');
});

// The same when the frozen sidecar's connections are full: a burst (or a load of more
// than MAX_PENDING checks within the stall time) fills each with checks it never answers,
// and every later check waits for room and times out there, never sent on one. Such a
// timeout is a check the connection left unanswered too: it counts toward the stall.
// Before, only a check that timed out on a connection counted, so a full connection was
// never given up: every check was decided by the policy until the old process ended.
test('a full connection the sidecar stopped answering on is given up and redialed', async (t) => {
  const { MAX_PENDING } = require('../lib/client');
  const { p, c } = await frozenSidecar(t);
  // The burst dials both connections and fills them, its checks waiting 60 s: none times
  // out before the switch, so none gives a connection up before it is full, however long
  // building it takes on a loaded machine. Before, they waited 2 s (a stall time of 8 s
  // from the dial), and building it took longer once: both connections were given up
  // before the burst was awaited (1 run of the suite in 6 under load); with 20 ms, 3 runs
  // of 4. Those still in flight on a connection kept end with the client (ClosedError).
  c.timeoutMs = 60000;
  const burst = Promise.allSettled(Array.from({ length: 2 * MAX_PENDING + 100 }, () => c.check({ user: 'a' })));
  await waitFor('both connections full', 30000, () => c.slots.every((s) => s.conn !== null && s.conn.inFlight() === MAX_PENDING));
  c.timeoutMs = 20; // from here every check waits for room, and times out there
  await switchSidecar(t, c, p, 'full connections');
  await c.close();
  await burst;
});

// frozenSidecar listens on a new socket path p as a sidecar that reads its checks and
// never answers, and returns p and a client c of it (timeoutMs 20, two connections).
async function frozenSidecar(t) {
  const net = require('net');
  const p = path.join(tempDir(t), 's.sock');
  const held = [];
  const frozen = net.createServer((s) => { held.push(s); s.on('data', () => {}); }); // reads, never answers
  await new Promise((r) => frozen.listen(p, r));
  t.after(() => { for (const s of held) s.destroy(); frozen.close(); });
  // Dials wait 10 s (not 100 ms, from the timeout): a loaded machine may take longer.
  const c = new rl.Client({ socket: p, timeoutMs: 20, connectTimeoutMs: 10000, conns: 2, logger: { warn() {} } });
  t.after(() => c.close());
  return { p, c };
}

// switchSidecar has a real daemon take the frozen sidecar's path p (a blue/green switch)
// and checks with c until it answers, failing when c still keeps the frozen sidecar's
// connections (what) 3 s after the switch.
async function switchSidecar(t, c, p, what) {
  const d = await startDaemon(t, RULES);
  require('fs').renameSync(d.socket, p); // the successor takes the path
  const switched = Date.now();
  for (;;) {
    const dec = await c.check({ user: 'a' });
    if (!dec.unreachable) return;
    const after = Date.now() - switched;
    assert.ok(after < 3000, `${after} ms after the switch still unanswered (${dec.cause}): the client keeps the frozen sidecar's ${what}`);
  }
}
