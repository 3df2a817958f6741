'use strict';
// A check written on a connection the sidecar closed without reading it (a graceful
// restart's drain answers what each connection held, then closes it) was not decided: it
// is sent again on a new connection within its timeout, not answered by the policy (a 503
// under 'closed' at every restart).

const test = require('node:test');
const assert = require('node:assert/strict');
const net = require('net');
const path = require('path');
const { encode } = require('@msgpack/msgpack');

const rl = require('..');
const proto = require('../lib/proto');
const { tempDir } = require('./helpers');

// oneCheckPerConn serves a stand-in that answers the first check of each connection, then
// stops reading it and, after `after` ms (the client's next check in, unread), destroys it:
// the client reads a reset (ECONNRESET) or its write fails (EPIPE).
async function oneCheckPerConn(t, after) {
  const sock = path.join(tempDir(t), 's.sock');
  const conns = new Set();
  const srv = net.createServer((s) => {
    conns.add(s);
    s.on('close', () => conns.delete(s));
    s.on('error', () => {});
    let buf = Buffer.alloc(0);
    const onData = (b) => {
      buf = Buffer.concat([buf, b]);
      if (buf.length < 4 || buf.length < 4 + buf.readUInt32BE(0)) return;
      s.removeListener('data', onData);
      s.pause();
      s._handle.readStop(); // what comes next stays unread in the socket (pause() alone keeps reading)
      const req = proto.decode(buf.subarray(4, 4 + buf.readUInt32BE(0)));
      const body = Buffer.from(encode({ id: req.id, allowed: true, rule: req.attrs.user }));
      const head = Buffer.alloc(4);
      head.writeUInt32BE(body.length);
      s.write(Buffer.concat([head, body]));
      setTimeout(() => s.destroy(), after);
    };
    s.on('data', onData);
  });
  await new Promise((r) => srv.listen(sock, r));
  t.after(() => new Promise((r) => {
    for (const s of conns) s.destroy();
    srv.close(r);
  }));
  return sock;
}

test('a check the sidecar closed its connection on, unread, is sent again', async (t) => {
  const sock = await oneCheckPerConn(t, 30);
  const c = new rl.Client({ socket: sock, timeoutMs: 1000, onUnavailable: 'closed', conns: 1, logger: null });
  t.after(() => c.close());
  const causes = [];
  for (let i = 0; i < 20; i++) {
    const d = await c.check({ user: 'u' });
    if (d.unreachable) causes.push(d.cause);
    else assert.equal(d.rule, 'u');
  }
  assert.deepEqual(causes, [], `${causes.length} of 20 checks answered by the policy`);
});
