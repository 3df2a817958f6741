'use strict';
// A connection carries at most MAX_PENDING checks in flight: a check that finds every
// connection full waits for room up to its timeout, and only then follows onUnavailable.

const test = require('node:test');
const assert = require('node:assert/strict');
const net = require('net');
const path = require('path');
const { encode } = require('@msgpack/msgpack');

const rl = require('..');
const proto = require('../lib/proto');
const { WaitQueue, MAX_PENDING } = require('../lib/client');
const { startDaemon, tempDir, inOneWindow } = require('./helpers');

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

function client(t, opts) {
  const c = new rl.Client(opts);
  t.after(() => c.close());
  return c;
}

// The outside tester's case: 20,000 concurrent checks on a healthy daemon, more than the
// two connections may have in flight (2 × 4,096). Every one is decided by the daemon: the
// inline limit lets exactly 15,000 through. (Before, the checks beyond 8,192 answered
// 'open' at once, degraded: a way around every limit.)
test('20,000 concurrent checks are all decided by the daemon', async (t) => {
  const d = await startDaemon(t);
  const c = client(t, { socket: d.socket, timeoutMs: 30000, conns: 2 });
  const ds = await inOneWindow(3600000, (n) => {
    const limits = [{ key: `burst${n}`, limit: 15000, windowMs: 3600000, algorithm: 'fixed_window' }];
    return Promise.all(Array.from({ length: 20000 }, () => c.check({}, { limits })));
  });
  const degraded = ds.filter((x) => x.degraded || x.unreachable);
  assert.equal(degraded.length, 0, degraded.slice(0, 3).map((x) => x.cause).join('\n'));
  assert.equal(ds.filter((x) => x.allowed).length, 15000);
  assert.equal(c.waiting.size, 0);
});

// A check that finds no room waits no longer than its own timeout, then follows the
// policy; the checks that timed out leave the queue.
test('no room until the timeout: the policy, after the timeout', async (t) => {
  const d = await startDaemon(t);
  const timeoutMs = 300;
  const c = client(t, { socket: d.socket, timeoutMs, conns: 1, onUnavailable: 'closed' });
  assert.ok((await c.check({ user: 'a' })).allowed); // connected
  await d.pause();
  let ds;
  const took = [];
  try {
    const t0 = Date.now();
    ds = await Promise.all(Array.from({ length: MAX_PENDING + 10 }, () => c.check({ user: 'b' }).then((x) => {
      took.push(Date.now() - t0);
      return x;
    })));
  } finally {
    d.resume();
  }
  assert.ok(ds.every((x) => !x.allowed && x.unreachable && x.degraded));
  assert.ok(Math.min(...took) >= timeoutMs - 5, `answered by the policy after ${Math.min(...took)} ms; the timeout is ${timeoutMs} ms`);
  const noRoom = ds.filter((x) => x.cause.includes('as many checks in flight as it may'));
  assert.equal(noRoom.length, 10);
  assert.equal(c.waiting.size, 0);
  assert.ok(c.waiting.items.length <= 64, String(c.waiting.items.length));
  // The abandoned checks' answers come once the daemon runs again; then there is room.
  const deadline = Date.now() + 10000;
  let x;
  do x = await c.check({ user: 'later' }); while (x.unreachable && Date.now() < deadline);
  assert.ok(x.allowed && !x.degraded, JSON.stringify(x));
});

// heldSidecar answers pings at once and checks only while hold is false (held checks are
// answered when hold turns false); drop() closes every connection.
async function heldSidecar(t) {
  const sock = path.join(tempDir(t), 'held.sock');
  const conns = new Set();
  const state = { hold: false, checks: 0 };
  const held = [];
  const answer = (s, req) => {
    const body = Buffer.from(encode(req.op === 'ping' ? { id: req.id, version: 'held', protocol: 1 }
      : { id: req.id, allowed: true, rule: req.attrs.user, limit: 1, remaining: 0, reset_ms: 0, retry_after_ms: 0, degraded: false, rules: [] }));
    const head = Buffer.alloc(4);
    head.writeUInt32BE(body.length);
    if (!s.destroyed) s.write(Buffer.concat([head, body]));
  };
  const srv = net.createServer((s) => {
    conns.add(s);
    s.on('close', () => conns.delete(s));
    let buf = Buffer.alloc(0);
    s.on('data', (b) => {
      buf = Buffer.concat([buf, b]);
      while (buf.length >= 4 && buf.length >= 4 + buf.readUInt32BE(0)) {
        const req = proto.decode(buf.subarray(4, 4 + buf.readUInt32BE(0)));
        buf = buf.subarray(4 + buf.readUInt32BE(0));
        if (req.op === 'check') state.checks++;
        if (req.op === 'check' && (state.hold || held.length > 0)) held.push([s, req]);
        else answer(s, req);
      }
    });
  });
  await new Promise((r) => srv.listen(sock, r));
  t.after(() => new Promise((r) => {
    for (const s of conns) s.destroy();
    srv.close(r);
  }));
  state.release = () => {
    state.hold = false;
    for (const [s, req] of held.splice(0)) answer(s, req);
  };
  state.drop = () => {
    for (const s of conns) s.destroy();
  };
  return { sock, state };
}

// A connection that breaks while checks wait for its room sends them round again: its slot
// redials and the sidecar answers them.
test('waiting checks move on when the connection breaks', async (t) => {
  const { sock, state } = await heldSidecar(t);
  const c = client(t, { socket: sock, timeoutMs: 10000, conns: 1, onUnavailable: 'closed' });
  assert.ok(await c.ping()); // served: the slot redials at once after the drop
  state.hold = true;
  const ps = Array.from({ length: MAX_PENDING + 3 }, (_, i) => c.check({ user: `u${i}` }));
  while (state.checks < MAX_PENDING) await sleep(5);
  await sleep(20);
  assert.equal(state.checks, MAX_PENDING); // the other three wait for room
  assert.equal(c.waiting.size, 3);
  state.drop();
  state.release();
  const ds = await Promise.all(ps);
  const answered = ds.filter((x) => !x.unreachable);
  assert.deepEqual(answered.map((x) => x.rule), [`u${MAX_PENDING}`, `u${MAX_PENDING + 1}`, `u${MAX_PENDING + 2}`]);
  assert.ok(ds.slice(0, MAX_PENDING).every((x) => x.unreachable && !x.allowed));
});

test('WaitQueue: FIFO, and the checks that leave do not pile up', () => {
  const q = new WaitQueue();
  const es = Array.from({ length: 10000 }, (_, i) => ({ i, queued: false }));
  for (const e of es) q.push(e);
  for (const e of es.slice(0, 9990)) q.remove(e); // they timed out while nothing had room
  assert.equal(q.size, 10);
  assert.ok(q.items.length - q.head <= 64, String(q.items.length - q.head));
  assert.deepEqual(Array.from({ length: 10 }, () => q.shift().i), es.slice(9990).map((e) => e.i));
  assert.equal(q.shift(), null);
  assert.equal(q.items.length, 0);
});
