'use strict';
// upgrade(): WebSocket handshakes, which Node hands to the server's 'upgrade' event and
// never to the request handler (so the middleware never saw them), checked against the
// real daemon through a real http.Server: a rule on a path applies to a handshake to it.

const test = require('node:test');
const assert = require('node:assert/strict');
const crypto = require('crypto');
const fs = require('fs');
const http = require('http');
const net = require('net');
const path = require('path');

const rl = require('..');
const { ROOT, startDaemon } = require('./helpers');

const RULES = fs.readFileSync(path.join(ROOT, 'clients', 'testdata', 'websocket_rules.yaml'), 'utf8');

// handshake opens a WebSocket handshake to path; resolves to { status, headers, socket }
// once the response's head arrived (the socket left open: a session when 101).
function handshake(port, path) {
  return new Promise((resolve, reject) => {
    const socket = net.connect(port, '127.0.0.1');
    let buf = '';
    socket.on('error', reject);
    socket.on('data', function onData(b) {
      buf += b.toString('latin1');
      const end = buf.indexOf('\r\n\r\n');
      if (end < 0) return;
      socket.off('data', onData);
      const lines = buf.slice(0, end).split('\r\n');
      const headers = {};
      for (const l of lines.slice(1)) {
        const i = l.indexOf(':');
        headers[l.slice(0, i).trim().toLowerCase()] = l.slice(i + 1).trim();
      }
      resolve({ status: Number(lines[0].split(' ')[1]), headers, socket });
    });
    socket.write(`GET ${path} HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n`
      + `Sec-WebSocket-Key: ${crypto.randomBytes(16).toString('base64')}\r\nSec-WebSocket-Version: 13\r\n\r\n`);
  });
}

test('upgrade: handshakes are checked, a lease held for the session', async (t) => {
  const d = await startDaemon(t, RULES);
  const c = new rl.Client({ socket: d.socket, timeoutMs: 3000 });
  t.after(() => c.close());
  const srv = http.createServer((req, res) => res.end('ok'));
  const sessions = new Set();
  // A stand-in for ws's handleUpgrade: a 101 with the rate-limit headers, the socket kept.
  srv.on('upgrade', rl.upgrade(c, (req, socket, head, decision) => {
    let h = 'HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n';
    for (const [k, v] of Object.entries(decision.headers())) h += `${k}: ${v}\r\n`;
    socket.write(h + '\r\n');
    socket.resume(); // reads the frames, and so sees the client go,
    socket.on('end', () => socket.end()); // and closes the socket then (ws does both)
    sessions.add(socket);
    socket.on('close', () => sessions.delete(socket));
  }));
  await new Promise((resolve) => srv.listen(0, '127.0.0.1', resolve));
  t.after(() => { for (const s of sessions) s.destroy(); srv.closeAllConnections(); return new Promise((resolve) => srv.close(resolve)); });
  const port = srv.address().port;
  const opened = [];
  t.after(() => { for (const s of opened) s.destroy(); });

  const got = [];
  for (let i = 0; i < 4; i++) {
    const r = await handshake(port, '/login');
    opened.push(r.socket);
    got.push(r);
  }
  assert.deepEqual(got.map((r) => r.status), [101, 101, 429, 429]);
  assert.ok(got.slice(0, 2).every((r) => 'ratelimit' in r.headers || 'ratelimit-remaining' in r.headers), 'rate-limit headers on the 101');
  assert.ok(got.slice(2).every((r) => Number(r.headers['retry-after']) > 0), 'Retry-After on the 429');

  // A concurrency rule: the slot is held for the session, renewed past its 2 s lease.
  const chat = await handshake(port, '/chat');
  assert.equal(chat.status, 101);
  await new Promise((r) => setTimeout(r, 5000)); // more than twice the lease
  const other = await handshake(port, '/chat');
  other.socket.destroy();
  assert.equal(other.status, 429, 'a second session while the first lasts is refused');
  chat.socket.destroy(); // the session ends: its slot is released
  let status = 0;
  for (let k = 0; k < 200 && status !== 101; k++) {
    const r = await handshake(port, '/chat');
    opened.push(r.socket);
    status = r.status;
    if (status !== 101) await new Promise((res) => setTimeout(res, 20));
  }
  assert.equal(status, 101, 'the slot is free once the session ended');
});

test('upgrade: unknown options are refused', () => {
  assert.throws(() => rl.upgrade({}, () => {}, { renewLease: false }), /unknown upgrade option "renewLease"/);
});

test('upgrade: a client that resets its handshake while it is held does not crash the server', async (t) => {
  // Node takes its 'error' listener off a socket it hands to 'upgrade': a reset while the
  // handshake was checked or held for a rule's delay was an unhandled 'error' event.
  const d = await startDaemon(t, `
rules:
  - name: queue
    match: { path: /queue }
    key: ip
    limit: { requests: 1, per: 20s }
    delay: 60s
`);
  const c = new rl.Client({ socket: d.socket, timeoutMs: 3000 });
  t.after(() => c.close());
  const check = c.check.bind(c);
  let held = null;
  const answered = new Promise((resolve) => { held = resolve; });
  c.check = (...a) => check(...a).then((dec) => { if (dec.delayMs > 0) held(dec); return dec; });
  const srv = http.createServer((req, res) => res.end('ok'));
  const serverSockets = [];
  srv.on('connection', (s) => serverSockets.push(s));
  let handled = 0;
  srv.on('upgrade', rl.upgrade(c, (req, socket) => {
    handled++;
    socket.end('HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n');
  }));
  await new Promise((resolve) => srv.listen(0, '127.0.0.1', resolve));
  t.after(() => { srv.closeAllConnections(); return new Promise((resolve) => srv.close(resolve)); });
  const port = srv.address().port;

  const first = await handshake(port, '/queue'); // takes the one unit: the next is held
  first.socket.destroy();
  const client = net.connect(port, '127.0.0.1');
  client.on('error', () => {});
  await new Promise((resolve) => client.once('connect', resolve));
  client.write(`GET /queue HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n`
    + `Sec-WebSocket-Key: ${crypto.randomBytes(16).toString('base64')}\r\nSec-WebSocket-Version: 13\r\n\r\n`);
  await answered; // held for the delay
  await new Promise((resolve) => setImmediate(resolve)); // the listener has the decision
  const server = serverSockets[serverSockets.length - 1];
  const closed = new Promise((resolve) => server.once('close', resolve));
  client.resetAndDestroy(); // RST
  await closed;
  await new Promise((resolve) => setTimeout(resolve, 100)); // an unhandled 'error' would fail the test
  assert.equal(handled, 1, 'the handshake reset while held is not handed to the handler');
});
