'use strict';
// The client wraps a net.Socket's _write, _writev and _destroy (the stream implementer's
// hooks, on net.Socket.prototype in Node 18 to 20) to take write errors itself and to
// note what the kernel took: Node destroys a socket at a write's error (net.Socket forces
// autoDestroy), and no public API says how much of a failed write went out. A Node whose
// net.Socket lacks one of them must still work, as the client did before it wrapped them.
// This file alters net.Socket.prototype: node --test runs it in a process of its own.

const test = require('node:test');
const assert = require('node:assert/strict');
const net = require('net');

const rl = require('..');
const { startDaemon } = require('./helpers');

// Without Socket.prototype._writev, Writable writes a tick's frames one by one through
// _write. Before, the client set its own _writev anyway, which called the missing one:
// a TypeError thrown from uncork in a nextTick, uncaught, ended the process.
test('checks are answered on a Node whose net.Socket has no _writev', async (t) => {
  const saved = net.Socket.prototype._writev;
  delete net.Socket.prototype._writev;
  t.after(() => { net.Socket.prototype._writev = saved; });
  const d = await startDaemon(t);
  const c = new rl.Client({ socket: d.socket, conns: 1, timeoutMs: 10000, logger: null });
  t.after(() => c.close());
  const ds = await Promise.all(Array.from({ length: 20 }, (_, i) => c.check({ user: `w${i}` })));
  for (const dd of ds) assert.ok(!dd.unreachable && !dd.degraded, JSON.stringify(dd));
});
