'use strict';
// The shared HTTP table (clients/testdata/http_headers.json): headers, status and the
// problem+json body of every case, as the Go client makes them.

const test = require('node:test');
const assert = require('node:assert/strict');
const fs = require('fs');
const path = require('path');

const { Decision, RuleDecision } = require('..');
const proto = require('../lib/proto');
const { ROOT } = require('./helpers');

const CASES = JSON.parse(fs.readFileSync(path.join(ROOT, 'clients', 'testdata', 'http_headers.json'), 'utf8'));

function decisionOf(c) {
  const d = c.decision;
  return new Decision({
    allowed: d.allowed, rule: d.rule, limit: d.limit, remaining: d.remaining, resetMs: d.reset_ms,
    retryAfterMs: d.retry_after_ms, reason: d.reason, warning: d.warning === true,
    rules: d.rules.map((r) => new RuleDecision(r.name, r.limit, r.window_ms, r.remaining, r.reset_ms, r.retry_after_ms, r.allowed, r.shadow,
      '', r.warning === true, 0, false, r.unasked === true, r.concurrency === true)),
  });
}

const lower = (h) => Object.fromEntries(Object.entries(h).map(([k, v]) => [k.toLowerCase(), v]));

test('the table is there', () => assert.ok(CASES.length >= 7));

for (const c of CASES) {
  test(`headers ${c.name}`, () => {
    const d = decisionOf(c);
    assert.deepEqual(lower(d.headers()), lower(c.headers), c.meaning);
    assert.equal(d.status, c.status);
  });

  test(`rejection ${c.name}`, () => {
    const d = decisionOf(c);
    if (c.status === 200) {
      assert.equal(d.rejection(), null);
      return;
    }
    const { status, headers, body } = d.rejection();
    assert.equal(status, 429);
    const h = lower(headers);
    assert.equal(h['content-type'], 'application/problem+json');
    assert.equal(h['content-length'], String(body.length));
    delete h['content-type'];
    delete h['content-length'];
    assert.deepEqual(h, lower(c.headers));
    const p = JSON.parse(body);
    const ra = c.headers['Retry-After'];
    assert.deepEqual(Object.keys(p), ['type', 'title', 'status', 'detail', ...(d.rule ? ['rule'] : []), ...(ra ? ['retry_after'] : [])]);
    assert.deepEqual([p.type, p.title, p.status, p.rule], ['about:blank', 'Too Many Requests', 429, d.rule || undefined]);
    if (ra) {
      assert.equal(String(p.retry_after), ra);
      assert.ok(p.detail.endsWith(`; retry in ${ra} second${ra === '1' ? '' : 's'}.`), p.detail);
    } else {
      assert.ok(p.detail.endsWith('can never pass under this limit.'), p.detail);
    }
  });
}

test('body bytes as Go writes them', () => {
  let d = new Decision({ allowed: false, rule: 'per-user', limit: 5, resetMs: 60000, retryAfterMs: 11200,
    rules: [new RuleDecision('per-user', 5, 60000, 0, 60000, 11200, false, false)] });
  assert.equal(d.rejection().body.toString(), '{"type":"about:blank","title":"Too Many Requests","status":429,'
    + '"detail":"This request exceeds rate limit \\"per-user\\"; retry in 12 seconds.","rule":"per-user","retry_after":12}');
  // Go's strconv.Quote and encoding/json: control bytes escaped, <>& as \u00XX, Unicode kept
  // (the bytes WriteRejection writes for these names).
  d = new Decision({ allowed: false, rule: 'a\t<b>&\u043a', limit: 1, resetMs: 1000, retryAfterMs: 1000 });
  assert.equal(d.rejection().body.toString(), '{"type":"about:blank","title":"Too Many Requests","status":429,'
    + '"detail":"This request exceeds rate limit \\"a\\\\t\\u003cb\\u003e\\u0026\u043a\\"; retry in 1 second.",'
    + '"rule":"a\\t\\u003cb\\u003e\\u0026\u043a","retry_after":1}');
  d = new Decision({ allowed: false, rule: 'x\x7f\u2028\u{1F600}\u00a0', retryAfterMs: 5000 });
  assert.equal(d.rejection().body.toString(), '{"type":"about:blank","title":"Too Many Requests","status":429,'
    + '"detail":"This request exceeds rate limit \\"x\\\\x7f\\\\u2028\u{1F600}\\\\u00a0\\"; retry in 5 seconds.",'
    + '"rule":"x\x7f\\u2028\u{1F600}\u00a0","retry_after":5}');
});

// Every case of clients/testdata/problem_bodies.json: status and body byte for byte as the
// Go client's WriteRejection writes them. (Before, only the Go and Lua clients read the
// file: this client's bodies were checked against the few cases written here.)
const BODIES = JSON.parse(fs.readFileSync(path.join(ROOT, 'clients', 'testdata', 'problem_bodies.json'), 'utf8'));

for (const c of BODIES) {
  test(`problem body ${c.name}`, () => {
    let d = decisionOf(c);
    if (c.unreachable) d = new Decision({ ...d, unreachable: true, degraded: true, cause: 'connecting: refused' });
    const { status, headers, body } = d.rejection();
    assert.equal(status, c.status, c.meaning);
    assert.equal(body.toString('utf8'), c.body, c.meaning);
    const h = lower(headers);
    for (const [k, v] of Object.entries(c.headers)) assert.equal(h[k.toLowerCase()], v, `${c.name}: ${k}`);
  });
}

test('unreachable, closed: 503', () => {
  const d = new Decision({ allowed: false, degraded: true, unreachable: true, cause: 'connecting: refused' });
  const { status, headers, body } = d.rejection();
  assert.equal(status, 503);
  assert.deepEqual(headers, { 'Retry-After': '1', 'Content-Type': 'application/problem+json', 'Content-Length': String(body.length) });
  assert.deepEqual(JSON.parse(body), { type: 'about:blank', title: 'Service Unavailable', status: 503,
    detail: 'The rate limiter is unavailable and this service does not admit requests without it; retry in 1 second.', retry_after: 1 });
});

test('unreachable, open: no headers', () => {
  const d = new Decision({ allowed: true, degraded: true, unreachable: true, cause: 'connecting: refused' });
  assert.deepEqual(d.headers(), {});
  assert.equal(d.rejection(), null);
  assert.equal(d.status, 200);
});

// A refused check's answer, as the daemon encodes it (proto.Encoder.EncodeCheck): per-ip
// refused; per-account left unasked (refused before its store was asked), its remaining 0
// and reset_ms 0 not read.
const UNASKED_FRAME = Buffer.from(
  '0000011d89a2696401a7616c6c6f776564c2a472756c65a67065722d6970a56c696d697402a972656d61696e696e6700a872657365745f6d73'
  + 'cd7530ae72657472795f61667465725f6d73cd38a4a86465677261646564c2a572756c65739288a46e616d65a67065722d6970a56c696d6974'
  + '02a977696e646f775f6d73cdea60a972656d61696e696e6700a872657365745f6d73cd7530ae72657472795f61667465725f6d73cd38a4a761'
  + '6c6c6f776564c2a6736861646f77c289a46e616d65ab7065722d6163636f756e74a56c696d697405a977696e646f775f6d73ce0036ee80a972'
  + '656d61696e696e6700a872657365745f6d7300ae72657472795f61667465725f6d7300a7616c6c6f776564c3a6736861646f77c2a7756e6173'
  + '6b6564c3', 'hex');

test('an unasked rule is exposed, kept in RateLimit-Policy and left out of RateLimit', () => {
  const d = proto.decision(proto.decode(UNASKED_FRAME.subarray(4)));
  assert.deepEqual(d.rules.map((r) => [r.name, r.unasked]), [['per-ip', false], ['per-account', true]]);
  // "per-account";r=0;t=0 would say it has nothing left: its figures were not read.
  assert.deepEqual(d.headers(), { 'RateLimit-Policy': '"per-ip";q=2;w=60, "per-account";q=5;w=3600', 'RateLimit': '"per-ip";r=0;t=15', 'Retry-After': '15' });
});

// A refused check's answer with Redis away, as the daemon encodes it: otp (global,
// on_store_failure: closed) refused by its failure policy, its entry degraded; per-ip,
// a local rule, decided as usual.
const DEGRADED_FRAME = Buffer.from(
  '0000010f89a2696402a7616c6c6f776564c2a472756c65a36f7470a56c696d697405a972656d61696e696e6700a872657365745f6d7300ae'
  + '72657472795f61667465725f6d73cd03e8a86465677261646564c3a572756c65739288a46e616d65a67065722d6970a56c696d697464a977'
  + '696e646f775f6d73cdea60a972656d61696e696e6763a872657365745f6d73cd0258ae72657472795f61667465725f6d7300a7616c6c6f77'
  + '6564c3a6736861646f77c289a46e616d65a36f7470a56c696d697405a977696e646f775f6d73cdea60a972656d61696e696e6700a8726573'
  + '65745f6d7300ae72657472795f61667465725f6d73cd03e8a7616c6c6f776564c2a6736861646f77c2a86465677261646564c3', 'hex');

test('a rule decided by its failure policy is exposed as degraded', () => {
  const d = proto.decision(proto.decode(DEGRADED_FRAME.subarray(4)));
  assert.equal(d.degraded, true);
  assert.deepEqual(d.rules.map((r) => [r.name, r.degraded]), [['per-ip', false], ['otp', true]]);
});

// The lease vectors (proto/testdata/vectors.json): a concurrency rule's entry says
// concurrency: true; its items are a quota of concurrent requests with no window.
const LEASES = JSON.parse(fs.readFileSync(path.join(ROOT, 'proto', 'testdata', 'vectors.json'), 'utf8')).lease_responses;

test('a concurrency rule is decoded, and its quota is of concurrent-requests', () => {
  const want = {
    'check-lease': { 'RateLimit-Policy': '"exports";q=2;qu="concurrent-requests"', 'RateLimit': '"exports";r=1' },
    'check-lease-refused': { 'RateLimit-Policy': '"exports";q=2;qu="concurrent-requests"', 'RateLimit': '"exports";r=0;t=1', 'Retry-After': '1' },
  };
  for (const [name, headers] of Object.entries(want)) {
    const v = LEASES.find((x) => x.name === name);
    const d = proto.decision(proto.decode(Buffer.from(v.hex, 'hex').subarray(4)));
    assert.deepEqual(d.rules.map((r) => [r.name, r.concurrency]), [['exports', true]], name);
    assert.deepEqual(d.headers(), headers, name);
  }
  // A rate rule's entry is not one.
  const d = proto.decision(proto.decode(UNASKED_FRAME.subarray(4)));
  assert.deepEqual(d.rules.map((r) => r.concurrency), [false, false]);
});
