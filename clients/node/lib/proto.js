'use strict';
// The wire format of rlsidecar protocol v1 (proto/PROTOCOL.md): frames, requests, answers.
// A frame is a 4-byte big-endian length, then one msgpack map. Requests are encoded in the
// canonical field order of the Go encoder (id, op, attrs, limits, cost), so equal requests
// give equal bytes and the shared test vectors hold byte for byte.

const { Encoder, Decoder } = require('@msgpack/msgpack');
const { Decision, RuleDecision } = require('./decision');

const PROTOCOL = 1;
// The largest answer frame the client reads; a longer announced length breaks the connection.
const MAX_RESPONSE_FRAME = 1 << 20;
// The largest request frame body the daemon accepts unless started with another --max-frame.
const DEFAULT_MAX_FRAME = 65536;

// An inline limit's fields: the JS name, then its name on the wire.
const LIMIT_REQUIRED = [['key', 'key'], ['limit', 'limit'], ['windowMs', 'window_ms']];
const LIMIT_OPTIONAL = [['burst', 'burst'], ['algorithm', 'algorithm'], ['mode', 'mode'], ['name', 'name']];
const LIMIT_FIELDS = new Set([...LIMIT_REQUIRED, ...LIMIT_OPTIONAL].map(([js]) => js));

/** The sidecar answered a request with an error: the request itself is wrong. */
class ProtocolError extends Error {
  constructor(code, message, decision) {
    super(`rlsidecar: ${code}: ${message}`);
    this.name = 'ProtocolError';
    this.code = code;
    this.sidecarMessage = message;
    this.decision = decision;
  }
}

/**
 * The client did not send the request: its frame body would be size bytes, more than the
 * Client's maxFrame. For a check, decision is a Decision that rejects whatever
 * onUnavailable, with status 431 (Request Header Fields Too Large).
 */
class RequestTooLargeError extends Error {
  constructor(size, maxFrame) {
    super(`rlsidecar: request too large to check: its frame would be ${size} bytes, more than maxFrame (${maxFrame}); not sent`);
    this.name = 'RequestTooLargeError';
    this.code = 'request_too_large';
    this.size = size;
    this.maxFrame = maxFrame;
    this.decision = undefined;
  }
}

/** The client was closed before or during the check. */
class ClosedError extends Error {
  constructor() {
    super('rlsidecar: client closed');
    this.name = 'ClosedError';
  }
}

function isUint(v) {
  return (Number.isSafeInteger(v) && v >= 0) || (typeof v === 'bigint' && v >= 0n);
}

function normLimit(i, lim) {
  if (lim === null || typeof lim !== 'object' || Array.isArray(lim)) {
    throw new TypeError(`limits[${i}] must be an object`);
  }
  for (const k of Object.keys(lim)) {
    if (!LIMIT_FIELDS.has(k)) {
      throw new RangeError(`limits[${i}]: unknown field ${JSON.stringify(k)}; known: ${[...LIMIT_FIELDS].join(', ')}`);
    }
  }
  const out = {};
  for (const [js, wire] of LIMIT_REQUIRED) {
    if (lim[js] === undefined) throw new RangeError(`limits[${i}]: ${JSON.stringify(js)} is required`);
    out[wire] = lim[js];
  }
  for (const [js, wire] of LIMIT_OPTIONAL) {
    const v = lim[js];
    if (v !== undefined && v !== null && v !== '' && v !== 0) out[wire] = v;
  }
  if (typeof out.key !== 'string') throw new TypeError(`limits[${i}].key must be a string`);
  for (const [js, wire] of [['limit', 'limit'], ['windowMs', 'window_ms'], ['burst', 'burst']]) {
    if (out[wire] !== undefined && !isUint(out[wire])) throw new RangeError(`limits[${i}].${js} must be an integer >= 0`);
  }
  return out;
}

/**
 * Returns the request map of a check, in canonical field order. attrs: an object of
 * string to string, sent in its key order (a value may also be a Uint8Array, such as the
 * Buffer normalizePath returns for a path that is not UTF-8: its bytes are sent as they
 * are, as a msgpack bin, which the sidecar reads as a string); limits: inline limits ({ key,
 * limit, windowMs, burst?, algorithm?, mode?, name? }). Wrong types throw a
 * TypeError or RangeError before anything is sent.
 */
function checkMessage(id, attrs, cost, limits) {
  const msg = { id, op: 'check' };
  if (attrs !== undefined && attrs !== null) {
    // A Map, a fetch Headers or another iterable has no enumerable keys: sent as no
    // attributes, no rule keyed on them would apply.
    if (typeof attrs !== 'object' || Array.isArray(attrs) || typeof attrs[Symbol.iterator] === 'function') {
      throw new TypeError('attrs must be an object of strings (for a Map or Headers: Object.fromEntries(it))');
    }
    let n = 0;
    let absent = 0;
    for (const k in attrs) {
      const v = attrs[k];
      if (v === undefined || v === null) {
        absent++; // an absent value (a header the request does not have): the attribute is left out
        continue;
      }
      if (typeof v !== 'string' && !(v instanceof Uint8Array)) throw new TypeError(`attrs.${k} must be a string, not ${typeof v}`);
      n++;
    }
    if (n > 0 && absent > 0) {
      const present = {};
      for (const k in attrs) if (attrs[k] !== undefined && attrs[k] !== null) present[k] = attrs[k];
      msg.attrs = present;
    } else if (n > 0) msg.attrs = attrs;
  }
  if (limits !== undefined && limits !== null) {
    if (!Array.isArray(limits)) throw new TypeError('limits must be an array');
    if (limits.length > 0) msg.limits = limits.map((l, i) => normLimit(i, l));
  }
  if (cost !== undefined && cost !== 1) {
    if (!isUint(cost)) throw new RangeError(`cost must be an integer >= 0, not ${cost}`);
    // A cost past the wire's uint64 exceeds every limit as 2^64 - 1 does (the encoder
    // threw on it).
    msg.cost = typeof cost === 'bigint' && cost > 0xffffffffffffffffn ? 0xffffffffffffffffn : cost;
  }
  return msg;
}

const encoder = new Encoder({ useBigInt64: true, ignoreUndefined: true });

/**
 * Returns at least the length of v encoded as msgpack by encode, without encoding it:
 * the most a header or a number takes, and at most 3 UTF-8 bytes per UTF-16 code unit.
 */
function frameBound(v) {
  if (typeof v === 'string') return 5 + 3 * v.length;
  if (typeof v === 'number' || typeof v === 'bigint') return 9;
  if (v === null || v === undefined || typeof v === 'boolean') return 1;
  if (v instanceof Uint8Array) return 5 + v.byteLength;
  let n = 5;
  if (Array.isArray(v)) {
    for (const x of v) n += frameBound(x);
  } else {
    for (const k of Object.keys(v)) n += frameBound(k) + frameBound(v[k]);
  }
  return n;
}

/**
 * Returns m, or a copy of it whose numbers above 2^32 - 1 are BigInts: with useBigInt64,
 * @msgpack/msgpack writes a number that large as a float64, which the sidecar refuses
 * (bad_request: the failure policy decided, and "open" let a cost of 2^32 bytes or a
 * 90-day inline window past the limit; a connection's ids pass 2^32 after as many checks).
 * Integers up to 2^53 are exact as numbers, so the BigInt is exact too.
 */
function wide(m) {
  let out = m;
  for (const k in m) {
    const v = m[k];
    if (typeof v === 'number' && v > 0xffffffff) {
      if (out === m) out = { ...m }; // the same keys in the same order
      out[k] = BigInt(v);
    }
  }
  return out;
}

/** Returns msg as one frame (length prefix included), in a new Buffer. */
function encode(msg) {
  msg = wide(msg);
  if (Array.isArray(msg.limits) && msg.limits.some((l) => wide(l) !== l)) {
    msg = { ...msg, limits: msg.limits.map(wide) }; // rare: no copy for the common limits
  }
  const body = encoder.encodeSharedRef(msg);
  const frame = Buffer.allocUnsafe(4 + body.length);
  frame.writeUInt32BE(body.length, 0);
  frame.set(body, 4);
  return frame;
}

const decoder = new Decoder();

/** Returns the msgpack map of a frame body; throws when it is not one. */
function decode(body) {
  let msg;
  try {
    msg = decoder.decode(body);
  } catch (e) {
    throw new Error(`undecodable answer: ${e.message}`);
  }
  if (msg === null || typeof msg !== 'object' || Array.isArray(msg) || msg instanceof Uint8Array) {
    throw new Error('answer is not a map');
  }
  return msg;
}

function str(v) {
  if (v === undefined || v === null) return '';
  return v instanceof Uint8Array ? Buffer.from(v).toString('utf8') : v;
}

/** Returns the Decision of a check answer. */
function decision(m) {
  const rules = [];
  if (Array.isArray(m.rules)) {
    for (const r of m.rules) {
      rules.push(new RuleDecision(str(r.name), r.limit || 0, r.window_ms || 0, r.remaining || 0, r.reset_ms || 0,
        r.retry_after_ms || 0, r.allowed === true, r.shadow === true, str(r.reason),
        r.warning === true, r.delay_ms || 0, r.banned === true, r.unasked === true,
        r.concurrency === true, r.degraded === true));
    }
  }
  return new Decision({
    allowed: m.allowed === true, rule: str(m.rule), limit: m.limit || 0, remaining: m.remaining || 0,
    resetMs: m.reset_ms || 0, retryAfterMs: m.retry_after_ms || 0, degraded: m.degraded === true, rules,
    reason: str(m.reason), lease: str(m.lease),
    warning: m.warning === true, delayMs: m.delay_ms || 0, banned: m.banned === true,
  });
}

/** Returns the request map of a release or renew (canonical field order). */
function leaseMessage(id, op, lease, leaseMs) {
  if (typeof lease !== 'string') throw new TypeError(`lease must be a string, not ${typeof lease}`);
  const msg = { id, op, lease };
  if (leaseMs !== undefined && leaseMs !== null && leaseMs !== 0) {
    if (!isUint(leaseMs)) throw new RangeError(`leaseMs must be an integer >= 0, not ${leaseMs}`);
    msg.lease_ms = leaseMs;
  }
  return msg;
}

/** Returns [code, message] when m is an error answer, else null. */
function errorOf(m) {
  const e = m.error;
  if (e === undefined) return null;
  if (e === null || typeof e !== 'object') return ['internal', String(e)];
  return [str(e.code), str(e.message)];
}

module.exports = {
  PROTOCOL, MAX_RESPONSE_FRAME, DEFAULT_MAX_FRAME, ProtocolError, RequestTooLargeError, ClosedError, checkMessage, leaseMessage,
  encode, frameBound, decode, decision, errorOf,
};
