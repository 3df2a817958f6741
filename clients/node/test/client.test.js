'use strict';
// The Client against the real daemon: decisions, pipelining on a small pool, and a sidecar
// that is missing, stalled or restarted.

const test = require('node:test');
const assert = require('node:assert/strict');
const path = require('path');

const rl = require('..');
const { startDaemon, tempDir, inOneWindow } = require('./helpers');

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

function client(t, opts) {
  const c = new rl.Client(opts);
  t.after(() => c.close());
  return c;
}

test('allows then rejects', async (t) => {
  const d = await startDaemon(t);
  const c = client(t, { socket: d.socket, timeoutMs: 2000 });
  const sent = performance.now();
  for (let i = 0; i < 5; i++) {
    const x = await c.check({ user: 'alice' });
    assert.deepEqual([x.allowed, x.rule, x.limit, x.remaining, x.degraded, x.unreachable], [true, 'per-user', 5, 4 - i, false, false]);
    if (i === 0) await sleep(10); // so the retry is not whole seconds: rounding down would show
  }
  const x = await c.check({ user: 'alice' });
  const gapMs = performance.now() - sent;
  assert.ok(!x.allowed && x.rule === 'per-user' && x.remaining === 0);
  // The next token comes 12 s after the first check, less the time between the first
  // decision and this one, which is at most gapMs (1 ms for rounding). It was
  // 11000 < retryAfterMs and Retry-After 12: checks spread over more than 1 s on a loaded
  // machine failed the test.
  assert.ok(x.retryAfterMs >= 12000 - gapMs - 1 && x.retryAfterMs <= 12000, `${x.retryAfterMs} ${gapMs}`);
  // Whole seconds, rounded up: 12 unless the checks took more than a second.
  const s = Math.ceil(x.retryAfterMs / 1000);
  const r = x.rejection();
  assert.equal(r.status, 429);
  assert.equal(r.headers['RateLimit-Policy'], '"per-user";q=5;w=60');
  assert.equal(r.headers.RateLimit, `"per-user";r=0;t=${s}`);
  assert.equal(r.headers['Retry-After'], String(s));
  assert.ok(r.body.toString().endsWith(`"rule":"per-user","retry_after":${s}}`));
  assert.equal((await c.check({ user: 'bob' }, { cost: 0 })).remaining, 5);
  assert.equal((await c.check({ user: 'bob' })).remaining, 4);
  assert.ok(await c.ping());
});

test('two rules and cost', async (t) => {
  const d = await startDaemon(t);
  const c = client(t, { socket: d.socket, timeoutMs: 2000 });
  let x = await c.check({ method: 'POST', path: '/login', ip: '198.51.100.1', user: 'carol' }, { cost: 2 });
  assert.ok(x.allowed && x.rule === 'login-per-ip' && x.remaining === 1);
  assert.deepEqual(x.rules.map((r) => r.name), ['per-user', 'login-per-ip']);
  assert.equal(x.headers().RateLimit, '"login-per-ip";r=1;t=40, "per-user";r=3;t=24');
  x = await c.check({ user: 'carol' }, { cost: 6 });
  assert.ok(!x.allowed && x.reason === rl.COST_EXCEEDS_CAPACITY && !('Retry-After' in x.headers()));
});

test('inline limits and error answers', async (t) => {
  const d = await startDaemon(t);
  const c = client(t, { socket: d.socket, timeoutMs: 2000 });
  const got = await inOneWindow(60000, async (n) => {
    const limits = [{ key: `tenant:acme${n}`, limit: 2, windowMs: 60000, algorithm: 'fixed_window', name: 'acme' }];
    const allowed = [];
    for (let i = 0; i < 3; i++) allowed.push((await c.check({}, { limits })).allowed);
    return allowed;
  });
  assert.deepEqual(got, [true, true, false]);
  await assert.rejects(c.check({}, { limits: [{ key: 'k', limit: 0, windowMs: 1000 }] }), (e) => {
    assert.ok(e instanceof rl.ProtocolError && e.code === 'invalid_limit' && e.sidecarMessage.includes('limit'));
    assert.ok(e.decision.allowed && e.decision.degraded && !e.decision.unreachable);
    return true;
  });
  assert.ok((await c.check({ user: 'dave' })).allowed);
});

test('bad input is refused before sending', async (t) => {
  const d = await startDaemon(t);
  const c = client(t, { socket: d.socket, timeoutMs: 2000 });
  const bad = [
    [{ user: 1 }, {}, TypeError],
    [{ user: 'x' }, { cost: -1 }, RangeError],
    [{ user: 'x' }, { cost: 1.5 }, RangeError],
    [{}, { limits: [{ key: 'k', limit: 1 }] }, RangeError],
    [{}, { limits: [{ key: 'k', limit: 1, windowMs: 1, colour: 'red' }] }, RangeError],
    [{}, { limits: ['k'] }, TypeError],
    [{}, { limits: [{ key: 'k', limit: 1, window_ms: 1000 }] }, RangeError], // the wire's name, not the client's
    [['user', 'x'], {}, TypeError],
    // A Map or a fetch Headers has no enumerable keys: it was sent as no attributes at
    // all, and no rule keyed on them applied (allowed, whatever the limits).
    [new Map([['user', 'x']]), {}, TypeError],
    [new Headers({ user: 'x' }), {}, TypeError],
  ];
  for (const [attrs, opts, E] of bad) await assert.rejects(c.check(attrs, opts), E);
  assert.equal((await c.check({ user: 'x' })).remaining, 4);
  for (const o of [{}, { socket: 's', timeoutMs: 0 }, { socket: 's', onUnavailable: 'maybe' }, { socket: 's', conns: 0 }, { socket: 's', maxFrame: 0 }, { socket: 's', maxFrame: 1.5 }]) {
    assert.throws(() => new rl.Client(o));
  }
  // A misspelled option is an error, not its default in force.
  assert.throws(() => new rl.Client({ socket: 's', timeout: 500 }), /unknown option "timeout"/);
  assert.throws(() => new rl.Client({ socket: 's', on_unavailable: 'closed' }), TypeError);
});

// A timer holds at most 2^31 - 1 ms: Node runs a longer one after 1 ms. A timeoutMs of
// 2^31 (a "no timeout" of 25 days) answered checks by the policy after 1 ms (13 of 50 in
// a scratch run against the daemon), and a connectTimeoutMs of Infinity, 2^31, NaN, -1 or
// '100' gave every dial 1 ms (enough only while the daemon accepts at once): each is
// refused, as the other options' wrong values are.
test('a timeout a timer cannot hold is refused, not run as 1 ms', () => {
  for (const k of ['timeoutMs', 'connectTimeoutMs']) {
    for (const v of [2 ** 31, Infinity, NaN, -1, 0, '100', null]) {
      assert.throws(() => new rl.Client({ socket: 's', [k]: v }), RangeError, `${k}: ${String(v)}`);
    }
    assert.equal(new rl.Client({ socket: 's', [k]: 2 ** 31 - 1 })[k], 2 ** 31 - 1);
  }
  assert.equal(new rl.Client({ socket: 's', timeoutMs: 20 }).connectTimeoutMs, 100);
});

test('an undefined or null attribute value is left out', async (t) => {
  const proto = require('../lib/proto');
  const frame = (attrs) => Buffer.from(proto.encode(proto.checkMessage(1, attrs, 1))).toString('hex');
  assert.equal(frame({ ip: '::1', user: undefined, path: '/a' }), frame({ ip: '::1', path: '/a' }));
  assert.equal(frame({ ip: '::1', user: null }), frame({ ip: '::1' }));
  assert.equal(frame({ user: null, x: undefined }), frame({}));
  const d = await startDaemon(t);
  const c = client(t, { socket: d.socket, timeoutMs: 2000 });
  for (let i = 0; i < 5; i++) assert.ok((await c.check({ user: 'ann', ip: undefined })).allowed);
  assert.ok(!(await c.check({ user: 'ann', ip: null })).allowed);
  const x = await c.check({ user: undefined });
  assert.ok(x.allowed && x.rule === '' && !x.degraded, JSON.stringify(x));
});

test('concurrent checks are pipelined on the pool, each counted once', async (t) => {
  const d = await startDaemon(t);
  const c = client(t, { socket: d.socket, timeoutMs: 5000, conns: 2 });
  const [ds, left] = await inOneWindow(3600000, async (n) => {
    const limits = [{ key: `shared${n}`, limit: 300, windowMs: 3600000, algorithm: 'fixed_window' }];
    const got = await Promise.all(Array.from({ length: 400 }, () => c.check({}, { limits })));
    return [got, (await c.check({}, { cost: 0, limits })).remaining];
  });
  assert.equal(ds.filter((x) => x.allowed).length, 300);
  assert.ok(ds.every((x) => !x.degraded));
  assert.equal(left, 0);
  // Two connections, both used: each carried many checks at once.
  assert.ok(c.slots.every((s) => s.conn !== null && s.conn.nextId >= 150), c.slots.map((s) => s.conn && s.conn.nextId).join());
});

for (const policy of ['open', 'closed']) {
  test(`missing socket, ${policy}`, async (t) => {
    const sock = path.join(tempDir(t), 'none.sock');
    const c = client(t, { socket: sock, onUnavailable: policy });
    let x = await c.check({ user: 'x' });
    assert.equal(x.allowed, policy === 'open');
    assert.ok(x.degraded && x.unreachable && x.cause.includes('none.sock'), x.cause);
    assert.equal(x.status, policy === 'open' ? 200 : 503);
    // Failed slots back off (10 ms doubling, with jitter): of 20 checks in a row, some answer
    // at once without dialing, however slow the machine.
    const causes = [];
    for (let i = 0; i < 20; i++) causes.push((await c.check({ user: 'x' })).cause);
    assert.ok(causes.some((cause) => cause.includes('backing off')), causes.join('\n'));
    assert.ok(c.slots.every((s) => s.failures >= 1 && s.failures < 20), c.slots.map((s) => s.failures).join());
    await assert.rejects(c.ping(), /unreachable/);
  });
}

test('a stalled sidecar times out; late answers are dropped', async (t) => {
  const d = await startDaemon(t);
  const c = client(t, { socket: d.socket, timeoutMs: 2000, onUnavailable: 'closed', conns: 1 });
  assert.equal((await c.check({ user: 'frank' })).remaining, 4);
  const conn = c.slots[0].conn;
  c.timeoutMs = 100; // for the stalled checks only: the answer after them is awaited 2 s
  await d.pause();
  let ds;
  const t0 = Date.now();
  try {
    ds = await Promise.all([1, 2, 3].map(() => c.check({ user: 'frank' })));
  } finally {
    d.resume();
  }
  c.timeoutMs = 2000;
  const took = Date.now() - t0;
  assert.ok(ds.every((x) => !x.allowed && x.unreachable && x.cause.includes('timeout')), JSON.stringify(ds));
  assert.ok(took >= 90 && took < 3000, String(took)); // bounded by the timeout: the stopped daemon never answers
  // The connection stays; the three late answers are dropped in order, and the next check
  // gets its own answer (the three consumed when the daemon woke).
  const x = await c.check({ user: 'frank' });
  assert.equal(c.slots[0].conn, conn);
  assert.ok(x.allowed && !x.degraded && x.remaining === 0, JSON.stringify(x));
});

test('a restarted sidecar', async (t) => {
  const d = await startDaemon(t);
  const c = client(t, { socket: d.socket, timeoutMs: 500 });
  assert.ok((await c.check({ user: 'gina' })).allowed);
  await d.stop();
  await sleep(20);
  let x = await c.check({ user: 'gina' });
  assert.ok(x.allowed && x.unreachable);
  await d.start();
  const deadline = Date.now() + 5000;
  for (;;) {
    x = await c.check({ user: 'gina' });
    if (!x.unreachable || Date.now() > deadline) break;
    await sleep(10);
  }
  assert.ok(!x.unreachable && x.remaining === 4, JSON.stringify(x));
});

test('close', async (t) => {
  const d = await startDaemon(t);
  const c = new rl.Client({ socket: d.socket, timeoutMs: 2000 });
  assert.ok((await c.check({ user: 'x' })).allowed);
  await c.close();
  await assert.rejects(c.check({ user: 'x' }), rl.ClosedError);
});

test('close during the dial', async (t) => {
  const d = await startDaemon(t);
  const c = new rl.Client({ socket: d.socket, timeoutMs: 2000 });
  const p = c.check({ user: 'x' }); // starts the dial
  await c.close();
  await assert.rejects(p, rl.ClosedError);
});

test('an idle client does not keep the process alive', async (t) => {
  const d = await startDaemon(t);
  const code = `const rl = require(${JSON.stringify(path.join(__dirname, '..'))});
    new rl.Client({ socket: ${JSON.stringify(d.socket)}, timeoutMs: 5000 }).check({ user: 'x' })
      .then((x) => console.log(x.allowed && !x.unreachable));`;
  const r = require('child_process').spawnSync(process.execPath, ['-e', code], { encoding: 'utf8', timeout: 10000 });
  assert.equal(r.status, 0, r.stderr);
  assert.equal(r.stdout.trim(), 'true');
});

test('a request over maxFrame is not sent; the sidecar\'s frame_too_large is alike', async (t) => {
  const d = await startDaemon(t);
  const c = client(t, { socket: d.socket, timeoutMs: 2000, conns: 1 });
  assert.ok((await c.check({ user: 'ivy' })).allowed);
  const conn = c.slots[0].conn;
  // Over the default maxFrame (65,536, the daemon's default --max-frame): refused, not sent.
  await assert.rejects(c.check({ user: 'ivy', blob: 'x'.repeat(70000) }), (e) => {
    assert.ok(e instanceof rl.RequestTooLargeError && e.code === 'request_too_large', String(e));
    assert.ok(e.size > 70000 && e.size < 70100 && e.maxFrame === 65536, `${e.size} ${e.maxFrame}`);
    assert.ok(!e.decision.allowed && e.decision.tooLarge && e.decision.status === 431 && !e.decision.unreachable);
    return true;
  });
  let x = await c.check({ user: 'ivy' });
  assert.ok(x.allowed && !x.degraded && x.remaining === 3, JSON.stringify(x));
  assert.equal(c.slots[0].conn, conn); // nothing reached the daemon: the connection stays
  // A maxFrame above the daemon's: the daemon answers frame_too_large and closes the
  // connection; the decision rejects all the same (under 'open' too).
  const big = client(t, { socket: d.socket, timeoutMs: 2000, conns: 1, maxFrame: 1 << 20 });
  await assert.rejects(big.check({ user: 'ivy', blob: 'x'.repeat(70000) }), (e) => {
    assert.ok(e instanceof rl.ProtocolError && e.code === 'frame_too_large', String(e));
    assert.ok(!e.decision.allowed && e.decision.tooLarge && e.decision.status === 431);
    return true;
  });
  x = await big.check({ user: 'ivy' });
  assert.ok(x.allowed && !x.degraded && x.remaining === 2, JSON.stringify(x));
});

test('numbers above 2^32 - 1 go as integers, not floats', async (t) => {
  // @msgpack/msgpack writes a number that large as a float64, which the sidecar refuses:
  // the failure policy decided (a cost of 2^32 bytes passed under "open"), and every
  // check of a connection whose ids had passed 2^32 failed.
  const proto = require('../lib/proto');
  const { Decoder } = require('@msgpack/msgpack');
  const frame = proto.encode({ id: 2 ** 32, op: 'check', cost: 2 ** 40, limits: [{ key: 'k', limit: 1, window_ms: 90 * 86400000 }] });
  const body = frame.subarray(4);
  assert.ok(!body.includes(0xcb), 'a float64 in the frame');
  const m = new Decoder({ useBigInt64: true }).decode(body);
  assert.deepEqual([m.id, m.cost, m.limits[0].window_ms], [2n ** 32n, 2n ** 40n, 90n * 86400000n]);

  const d = await startDaemon(t);
  const c = client(t, { socket: d.socket, timeoutMs: 2000 });
  for (const cost of [2 ** 32, 2n ** 64n - 1n, 2n ** 64n, 2n ** 80n]) { // past uint64: as 2^64 - 1
    const x = await c.check({ user: 'erin' }, { cost });
    assert.ok(!x.allowed && x.reason === rl.COST_EXCEEDS_CAPACITY, String(cost));
  }
  const y = await c.check({}, { limits: [{ key: 'q', limit: 3, windowMs: 90 * 86400000, name: 'quarter' }] });
  assert.ok(y.allowed && y.rule === 'quarter' && y.remaining === 2, JSON.stringify(y));
});

// A daemon at its --max-conns answers a new connection too_many_connections and closes
// it: the check's cause says so, as the other clients' do. It said "connection lost:
// write EPIPE" (the write failed before the answer was read; found by a client audit).
test('a daemon at --max-conns: the cause names too_many_connections', async (t) => {
  const net = require('net');
  const d = await startDaemon(t, undefined, ['--max-conns', '1']);
  const holder = net.connect(d.socket);
  await new Promise((r) => holder.once('connect', r));
  t.after(() => holder.destroy());
  let causes = [];
  for (let i = 0; i < 5; i++) {
    const c = new rl.Client({ socket: d.socket, timeoutMs: 1000 });
    const dec = await c.check({ user: 'ann' });
    c.close();
    assert.ok(dec.unreachable, 'answered by the policy');
    causes.push(dec.cause);
  }
  assert.ok(causes.every((c) => /too_many_connections/.test(c)), causes.join(' | '));
});

// The daemon refuses a connection past its --max-conns as it accepts it, reading none of
// it: a check refused so was not decided, and goes on another connection of the pool.
// Before, it got the policy (a 503 under 'closed') though the pool's other connection
// was served, each time the refused slot's backoff ended: 6 of 20 checks here.
test('a check on a connection refused at --max-conns goes on the pool\'s live one', async (t) => {
  const net = require('net');
  const d = await startDaemon(t, undefined, ['--max-conns', '2']);
  const holder = net.connect(d.socket);
  await new Promise((r) => holder.once('connect', r));
  t.after(() => holder.destroy());
  const c = client(t, { socket: d.socket, timeoutMs: 5000, onUnavailable: 'closed', conns: 2 });
  const causes = [];
  for (let i = 0; i < 20; i++) {
    const dec = await c.check({ user: `u${i}` });
    if (dec.unreachable) causes.push(dec.cause);
    else assert.equal(dec.remaining, 4, `u${i} counted once`);
    await new Promise((r) => setTimeout(r, 25)); // past the refused slot's backoff, at first
  }
  assert.deepEqual(causes, [], `${causes.length} of 20 checks answered by the policy`);
});

// A check refused at --max-conns goes again, after a 10 ms pause, on another slot first:
// the refused slot's backoff after one failure (5-10 ms) ends within that pause, and
// round-robin sent the resend straight back to it, to be refused again by the daemon
// still at its cap, and paused again. Here three concurrent checks dial both slots with
// the daemon's one free place: when the second slot's dial was refused, round-robin
// pointed back at it and it was redialed (refused again) before the first slot's live
// connection took the check: 3 dials, not 2.
test('a check refused at --max-conns is resent on another slot first', async (t) => {
  const net = require('net');
  const dial = net.createConnection;
  let dials = 0;
  net.createConnection = (...args) => {
    dials++;
    return dial.apply(net, args);
  };
  t.after(() => {
    net.createConnection = dial;
  });
  const counts = [];
  for (let i = 0; i < 10; i++) {
    const d = await startDaemon(t, undefined, ['--max-conns', '2']);
    const holder = net.connect(d.socket);
    await new Promise((r) => holder.once('connect', r));
    t.after(() => holder.destroy());
    const c = client(t, { socket: d.socket, timeoutMs: 5000, onUnavailable: 'closed', conns: 2, logger: null });
    dials = 0;
    const ds = await Promise.all([c.check({ user: 'a' }), c.check({ user: 'b' }), c.check({ user: 'c' })]);
    for (const dec of ds) assert.ok(!dec.unreachable && dec.remaining === 4, dec.cause);
    counts.push(dials);
  }
  assert.deepEqual(counts, Array(10).fill(2), 'dials of each fresh client, the refused slot redialed when 3');
});
