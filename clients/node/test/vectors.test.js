'use strict';
// The shared protocol vectors (proto/testdata/vectors.json): byte-exact encoding of
// requests, decoding of answers, and the exchanges against the real daemon.

const test = require('node:test');
const assert = require('node:assert/strict');
const fs = require('fs');
const net = require('net');
const path = require('path');
const { Decoder } = require('@msgpack/msgpack');

const rl = require('..');
const proto = require('../lib/proto');
const { ROOT, startDaemon } = require('./helpers');

const V = JSON.parse(fs.readFileSync(path.join(ROOT, 'proto', 'testdata', 'vectors.json'), 'utf8'));

// jsLimits renames the wire's window_ms to the client's windowMs.
function jsLimits(ls) {
  return ls && ls.map(({ window_ms: windowMs, ...rest }) => ({ ...rest, windowMs }));
}

function requestFrame(m) {
  // The largest id does not fit a JS number: the vectors' JSON parser gave a rounded one.
  const id = m.id > Number.MAX_SAFE_INTEGER ? 18446744073709551615n : m.id;
  if (m.op === 'ping') return proto.encode({ id, op: 'ping' });
  return proto.encode(proto.checkMessage(id, Object.fromEntries(m.attrs || []), m.cost, jsLimits(m.limits)));
}

test('protocol version', () => assert.equal(V.protocol, rl.PROTOCOL));

for (const v of V.requests) {
  test(`request ${v.name}`, () => assert.equal(requestFrame(v.message).toString('hex'), v.hex, v.meaning));
}

for (const v of V.responses) {
  test(`response ${v.name}`, () => {
    const frame = Buffer.from(v.hex, 'hex');
    assert.equal(frame.readUInt32BE(0), frame.length - 4);
    const m = proto.decode(frame.subarray(4));
    assert.deepEqual(m, v.message, v.meaning);
    const want = v.message;
    if ('allowed' in want) {
      const d = proto.decision(m);
      assert.deepEqual([d.allowed, d.rule, d.limit, d.remaining, d.resetMs, d.retryAfterMs, d.degraded, d.reason],
        [want.allowed, want.rule, want.limit, want.remaining, want.reset_ms, want.retry_after_ms, want.degraded, want.reason || '']);
      assert.deepEqual(d.rules.map((r) => [r.name, r.limit, r.windowMs, r.remaining, r.resetMs, r.retryAfterMs, r.allowed, r.shadow, r.reason]),
        want.rules.map((r) => [r.name, r.limit, r.window_ms, r.remaining, r.reset_ms, r.retry_after_ms, r.allowed, r.shadow, r.reason || '']));
    } else if ('error' in want) {
      assert.deepEqual(proto.errorOf(m), [want.error.code, want.error.message]);
    }
  });
}

test('exchanges through the client against the real daemon', async (t) => {
  const d = await startDaemon(t, fs.readFileSync(path.join(ROOT, 'proto', 'testdata', 'rules.yaml'), 'utf8'));
  const c = new rl.Client({ socket: d.socket, timeoutMs: 2000 });
  t.after(() => c.close());
  const dec = new Decoder();
  for (const ex of V.exchanges) {
    const req = dec.decode(Buffer.from(ex.request_hex, 'hex').subarray(4));
    const want = proto.decode(Buffer.from(ex.response_hex, 'hex').subarray(4));
    if (req.op !== 'check') {
      const got = await new Promise((resolve, reject) => {
        const s = net.createConnection(d.socket, () => s.write(Buffer.from(ex.request_hex, 'hex')));
        s.once('data', (b) => { s.destroy(); resolve(b); });
        s.once('error', reject);
      });
      assert.equal(got.toString('hex'), ex.response_hex, ex.name);
      continue;
    }
    const p = c.check(req.attrs || {}, { cost: req.cost, limits: jsLimits(req.limits) });
    if (want.error) {
      await assert.rejects(p, (e) => {
        assert.ok(e instanceof rl.ProtocolError);
        assert.deepEqual([e.code, e.sidecarMessage], [want.error.code, want.error.message]);
        assert.ok(e.decision.allowed && e.decision.degraded && !e.decision.unreachable);
        return true;
      }, ex.name);
      continue;
    }
    assert.deepEqual(await p, proto.decision(want), `${ex.name}: ${ex.meaning}`);
  }
});
