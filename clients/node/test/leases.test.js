'use strict';
// Concurrency leases through the Client and the middleware, against the real daemon.

const test = require('node:test');
const assert = require('node:assert/strict');
const { EventEmitter } = require('events');
const http = require('http');

const rl = require('..');
const { startDaemon, standIn } = require('./helpers');

// until resolves once cond() holds, polled every 5 ms; rejects after ms.
async function until(cond, what, ms = 5000) {
  const deadline = Date.now() + ms;
  while (!cond()) {
    if (Date.now() > deadline) throw new Error(`not within ${ms} ms: ${what}`);
    await new Promise((r) => setTimeout(r, 5));
  }
}

const RULES = `
rules:
  - name: exports
    key: user
    concurrency: { max: 2, lease: 30s }
`;

test('leases: two then a refusal, release, renew', async (t) => {
  const d = await startDaemon(t, RULES);
  const c = new rl.Client({ socket: d.socket, timeoutMs: 2000 });
  t.after(() => c.close());
  const a = await c.check({ user: 'ann' });
  const b = await c.check({ user: 'ann' });
  assert.ok(a.allowed && b.allowed && a.lease && b.lease && a.lease !== b.lease);
  assert.deepEqual([a.rules[0].limit, a.rules[0].windowMs, a.rules[0].remaining], [2, 30000, 1]);
  const r = await c.check({ user: 'ann' });
  assert.ok(!r.allowed && r.lease === '' && r.retryAfterMs > 0 && r.retryAfterMs <= 1000);
  assert.deepEqual(await c.renew(b.lease, 60000), { renewed: true, expiresMs: 60000 });
  assert.equal(await c.release(a.lease), true);
  assert.equal(await c.release(a.lease), false);
  assert.equal(await c.release(''), false);
  assert.deepEqual(await c.renew(a.lease), { renewed: false, expiresMs: 0 });
  assert.ok((await c.check({ user: 'ann' })).allowed);
});

// release() is called in a finally: a sidecar stalled, or the client closed, resolves
// to false (the lease expires, or goes with its connection) rather than turning a
// request that succeeded into an error. It rejected ("sidecar unreachable: no answer
// within the timeout"; found by a client audit).
test('release resolves to false when the sidecar stalls or the client is closed', async (t) => {
  const d = await startDaemon(t, RULES);
  const c = new rl.Client({ socket: d.socket, timeoutMs: 2000 });
  t.after(() => c.close());
  const a = await c.check({ user: 'ann' });
  assert.ok(a.allowed && a.lease);
  c.timeoutMs = 100; // the stall: the release times out (answers the stall is over are awaited 2 s)
  await d.pause();
  try {
    let result;
    try {
      result = 'handled';
    } finally {
      assert.equal(await c.release(a.lease), false);
    }
    assert.equal(result, 'handled');
  } finally {
    d.resume();
  }
  c.timeoutMs = 2000;
  const b = await c.check({ user: 'ann' });
  assert.ok(b.allowed && b.lease, JSON.stringify(b));
  c.close();
  assert.equal(await c.release(b.lease), false);
  await assert.rejects(c.check({ user: 'ann' }), rl.ClosedError);
});

test('a lease taken by an answer that came after the check timed out is released', async (t) => {
  const d = await startDaemon(t, RULES.replace('max: 2', 'max: 1'));
  // One connection: every probe below is decided after the late check (the daemon decides
  // a connection's requests in order), so a free slot is seen only once its lease was
  // released. With two, a probe on the other connection could be decided first, see the
  // slot free, and the check after it find it taken by the late check.
  const c = new rl.Client({ socket: d.socket, timeoutMs: 2000, conns: 1 });
  t.after(() => c.close());
  assert.ok(!(await c.check({ user: 'bob' }, { cost: 0 })).unreachable); // connected
  c.timeoutMs = 50; // for the stalled check only: every answer after it is awaited 2 s
  await d.pause();
  const late = await c.check({ user: 'ann' }); // sent to a stalled daemon: times out
  assert.ok(late.unreachable && late.lease === '', 'the stalled check is the policy\'s decision');
  c.timeoutMs = 2000;
  d.resume(); // the daemon answers it now, allowed, with a lease nobody holds
  let remaining = -1;
  for (let k = 0; k < 200 && remaining !== 1; k++) {
    await new Promise((r) => setTimeout(r, 10));
    remaining = (await c.check({ user: 'ann' }, { cost: 0 })).rules[0].remaining;
  }
  assert.equal(remaining, 1, 'the late lease is released, its slot free again');
  const again = await c.check({ user: 'ann' });
  assert.ok(again.allowed && again.lease !== '');
});

test('the middleware: a client gone while its check was answered is not served, its lease released', async (t) => {
  const d = await startDaemon(t, RULES.replace('max: 2', 'max: 1'));
  const c = new rl.Client({ socket: d.socket, timeoutMs: 3000 });
  t.after(() => c.close());
  let served = 0;
  let arrived = 0;
  let closed = 0;
  const mw = rl.middleware(c, { attrs: () => ({ user: 'ann' }) });
  // A handler that never ends a response (it would wait on something the gone client
  // never sends): before the fix, the slot stayed held, renewed, for as long as it ran.
  const srv = http.createServer((req, res) => {
    arrived++;
    res.once('close', () => { closed++; });
    mw(req, res, () => { served++; });
  });
  await new Promise((resolve) => srv.listen(0, '127.0.0.1', resolve));
  t.after(() => { srv.closeAllConnections(); return new Promise((resolve) => srv.close(resolve)); });
  assert.ok((await c.check({ user: 'bob' }, { cost: 0 })).allowed); // connected
  await d.pause();
  // The client goes once its request reached the middleware (its check is with the stalled
  // daemon), and the daemon resumes once the server has seen it go. Fixed waits (200 ms,
  // then 100 ms) let a loaded machine do these in the other order.
  const r = http.get({ host: '127.0.0.1', port: srv.address().port, path: '/' });
  r.on('error', () => {});
  await until(() => arrived === 1, 'the request reached the middleware');
  r.destroy();
  await until(() => closed === 1, 'the server saw the client go');
  d.resume(); // the check is answered now: allowed, with a lease
  let remaining = -1;
  for (let k = 0; k < 200 && remaining !== 1; k++) {
    await new Promise((r) => setTimeout(r, 10));
    remaining = (await c.check({ user: 'ann' }, { cost: 0 })).rules[0].remaining;
  }
  assert.equal(remaining, 1, 'the gone client\'s lease is released');
  assert.equal(served, 0, 'nothing was forwarded for the gone client');
});

test('the middleware: a client gone while its handler runs keeps the slot until the handler ends', async (t) => {
  // max 1. Before, the slot was released when the client hung up, while its handler
  // still ran: clients that send a request and hang up at once started any number of
  // handlers under a max of 1.
  const d = await startDaemon(t, RULES.replace('max: 2', 'max: 1'));
  const c = new rl.Client({ socket: d.socket, timeoutMs: 3000 });
  t.after(() => c.close());
  const mw = rl.middleware(c, { attrs: () => ({ user: 'ann' }) });
  let running = 0;
  let closed = 0;
  let finish = null;
  const done = new Promise((resolve) => { finish = resolve; });
  const srv = http.createServer((req, res) => {
    res.once('close', () => { closed++; });
    mw(req, res, async () => {
      running++;
      await done; // the work goes on after the client left
      res.end('done');
    });
  });
  await new Promise((resolve) => srv.listen(0, '127.0.0.1', resolve));
  t.after(() => { srv.closeAllConnections(); return new Promise((resolve) => srv.close(resolve)); });
  // hangUp sends a request and hangs up as soon as a handler starts for it; a request
  // refused is answered first. (It hung up after a fixed 300 ms, which a loaded machine
  // may take to check the request, or to answer the refusal.)
  const hangUp = () => new Promise((resolve) => {
    const before = running;
    const r = http.get({ host: '127.0.0.1', port: srv.address().port, path: '/' }, (res) => {
      res.resume();
      res.on('end', () => resolve(res.statusCode));
    });
    r.on('error', () => resolve('gone'));
    const poll = setInterval(() => {
      if (running > before) r.destroy();
    }, 5);
    r.on('close', () => clearInterval(poll));
  });
  assert.equal(await hangUp(), 'gone'); // its handler runs, and waits
  await until(() => closed === 1, 'the server saw the client go');
  assert.equal(running, 1);
  assert.equal((await c.check({ user: 'ann' }, { cost: 0 })).rules[0].remaining, 0, 'the slot is still held');
  const statuses = [];
  for (let i = 0; i < 5; i++) statuses.push(await hangUp());
  assert.deepEqual(statuses, Array(5).fill(429), 'no other handler started');
  assert.equal(running, 1);
  finish();
  let remaining = -1;
  for (let k = 0; k < 200 && remaining !== 1; k++) {
    await new Promise((r) => setTimeout(r, 10));
    remaining = (await c.check({ user: 'ann' }, { cost: 0 })).rules[0].remaining;
  }
  assert.equal(remaining, 1, 'released when the handler ended the response');
});

// Node tells the middleware when a response ends (res.end, res.destroy), never when its
// handler is done: a handler that stops at its client's hang-up without ending the
// response — the usual server-sent-events handler, which clears its timer on 'close' —
// is done, but looks like one still running. So after a hang-up the lease is kept, not
// renewed: a handler that ends the response later releases it then (test above); one
// that never does frees it when the lease runs out. Renewed for as long as the response
// is not ended (as Go and Python renew until the handler returns, which they can see),
// each such hang-up would hold a slot for the life of the process, and max of them would
// refuse the route for good.
test('the middleware: a handler that stops at the hang-up without ending the response frees the slot at the lease\'s expiry', async (t) => {
  const d = await startDaemon(t, RULES.replace('max: 2, lease: 30s', 'max: 1, lease: 2s'));
  const c = new rl.Client({ socket: d.socket, timeoutMs: 3000 });
  t.after(() => c.close());
  const mw = rl.middleware(c, { attrs: () => ({ user: 'ann' }) });
  let closed = 0;
  const srv = http.createServer((req, res) => mw(req, res, () => {
    res.writeHead(200, { 'Content-Type': 'text/event-stream' });
    const timer = setInterval(() => res.write('data: tick\n\n'), 100);
    res.write('data: hello\n\n');
    req.on('close', () => { clearInterval(timer); closed++; }); // no res.end(): the client is gone
  }));
  await new Promise((resolve) => srv.listen(0, '127.0.0.1', resolve));
  t.after(() => { srv.closeAllConnections(); return new Promise((resolve) => srv.close(resolve)); });
  await new Promise((resolve) => {
    const r = http.get({ host: '127.0.0.1', port: srv.address().port, path: '/events', agent: false }, (res) => {
      res.once('data', () => { r.destroy(); resolve(); });
    });
    r.on('error', () => {});
  });
  await until(() => closed === 1, 'the server saw the client go');
  let remaining = -1;
  for (let k = 0; k < 300 && remaining !== 1; k++) {
    await new Promise((r) => setTimeout(r, 50));
    remaining = (await c.check({ user: 'ann' }, { cost: 0 })).rules[0].remaining;
  }
  assert.equal(remaining, 1, 'the slot is free once the 2 s lease ran out');
});

test('the middleware releases when the handler destroys its response', async (t) => {
  // A handler whose stream fails (stream.pipeline destroys the response) or that calls
  // res.destroy(): before, the slot stayed held until the lease ran out.
  const d = await startDaemon(t, RULES.replace('max: 2', 'max: 1'));
  const c = new rl.Client({ socket: d.socket, timeoutMs: 3000 });
  t.after(() => c.close());
  const mw = rl.middleware(c, { attrs: () => ({ user: 'ann' }) });
  const { Readable, pipeline } = require('node:stream');
  const srv = http.createServer((req, res) => mw(req, res, () => {
    if (req.url === '/destroy') {
      res.destroy();
      return;
    }
    const src = new Readable({ read() {} });
    pipeline(src, res, () => {});
    src.push('partial');
    setTimeout(() => src.destroy(new Error('disk error')), 20);
  }));
  await new Promise((resolve) => srv.listen(0, '127.0.0.1', resolve));
  t.after(() => { srv.closeAllConnections(); return new Promise((resolve) => srv.close(resolve)); });
  const get = (p) => new Promise((resolve) => {
    const r = http.get({ host: '127.0.0.1', port: srv.address().port, path: p, agent: false }, (res) => {
      res.resume();
      res.on('end', () => resolve(res.statusCode));
      res.on('error', () => resolve('aborted'));
    });
    r.on('error', () => resolve('aborted'));
  });
  for (const p of ['/destroy', '/pipeline']) {
    assert.equal(await get(p), 'aborted', p);
    let remaining = -1;
    for (let k = 0; k < 100 && remaining !== 1; k++) {
      await new Promise((r) => setTimeout(r, 10));
      remaining = (await c.check({ user: 'ann' }, { cost: 0 })).rules[0].remaining;
    }
    assert.equal(remaining, 1, `${p}: released when the handler destroyed its response`);
  }
});

test('a destroyed response reaches its client only once its lease is released', async (t) => {
  // A client that retries the moment its request fails (res.destroy(), or a
  // stream.pipeline whose source failed) must find the slot free, as after res.end() and
  // as with the Go and Python middlewares, which release before the failure shows. The
  // release was sent as the response was destroyed, not waited for: of 30 immediate
  // retries, a few found the slot still held (a 429 for a slot being freed).
  const d = await startDaemon(t, RULES.replace('max: 2', 'max: 1'));
  const c = new rl.Client({ socket: d.socket, timeoutMs: 3000 });
  const probe = new rl.Client({ socket: d.socket, timeoutMs: 3000 });
  t.after(() => Promise.all([c.close(), probe.close()]));
  const mw = rl.middleware(c, { attrs: () => ({ user: 'ann' }) });
  const srv = http.createServer((req, res) => mw(req, res, () => res.destroy()));
  await new Promise((resolve) => srv.listen(0, '127.0.0.1', resolve));
  t.after(() => { srv.closeAllConnections(); return new Promise((resolve) => srv.close(resolve)); });
  const get = () => new Promise((resolve) => {
    const r = http.get({ host: '127.0.0.1', port: srv.address().port, path: '/', agent: false }, (res) => {
      res.resume();
      res.on('end', () => resolve(res.statusCode));
      res.on('error', () => resolve('aborted'));
    });
    r.on('error', () => resolve('aborted'));
  });
  let held = 0;
  for (let i = 0; i < 30; i++) {
    assert.equal(await get(), 'aborted');
    if ((await probe.check({ user: 'ann' }, { cost: 0 })).rules[0].remaining !== 1) held++;
    for (let k = 0; k < 100 && (await probe.check({ user: 'ann' }, { cost: 0 })).rules[0].remaining !== 1; k++) {
      await new Promise((r) => setTimeout(r, 5));
    }
  }
  assert.equal(held, 0, 'retries that found the slot of a destroyed response still held');
});

test('the middleware releases when the response finishes', async (t) => {
  const d = await startDaemon(t, RULES.replace('max: 2', 'max: 1'));
  const c = new rl.Client({ socket: d.socket, timeoutMs: 2000 });
  t.after(() => c.close());
  const mw = rl.middleware(c, { attrs: () => ({ user: 'ann' }) });
  for (let i = 0; i < 3; i++) {
    const res = new EventEmitter();
    res.headers = {};
    res.setHeader = (k, v) => { res.headers[k] = v; };
    res.end = () => res.emit('finish');
    await new Promise((resolve) => mw({ method: 'GET', url: '/' }, res, resolve));
    assert.equal((await c.check({ user: 'ann' }, { cost: 0 })).rules[0].remaining, 0, `request ${i} holds its slot`);
    res.end();
    res.emit('close');
    for (let k = 0; k < 100 && (await c.check({ user: 'ann' }, { cost: 0 })).rules[0].remaining !== 1; k++) {
      await new Promise((r) => setTimeout(r, 5));
    }
    assert.equal((await c.check({ user: 'ann' }, { cost: 0 })).rules[0].remaining, 1, `request ${i} released`);
  }
});

test('keep-alive: each request on a connection finds the slot its predecessor freed', async (t) => {
  // max 1, and a client that sends each request the moment the previous response
  // arrived, on one connection: the release (after the response) must reach the daemon
  // before the next request's check.
  const d = await startDaemon(t, RULES.replace('max: 2', 'max: 1'));
  const c = new rl.Client({ socket: d.socket, timeoutMs: 2000 });
  t.after(() => c.close());
  const mw = rl.middleware(c, { attrs: () => ({ user: 'ann' }) });
  const srv = http.createServer((req, res) => mw(req, res, () => res.end('ok')));
  await new Promise((resolve) => srv.listen(0, '127.0.0.1', resolve));
  const agent = new http.Agent({ keepAlive: true, maxSockets: 1 });
  t.after(() => { agent.destroy(); return new Promise((resolve) => srv.close(resolve)); });
  const statuses = [];
  const sockets = new Set();
  for (let i = 0; i < 100; i++) {
    statuses.push(await new Promise((resolve, reject) => {
      http.get({ host: '127.0.0.1', port: srv.address().port, path: '/', agent }, (res) => {
        sockets.add(res.socket);
        res.resume();
        res.on('end', () => resolve(res.statusCode));
      }).on('error', reject);
    }));
  }
  assert.equal(sockets.size, 1, 'one connection');
  assert.deepEqual(statuses, Array(100).fill(200));
});

// The middleware renews a request's lease until it is released: a request that runs
// longer than its rule's lease (2 s) keeps its slot; with renewLeases: false it loses it
// once the lease expires. Both at once, each with its own user.
test('the middleware renews a long request\'s lease', async (t) => {
  const d = await startDaemon(t, RULES.replace('max: 2, lease: 30s', 'max: 1, lease: 2s'));
  const c = new rl.Client({ socket: d.socket, timeoutMs: 2000 });
  t.after(() => c.close());
  const start = (user, opts) => {
    const mw = rl.middleware(c, { attrs: () => ({ user }), ...opts });
    const res = new EventEmitter();
    res.headers = {};
    res.setHeader = (k, v) => { res.headers[k] = v; };
    res.end = () => res.emit('finish');
    return new Promise((resolve) => mw({ method: 'PUT', url: '/upload' }, res, () => resolve(res)));
  };
  const free = async (user) => (await c.check({ user }, { cost: 0 })).rules[0].remaining;
  const [renewed, lost] = await Promise.all([start('ren', {}), start('lou', { renewLeases: false })]);
  assert.deepEqual([await free('ren'), await free('lou')], [0, 0]);
  await new Promise((r) => setTimeout(r, 4500)); // more than twice the lease
  assert.equal(await free('ren'), 0, 'renewed: still held after 4.5 s of a 2 s lease');
  assert.equal(await free('lou'), 1, 'not renewed: expired');
  for (const res of [renewed, lost]) {
    res.end();
    res.emit('close');
  }
  for (let k = 0; k < 200 && (await free('ren')) !== 1; k++) await new Promise((r) => setTimeout(r, 10));
  assert.equal(await free('ren'), 1, 'released when the response ended');
});

// The middleware keeps renewing through a sidecar that does not answer for longer than the
// shortest rate window, as long as the lease itself lasts: its expiry is the concurrency
// rule's window (3 s), not twice the first renewal's wait (half the rate rule's 1 s
// window). Before, renewals that got no answer for a second (a sidecar stalled or
// restarting) stopped for good, and the lease expired under the running request.
test('the middleware renews through an outage shorter than the lease', async (t) => {
  let answering = false;
  let renewed = 0;
  const sock = await standIn(t, 'renew.sock', (req) => {
    if (req.op === 'renew') {
      if (!answering) return undefined; // no answer: the renewal times out
      renewed++;
      return { renewed: true, expires_ms: 3000 };
    }
    if (req.op === 'release') return { released: true };
    return {
      allowed: true, rule: 'exports', limit: 1, remaining: 0, reset_ms: 0, retry_after_ms: 0, lease: 'L1',
      rules: [
        { name: 'exports', limit: 1, window_ms: 3000, remaining: 0, reset_ms: 0, retry_after_ms: 0, allowed: true, shadow: false, concurrency: true },
        { name: 'per-second', limit: 100, window_ms: 1000, remaining: 99, reset_ms: 10, retry_after_ms: 0, allowed: true, shadow: false },
      ],
    };
  });
  const c = new rl.Client({ socket: sock, timeoutMs: 100, logger: null });
  t.after(() => c.close());
  const mw = rl.middleware(c, { attrs: () => ({ user: 'ann' }) });
  const res = new EventEmitter();
  res.headers = {};
  res.setHeader = (k, v) => { res.headers[k] = v; };
  res.end = () => res.emit('finish');
  await new Promise((resolve) => mw({ method: 'PUT', url: '/upload' }, res, resolve));
  setTimeout(() => { answering = true; }, 1500);
  for (let k = 0; k < 500 && renewed === 0; k++) await new Promise((r) => setTimeout(r, 10));
  res.end();
  res.emit('close');
  assert.ok(renewed > 0, 'no renewal after the sidecar answered again 1.5 s in: the renewals stopped at the rate rule\'s window');
});

// A lease held by a request when its client is closed is not renewed again and again:
// every renewal of a closed client fails at once, and was retried at half of what was left
// of the lease, down to every 10 ms, until its expiry.
test('the middleware stops renewing once its client is closed', async (t) => {
  const d = await startDaemon(t, RULES.replace('max: 2, lease: 30s', 'max: 1, lease: 2s'));
  const c = new rl.Client({ socket: d.socket, timeoutMs: 2000 });
  let renewals = 0;
  const renew = c.renew.bind(c);
  c.renew = (...args) => { renewals++; return renew(...args); };
  const mw = rl.middleware(c, { attrs: () => ({ user: 'cleo' }) });
  const res = new EventEmitter();
  res.setHeader = () => {};
  res.end = () => res.emit('finish');
  await new Promise((resolve) => mw({ method: 'PUT', url: '/upload' }, res, resolve));
  await c.close();
  await new Promise((r) => setTimeout(r, 4500)); // past the first renewal and the lease
  assert.ok(renewals <= 1, `${renewals} renewals of a closed client's lease, want at most 1`);
  res.end();
  res.emit('close');
});

// The sidecar frees a lease when the connection that took it closes. A connection given
// up for a stall (no answer for max(1 s, 4 × timeoutMs) while checks time out on it) that
// holds the lease of a request still running is retired, not closed: the next check
// redials, and the slot stays held until the lease is released. Before, it was closed, and
// once the daemon resumed it freed the slot: with max 1, a second request was admitted
// beside the first (the real daemon, SIGSTOPped 2 s under the middleware: 3 of 3
// admitted after the stall, now 0).
test('a stall does not free the leases of requests still running', async (t) => {
  const d = await startDaemon(t, `
rules:
  - name: exports
    key: user
    concurrency: { max: 1, lease: 30s }
`);
  const c = new rl.Client({ socket: d.socket, timeoutMs: 2000, conns: 1, logger: null });
  t.after(() => c.close());
  const a = await c.check({ user: 'ann' });
  assert.ok(a.allowed && a.lease);
  // 20 ms for the checks of the stall (given up after 1 s of them); every answer after it
  // is awaited 2 s: a release or a check that a loaded machine answers in more than 20 ms
  // is not a failure of what this tests.
  c.timeoutMs = 20;
  await d.pause();
  const start = Date.now();
  while (c.retired.size === 0 && Date.now() - start < 5000) assert.ok((await c.check({ user: 'bob' })).unreachable);
  assert.equal(c.retired.size, 1, 'the stalled connection holding a lease is retired');
  c.timeoutMs = 2000;
  d.resume();
  const second = await c.check({ user: 'ann' });
  assert.ok(!second.unreachable, `no answer after the stall: ${second.cause}`);
  assert.equal(second.allowed, false, 'a second request admitted beside the first: the stall freed its slot');
  assert.equal(await c.release(a.lease), true);
  assert.equal(c.retired.size, 0, 'the retired connection is closed once its lease is released');
  const third = await c.check({ user: 'ann' });
  assert.ok(third.allowed && third.lease, JSON.stringify(third));
  assert.equal(await c.release(third.lease), true);
});

// A connection retired for a stall while it holds a lease never released is closed once
// that lease has expired: its lease is the concurrency rule's window, not the longest
// window of the answer's rules. Before, a check that also matched a rule of 1 per day kept
// the retired connection open for a day, for each stall.
test('a retired connection is held for its lease, not a rate rule\'s window', async (t) => {
  const { c, d } = await retiredWithLease(t, '3s');
  try {
    await until(() => c.retired.size === 0, 'the retired connection was held past its lease, for the day rule\'s window');
  } finally {
    d.resume();
  }
});

// A release the stalled daemon does not answer ends the lease all the same: the retired
// connection holding it, holding no other, is closed at once, which frees the lease on the
// daemon (once it runs again). Before, it stayed open, its descriptor held, until the
// lease expired (30 s here, up to an hour): one per leased request that ended during the
// stall.
test('an unanswered release closes the retired connection that holds its lease', async (t) => {
  const { c, d, a } = await retiredWithLease(t, '30s');
  try {
    c.timeoutMs = 100;
    assert.equal(await c.release(a.lease), false); // unanswered: the daemon is stopped
    await until(() => c.retired.size === 0, 'the retired connection closed after its lease\'s release went unanswered');
    assert.equal(c.leases.size, 0, 'the lease is still tracked');
  } finally {
    d.resume();
  }
  // Closing it was the release: the slot is free once the daemon runs again.
  c.timeoutMs = 2000;
  let again;
  for (const deadline = Date.now() + 5000; Date.now() < deadline;) {
    again = await c.check({ user: 'ann' });
    if (again.allowed && !again.degraded) break;
    await new Promise((r) => setTimeout(r, 50));
  }
  assert.ok(again.allowed && again.lease, `the ended request's slot still held: ${JSON.stringify(again)}`);
  assert.equal(await c.release(again.lease), true);
});

// retiredWithLease starts the real daemon with a concurrency rule of max 1 and the given
// lease (beside a rule of 1,000 a day), and a client of it with one connection; takes a
// lease (a), then stops the daemon (SIGSTOP) and checks until the connection holding the
// lease is retired for the stall. The caller resumes the daemon (d.resume()).
async function retiredWithLease(t, lease) {
  const d = await startDaemon(t, `
rules:
  - name: exports
    key: user
    concurrency: { max: 1, lease: ${lease} }
  - name: per-day
    key: user
    limit: { requests: 1000, per: 1d }
`);
  const c = new rl.Client({ socket: d.socket, timeoutMs: 2000, conns: 1, logger: null });
  t.after(() => c.close());
  const a = await c.check({ user: 'ann' });
  assert.ok(a.allowed && a.lease);
  c.timeoutMs = 20;
  await d.pause();
  const start = Date.now();
  while (c.retired.size === 0 && Date.now() - start < 5000) assert.ok((await c.check({ user: 'bob' })).unreachable);
  if (c.retired.size !== 1) d.resume();
  assert.equal(c.retired.size, 1, 'the stalled connection holding a lease is retired');
  return { c, d, a };
}

// A late answer's lease (its check timed out: releaseOrphan) does not keep a retired
// connection open: no request runs under it, and closing frees it as the release does.
// Before, it was tracked until its release was answered, and a retired connection that
// had taken it stayed open (for a whole lease when that release was not answered), its
// other slots held with it. A scripted stand-in: the first connection answers ann's check
// with a lease, then stalls; once it is retired it answers a held check late, with a
// lease; the second connection answers that lease's release only after its timeout.
test('a late answer\'s lease does not keep a retired connection open', async (t) => {
  const rule = { name: 'exports', limit: 1, remaining: 0, reset_ms: 0, window_ms: 30000 };
  let first = null; // the first connection, and the checks it holds in its stall
  const held = [];
  let orphanAsked = false;
  const sock = await standIn(t, 'script.sock', (req, conn) => {
    if (req.op === 'ping') return { version: 'script' };
    if (conn.index === 1) {
      first = conn;
      if (req.attrs && req.attrs.user === 'ann') return { allowed: true, lease: 'A', rules: [rule] };
      held.push(req); // the stall
      return undefined;
    }
    if (req.op === 'release' && req.lease === 'B') {
      orphanAsked = true; // answered after its timeout: the client never hears it
      setTimeout(() => conn.send({ id: req.id, released: true }), 100);
      return undefined;
    }
    if (req.op === 'release') return { released: true };
    return { allowed: false, lease: '', retry_after_ms: 1000, rules: [rule] };
  });
  const c = new rl.Client({ socket: sock, timeoutMs: 10000, conns: 1, logger: null });
  t.after(() => c.close());
  const a = await c.check({ user: 'ann' });
  assert.ok(a.allowed && a.lease === 'A', JSON.stringify(a));
  // 50 ms from here: the stall's checks, and the late lease's release (answered 100 ms
  // late). The other checks are awaited 10 s: the stand-in answers them at once, but a
  // loaded machine may take longer than 50 ms (at 2 s, the first check timed out in 2
  // runs of 160 under load).
  c.timeoutMs = 50;
  const start = Date.now();
  while (c.retired.size === 0 && Date.now() - start < 5000) assert.ok((await c.check({ user: 'bob' })).unreachable);
  assert.equal(c.retired.size, 1, 'the stalled connection holding a lease is retired');
  // The slot's next connection, dialed and answering before the late answer comes: the
  // late lease's release is then written at once. Dialed by that release, it was never
  // sent when the dial took over the release's 50 ms (a loaded machine: 1 run in 30),
  // as a check's timeout counts its dial.
  c.timeoutMs = 10000;
  const second = await c.check({ user: 'bob' });
  assert.ok(!second.unreachable && c.slots[0].conn !== null, second.cause);
  c.timeoutMs = 50;
  first.send({ id: held[0].id, allowed: true, lease: 'B', rules: [rule] }); // late
  for (let i = 0; i < 200 && !orphanAsked; i++) await new Promise((r) => setTimeout(r, 5));
  assert.ok(orphanAsked, 'the late answer\'s lease is released');
  await new Promise((r) => setTimeout(r, 200)); // that release timed out, then came late
  c.timeoutMs = 10000;
  assert.equal(await c.release(a.lease), true);
  assert.equal(c.retired.size, 0, 'the retired connection closed once the running request\'s lease was released');
});
