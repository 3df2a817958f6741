'use strict';
// Decisions and their HTTP form, identical to the Go client's (clients/go/http.go). The
// rules are in clients/go/README.md, "HTTP mapping"; the cases every client is tested
// against are in clients/testdata/http_headers.json.

// The "type" of the problem+json bodies: the problem is what the status code says.
const PROBLEM_TYPE = 'about:blank';
const COST_EXCEEDS_CAPACITY = 'cost_exceeds_capacity';

/** One matched rule's or inline limit's part of a Decision. Times are milliseconds. */
class RuleDecision {
  constructor(name, limit, windowMs, remaining, resetMs, retryAfterMs, allowed, shadow, reason = '',
    warning = false, delayMs = 0, banned = false, unasked = false, concurrency = false, degraded = false) {
    this.name = name;
    this.limit = limit; // requests per window
    this.windowMs = windowMs;
    this.remaining = remaining; // left after this request
    this.resetMs = resetMs; // until the rule is back to full
    this.retryAfterMs = retryAfterMs; // 0 when this rule allowed
    this.allowed = allowed;
    this.shadow = shadow; // a dry-run rule: reported, never rejecting, never deciding
    this.reason = reason; // '' or 'cost_exceeds_capacity'
    this.warning = warning; // allowed, and the rule has used at least its warn_at fraction
    this.delayMs = delayMs; // allowed, but conforming to this rule only after this wait
    this.banned = banned; // the key is banned by this rule (its penalty)
    // The request was refused (by another rule, a ban or a deny limit) before this rule's
    // store was asked: it refused nothing, and its remaining and resetMs are 0 because they
    // were not read. headers() gives it a RateLimit-Policy item but no RateLimit item.
    this.unasked = unasked;
    // Decided by its failure policy (on_store_failure), without the store it needed: the
    // rule the Decision's degraded is about.
    this.degraded = degraded;
    // A concurrency rule's entry: limit is its max of requests in flight (not per window),
    // remaining its free slots, windowMs its lease, retryAfterMs (when refused) a hint.
    // headers() gives it the quota unit "concurrent-requests" and no window.
    this.concurrency = concurrency;
  }
}

/**
 * The answer to a check. When nothing matched, allowed is true and rule is ''. When the
 * sidecar gave no answer, it is the client's onUnavailable decision: allowed is
 * (onUnavailable === 'open'), degraded and unreachable are true, cause says why. When the
 * request was too large to check (RequestTooLargeError, or the sidecar's frame_too_large),
 * allowed is false and tooLarge true, whatever onUnavailable: its HTTP form is a 431.
 */
class Decision {
  constructor(f) {
    this.allowed = f.allowed;
    this.rule = f.rule || ''; // the deciding rule; '' when nothing decided
    this.limit = f.limit || 0; // the deciding rule's limit (requests per window)
    this.remaining = f.remaining || 0; // what the deciding rule has left after this request
    this.resetMs = f.resetMs || 0; // until the deciding rule is back to full
    this.retryAfterMs = f.retryAfterMs || 0; // 0 when allowed; else the earliest time a retry can pass
    this.degraded = f.degraded === true;
    this.rules = f.rules || [];
    this.reason = f.reason || ''; // '' or 'cost_exceeds_capacity': no retry can ever pass
    // The concurrency lease an allowed check holds ('' when none): Client.release(lease)
    // frees its slots.
    this.lease = f.lease || '';
    this.unreachable = f.unreachable === true; // the client applied onUnavailable
    this.cause = f.cause === undefined ? null : f.cause; // why (a string), else null
    this.warning = f.warning === true; // allowed, and a rule has used at least its warn_at fraction
    this.delayMs = f.delayMs || 0; // allowed: hold the request this long before forwarding (a rule's delay)
    this.banned = f.banned === true; // refused: the deciding rule bans the key; retryAfterMs is the ban's rest
    this.tooLarge = f.tooLarge === true; // refused: the request was too large to check
  }

  /**
   * 200 (go on), 429 (a rule rejected), 431 (too large to check) or 503 (no answer and
   * onUnavailable 'closed').
   */
  get status() {
    if (this.allowed) return 200;
    if (this.tooLarge) return 431;
    if (this.unreachable || this.cause !== null) return 503;
    return 429;
  }

  /**
   * The rate-limit headers: RateLimit-Policy and RateLimit (one item per non-shadow
   * rule, the deciding rule first, except that when allowed, of the rules tied with it
   * on remaining, the one with the longest reset comes first; an unasked rule, whose
   * remaining and reset were not read, keeps its RateLimit-Policy item but has no
   * RateLimit item; a concurrency rule's is a quota of "concurrent-requests" with no
   * window, and a t only when it refused with a retry hint) when a rule decided;
   * RateLimit-Warning (rlsidecar's
   * own header, not in the draft) when allowed and some non-shadow rule warns (warn_at):
   * those rules' names in the order of rules, quoted as in RateLimit-Policy,
   * `"per-user", "per-ip"`; Retry-After (seconds, at least 1) when rejected, except for
   * cost_exceeds_capacity.
   */
  headers() {
    const h = {};
    if (this.tooLarge) return h; // no rule decided, and no retry can pass
    if (this.rule !== '') {
      const pol = [];
      const cur = [];
      let decided = decidingRule(this);
      if (decided !== null && this.allowed) decided = leastRoom(this, decided);
      if (decided !== null) {
        item(pol, cur, decided, decided.windowMs);
      } else {
        // The deciding rule is missing from rules: the top-level fields have no window.
        item(pol, cur, { ...this, name: this.rule }, null);
      }
      for (const r of this.rules) {
        if (r.shadow || r === decided) continue;
        // An unasked rule's figures were not read: its quota stays in RateLimit-Policy,
        // the same from one response to the next, but it has no RateLimit item.
        item(pol, r.unasked ? null : cur, r, r.windowMs);
      }
      h['RateLimit-Policy'] = pol.join(', ');
      h['RateLimit'] = cur.join(', ');
    }
    if (this.allowed) {
      const warn = this.rules.filter((r) => r.warning && !r.shadow).map((r) => sfString(r.name));
      if (warn.length > 0) h['RateLimit-Warning'] = warn.join(', ');
    }
    if (!this.allowed && this.reason !== COST_EXCEEDS_CAPACITY) h['Retry-After'] = String(retryAfterS(this));
    return h;
  }

  /** The RFC 9457 problem details of a decision that does not allow; null when allowed. */
  problem() {
    if (this.allowed) return null;
    if (this.tooLarge) {
      return {
        type: PROBLEM_TYPE, title: 'Request Header Fields Too Large', status: 431,
        detail: "This request's attributes (its path or header fields) are too large for the rate limiter to check.",
      };
    }
    if (this.status === 503) {
      return {
        type: PROBLEM_TYPE, title: 'Service Unavailable', status: 503,
        detail: 'The rate limiter is unavailable and this service does not admit requests without it; retry in 1 second.',
        retry_after: 1,
      };
    }
    const limit = this.rule !== '' ? 'rate limit ' + goQuote(this.rule) : 'the rate limit';
    const p = { type: PROBLEM_TYPE, title: 'Too Many Requests', status: 429, detail: '' };
    if (this.rule !== '') p.rule = this.rule;
    if (this.reason === COST_EXCEEDS_CAPACITY) {
      p.detail = `This request costs more than ${limit} can ever admit: it can never pass under this limit.`;
    } else {
      const s = retryAfterS(this);
      p.detail = `This request exceeds ${limit}; retry in ${s} second${s === 1 ? '' : 's'}.`;
      p.retry_after = s;
    }
    return p;
  }

  /**
   * { status, headers, body } of the response to a request this decision does not allow:
   * 429 with headers() and a problem+json body, 431 with a problem+json body when the
   * request was too large to check, or 503 with Retry-After: 1 when the sidecar gave no
   * answer under 'closed'. body is a Buffer, the bytes the Go client writes. null when
   * allowed.
   */
  rejection() {
    const p = this.problem();
    if (p === null) return null;
    const headers = p.status === 503 ? { 'Retry-After': '1' } : this.headers();
    const body = Buffer.from(goJSON(p), 'utf8');
    headers['Content-Type'] = 'application/problem+json';
    headers['Content-Length'] = String(body.length);
    return { status: p.status, headers, body };
  }
}

function ceilS(ms) {
  return ms <= 0 ? 0 : Math.ceil(ms / 1000);
}

function retryAfterS(d) {
  return Math.max(ceilS(d.retryAfterMs), 1);
}

/**
 * The deciding rule's entry of d.rules, null when none carries its name: the first
 * non-shadow entry named d.rule whose figures are the top-level ones (the deciding
 * rule's), else the first non-shadow entry of that name. Names need not be unique: inline
 * limits without a name are named by their key, so two limits on one key (10 per second
 * and 3 per minute) share a name, and the first is not always the one that decided.
 */
function decidingRule(d) {
  let first = null;
  for (const r of d.rules) {
    if (r.shadow || r.name !== d.rule) continue;
    if (r.allowed === d.allowed && r.limit === d.limit && r.remaining === d.remaining &&
        r.resetMs === d.resetMs && r.retryAfterMs === d.retryAfterMs) {
      return r;
    }
    if (first === null) first = r;
  }
  return first;
}

/**
 * The entry of d.rules an allowed d lists first: of the non-shadow rules with as little
 * remaining as the deciding rule (decided), the one with the longest resetMs, the most
 * restrictive; among those, the deciding rule, else the first in d.rules. The daemon's
 * deciding rule, when allowed, is the first with the least remaining: with per-second and
 * per-day both at 1 left, per-second, and a client reading only the first item of
 * RateLimit would miss the daily limit.
 */
function leastRoom(d, decided) {
  let best = decided;
  for (const r of d.rules) {
    if (!r.shadow && !r.unasked && r.remaining === best.remaining && r.resetMs > best.resetMs) best = r;
  }
  return best;
}

// item adds rule r's items (windowMs null: not known, no w; cur null: its RateLimit-Policy
// item alone). t is the draft's time until
// more quota is made available, which a Retry-After is never earlier than: a refusing
// rule's retry (none when no retry can pass it), an allowing rule's reset. A concurrency
// rule's quota is of concurrent requests, with no window: qu="concurrent-requests", no w,
// and, allowing, no t (nothing says when a slot frees).
function item(pol, cur, r, windowMs) {
  const n = sfString(r.name);
  if (r.concurrency === true) pol.push(`${n};q=${r.limit};qu="concurrent-requests"`);
  else pol.push(windowMs === null ? `${n};q=${r.limit}` : `${n};q=${r.limit};w=${Math.max(ceilS(windowMs), 1)}`);
  if (cur === null) return;
  if (r.allowed && r.concurrency === true) cur.push(`${n};r=${r.remaining}`);
  else if (r.allowed) cur.push(`${n};r=${r.remaining};t=${ceilS(r.resetMs)}`);
  else if (r.retryAfterMs > 0) cur.push(`${n};r=${r.remaining};t=${ceilS(r.retryAfterMs)}`);
  else cur.push(`${n};r=${r.remaining}`);
}

// sfString: an RFC 8941 string; backslash and quote escaped, every byte outside printable
// ASCII (each byte of a UTF-8 sequence too) replaced with '_'.
function sfString(s) {
  let out = '"';
  for (const c of Buffer.from(s, 'utf8')) {
    if (c === 0x5c || c === 0x22) out += '\\' + String.fromCharCode(c);
    else if (c < 0x20 || c > 0x7e) out += '_';
    else out += String.fromCharCode(c);
  }
  return out + '"';
}

const GO_ESC = { '\x07': '\\a', '\b': '\\b', '\f': '\\f', '\n': '\\n', '\r': '\\r', '\t': '\\t', '\v': '\\v', '\\': '\\\\', '"': '\\"' };
const NOT_PRINT = /[\p{C}\p{Z}]/u;

// goQuote: s quoted as Go's strconv.Quote does (for the problem detail).
function goQuote(s) {
  let out = '"';
  for (const ch of s) {
    const cp = ch.codePointAt(0);
    if (GO_ESC[ch] !== undefined) out += GO_ESC[ch];
    else if (ch === ' ' || !NOT_PRINT.test(ch)) out += ch;
    else if (cp < 0x80) out += '\\x' + cp.toString(16).padStart(2, '0');
    else if (cp <= 0xffff) out += '\\u' + cp.toString(16).padStart(4, '0');
    else out += '\\U' + cp.toString(16).padStart(8, '0');
  }
  return out + '"';
}

// goJSON: obj as Go's encoding/json writes it: compact, UTF-8, <, > and & escaped.
function goJSON(obj) {
  return JSON.stringify(obj).replace(/[<>&\u2028\u2029]/g, (c) => '\\u' + c.charCodeAt(0).toString(16).padStart(4, '0'));
}

module.exports = { Decision, RuleDecision, PROBLEM_TYPE, COST_EXCEEDS_CAPACITY };
