"""Decisions and their HTTP form, identical to the Go client's (clients/go/http.go).

The rules are in clients/go/README.md, "HTTP mapping"; the cases every client is tested
against are in clients/testdata/http_headers.json.
"""

import json

#: The "type" of the problem+json bodies: the problem is what the status code says
#: (RFC 9457 §4.2.1); the "rule" and "retry_after" members carry the details.
PROBLEM_TYPE = "about:blank"

COST_EXCEEDS_CAPACITY = "cost_exceeds_capacity"

#: The reason of a Decision refusing a request too large to be checked (its frame over
#: the daemon's maximum): the client did not send it, or the daemon refused it. Its HTTP
#: form is a 431 (Request Header Fields Too Large).
REQUEST_TOO_LARGE = "request_too_large"

_BODY_431 = {"type": PROBLEM_TYPE, "title": "Request Header Fields Too Large", "status": 431,
             "detail": "This request's attributes (its path or header fields) are too large for the rate limiter to check."}


class RuleDecision:
    """One matched rule's or inline limit's part of a Decision. Times are milliseconds."""

    __slots__ = ("name", "limit", "window_ms", "remaining", "reset_ms", "retry_after_ms", "allowed", "shadow",
                 "reason", "warning", "delay_ms", "banned", "unasked", "concurrency", "degraded")

    def __init__(self, name, limit, window_ms, remaining, reset_ms, retry_after_ms, allowed, shadow, reason="",
                 warning=False, delay_ms=0, banned=False, unasked=False, concurrency=False, degraded=False):
        self.name = name
        self.limit = limit  # requests per window
        self.window_ms = window_ms
        self.remaining = remaining  # left after this request
        self.reset_ms = reset_ms  # until the rule is back to full
        self.retry_after_ms = retry_after_ms  # 0 when this rule allowed
        self.allowed = allowed
        self.shadow = shadow  # a dry-run rule: reported, never rejecting, never deciding
        self.reason = reason  # "" or "cost_exceeds_capacity"
        self.warning = warning  # allowed, and the rule has used at least its warn_at fraction
        self.delay_ms = delay_ms  # allowed, but conforming to this rule only after this wait
        self.banned = banned  # the key is banned by this rule (its penalty)
        # The request was refused (by another rule, a ban or a deny limit) before this
        # rule's store was asked: it refused nothing, and its remaining and reset_ms are
        # 0 because they were not read. headers() gives it a RateLimit-Policy item but no
        # RateLimit item.
        self.unasked = unasked
        # Decided by its failure policy (on_store_failure), without the store it needed:
        # the rule the Decision's degraded is about.
        self.degraded = degraded
        # A concurrency rule's entry: limit is its max of requests in flight (not per
        # window), remaining its free slots, window_ms its lease, retry_after_ms (when
        # refused) a hint. headers() gives it the quota unit "concurrent-requests" and no
        # window.
        self.concurrency = concurrency

    def __eq__(self, other):
        return isinstance(other, RuleDecision) and all(getattr(self, f) == getattr(other, f) for f in self.__slots__)

    def __repr__(self):
        return "RuleDecision(%s)" % ", ".join("%s=%r" % (f, getattr(self, f)) for f in self.__slots__)


class Decision:
    """The answer to a check.

    Example: the token-bucket rule "per-user" allows 5 requests a minute (one refilled
    every 12 s). A user sent 5 at once 10 s ago; the next check returns allowed False,
    rule "per-user", limit 5, remaining 0, retry_after_ms 2000, reset_ms 50000, and rules
    holds per-user and every other matched rule. headers() turns that into
    RateLimit-Policy, RateLimit and Retry-After.

    When nothing matched, allowed is True and rule is "". When the sidecar gave no answer
    (missing, refusing, too slow), the decision is the client's on_unavailable policy:
    allowed is (policy == "open"), degraded and unreachable are True, rule is "" and
    cause says why. degraded alone (unreachable False) means the sidecar decided without
    the store it needed, by a rule's failure policy.

    A Decision is a plain value: safe to share between threads once returned.
    """

    __slots__ = ("allowed", "rule", "limit", "remaining", "reset_ms", "retry_after_ms", "degraded", "rules", "reason",
                 "unreachable", "cause", "lease", "warning", "delay_ms", "banned")

    def __init__(self, allowed, rule="", limit=0, remaining=0, reset_ms=0, retry_after_ms=0, degraded=False,
                 rules=None, reason="", unreachable=False, cause=None, lease="", warning=False, delay_ms=0,
                 banned=False):
        self.allowed = allowed
        self.rule = rule  # the deciding rule; "" when nothing decided
        self.limit = limit  # the deciding rule's limit (requests per window)
        self.remaining = remaining  # what the deciding rule has left after this request
        self.reset_ms = reset_ms  # until the deciding rule is back to full
        self.retry_after_ms = retry_after_ms  # 0 when allowed; else the earliest time a retry can pass
        self.degraded = degraded
        self.rules = rules if rules is not None else []
        self.reason = reason  # "" or "cost_exceeds_capacity": no retry can ever pass
        self.unreachable = unreachable  # the client applied on_unavailable: no answer from the sidecar
        self.cause = cause  # why the client applied on_unavailable (a str), else None
        # The concurrency lease an allowed check holds ("" when none): one slot in each
        # concurrency rule it matched, until Client.release(lease) or its expiry.
        self.lease = lease
        self.warning = warning  # allowed, and a rule has used at least its warn_at fraction
        self.delay_ms = delay_ms  # allowed: hold the request this long before forwarding (a rule's delay)
        self.banned = banned  # refused because the deciding rule bans the key; retry_after_ms is the ban's rest

    def __repr__(self):
        return "Decision(%s)" % ", ".join("%s=%r" % (f, getattr(self, f)) for f in self.__slots__)

    @property
    def status(self):
        """The HTTP status this decision calls for: 200 (go on), 429 (a rule rejected),
        431 (the request is too large to be checked: reason REQUEST_TOO_LARGE) or 503 (no
        answer from the sidecar and on_unavailable is "closed")."""
        if self.allowed:
            return 200
        if self.reason == REQUEST_TOO_LARGE:
            return 431
        if self.unreachable or self.cause is not None:
            return 503
        return 429

    def headers(self):
        """Return the rate-limit response headers of this decision, as a dict:

        - when a rule decided: RateLimit-Policy and RateLimit (draft-ietf-httpapi-
          ratelimit-headers), one item per non-shadow rule, the deciding rule first:
          ``"per-user";q=5;w=60`` and ``"per-user";r=0;t=12`` (seconds, rounded up;
          t is the time until more quota is made available: a refusing rule's retry,
          none when no retry can pass it, an allowing rule's reset); when allowed, of
          the rules tied with the deciding rule on remaining, the one with the longest
          reset comes first; an unasked rule keeps its RateLimit-Policy item but has no
          RateLimit item (its remaining and reset were not read); a concurrency rule's is a
          quota of requests in flight with no window,
          ``"conc";q=2;qu="concurrent-requests"`` and ``"conc";r=1``, with a t only when
          it refused with a retry hint;
        - when allowed and some non-shadow rule warns (warn_at): RateLimit-Warning,
          rlsidecar's own header (not in the draft), a structured-field list of those
          rules' names in the order of rules, quoted as in RateLimit-Policy:
          ``"per-user", "per-ip"``;
        - when rejected: Retry-After in seconds, at least 1, except for
          cost_exceeds_capacity and request_too_large (no retry can pass).

        A decision where nothing matched, or an unreachable one, gets {} (when allowed).
        """
        h = {}
        if self.rule:
            pol, cur = [], []
            decided = self._deciding_rule()
            if decided is not None and self.allowed:
                decided = self._least_room(decided)
            if decided is not None:
                _item(pol, cur, decided.name, decided.limit, decided.window_ms, decided, decided.concurrency)
            else:
                # The deciding rule is missing from rules: the top-level fields have no window.
                _item(pol, cur, self.rule, self.limit, None, self)
            for r in self.rules:
                if r.shadow or r is decided:
                    continue
                # An unasked rule's figures were not read: its quota stays in
                # RateLimit-Policy, the same from one response to the next, but it has no
                # RateLimit item.
                _item(pol, None if r.unasked else cur, r.name, r.limit, r.window_ms, r, r.concurrency)
            h["RateLimit-Policy"] = ", ".join(pol)
            h["RateLimit"] = ", ".join(cur)
        if self.allowed:
            warn = [_sf_string(r.name) for r in self.rules if r.warning and not r.shadow]
            if warn:
                h["RateLimit-Warning"] = ", ".join(warn)
        if not self.allowed and self.reason != COST_EXCEEDS_CAPACITY and self.reason != REQUEST_TOO_LARGE:
            h["Retry-After"] = str(self._retry_after_s())
        return h

    def _deciding_rule(self):
        """The deciding rule's entry of rules, None when none carries its name: the first
        non-shadow entry named rule whose figures are the top-level ones (the deciding
        rule's), else the first non-shadow entry of that name. Names need not be unique:
        inline limits without a name are named by their key, so two limits on one key (10
        per second and 3 per minute) share a name, and the first is not always the one
        that decided."""
        first = None
        for r in self.rules:
            if r.shadow or r.name != self.rule:
                continue
            if (r.allowed == self.allowed and r.limit == self.limit and r.remaining == self.remaining
                    and r.reset_ms == self.reset_ms and r.retry_after_ms == self.retry_after_ms):
                return r
            if first is None:
                first = r
        return first

    def _least_room(self, decided):
        """The entry of rules an allowed decision lists first: of the non-shadow rules
        with as little remaining as the deciding rule (decided), the one with the longest
        reset_ms, the most restrictive; among those, the deciding rule, else the first in
        rules. The daemon's deciding rule, when allowed, is the first with the least
        remaining: with per-second and per-day both at 1 left, per-second, and a client
        reading only the first item of RateLimit would miss the daily limit."""
        best = decided
        for r in self.rules:
            if not r.shadow and not r.unasked and r.remaining == best.remaining and r.reset_ms > best.reset_ms:
                best = r
        return best

    def _retry_after_s(self):
        return max(_ceil_s(self.retry_after_ms), 1)

    def problem(self):
        """Return the RFC 9457 problem details (a dict) of a decision that does not allow
        the request, as the Go client writes them; None when allowed."""
        if self.allowed:
            return None
        if self.status == 431:
            return dict(_BODY_431)
        if self.status == 503:
            return {"type": PROBLEM_TYPE, "title": "Service Unavailable", "status": 503,
                    "detail": "The rate limiter is unavailable and this service does not admit requests without it; "
                              "retry in 1 second.",
                    "retry_after": 1}
        limit = "rate limit " + _go_quote(self.rule) if self.rule else "the rate limit"
        p = {"type": PROBLEM_TYPE, "title": "Too Many Requests", "status": 429, "detail": ""}
        if self.rule:
            p["rule"] = self.rule
        if self.reason == COST_EXCEEDS_CAPACITY:
            p["detail"] = "This request costs more than " + limit + " can ever admit: it can never pass under this limit."
        else:
            s = self._retry_after_s()
            p["detail"] = "This request exceeds %s; retry in %d second%s." % (limit, s, "" if s == 1 else "s")
            p["retry_after"] = s
        return p

    def rejection(self):
        """Return (status, headers, body) of the response to a request this decision does
        not allow: 429 with the headers() and a problem+json body, or, when the sidecar
        gave no answer and on_unavailable is "closed", 503 with Retry-After: 1, or, for a
        request too large to be checked, 431 with no rate-limit headers. The body is bytes,
        the same bytes the Go client writes. None when allowed."""
        p = self.problem()
        if p is None:
            return None
        if p["status"] == 503:
            h = {"Retry-After": "1"}
        elif p["status"] == 431:
            h = {}
        else:
            h = self.headers()
        body = _go_json(p)
        h["Content-Type"] = "application/problem+json"
        h["Content-Length"] = str(len(body))
        return p["status"], h, body


def _ceil_s(ms):
    """ms rounded up to whole seconds; negative counts as 0."""
    return 0 if ms <= 0 else -(-ms // 1000)


def _item(pol, cur, name, limit, window_ms, f, concurrency=False):
    """Append the items of a rule named name (window_ms None: not known, no w) whose
    figures (remaining, allowed, reset_ms, retry_after_ms) are f's. t is the draft's time
    until more quota is made available, which a Retry-After is never earlier than: a
    refusing rule's retry (none when no retry can pass it), an allowing rule's reset.
    A concurrency rule's quota is of concurrent requests, with no window:
    qu="concurrent-requests", no w, and, allowing, no t (nothing says when a slot frees)."""
    n = _sf_string(name)
    if concurrency:
        pol.append('%s;q=%d;qu="concurrent-requests"' % (n, limit))
    else:
        pol.append("%s;q=%d" % (n, limit) if window_ms is None else "%s;q=%d;w=%d" % (n, limit, max(_ceil_s(window_ms), 1)))
    if cur is None:
        return  # its RateLimit-Policy item alone
    if f.allowed and concurrency:
        cur.append("%s;r=%d" % (n, f.remaining))
    elif f.allowed:
        cur.append("%s;r=%d;t=%d" % (n, f.remaining, _ceil_s(f.reset_ms)))
    elif f.retry_after_ms > 0:
        cur.append("%s;r=%d;t=%d" % (n, f.remaining, _ceil_s(f.retry_after_ms)))
    else:
        cur.append("%s;r=%d" % (n, f.remaining))


def _sf_string(s):
    """s as an RFC 8941 string: backslash and quote escaped, every byte outside printable
    ASCII (each byte of a UTF-8 sequence too) replaced with "_"."""
    out = ['"']
    for c in s.encode("utf-8", "surrogateescape"):
        if c == 0x5C or c == 0x22:
            out.append("\\" + chr(c))
        elif c < 0x20 or c > 0x7E:
            out.append("_")
        else:
            out.append(chr(c))
    out.append('"')
    return "".join(out)


_GO_ESC = {"\a": "\\a", "\b": "\\b", "\f": "\\f", "\n": "\\n", "\r": "\\r", "\t": "\\t", "\v": "\\v", "\\": "\\\\",
           '"': '\\"'}


def _go_quote(s):
    """s quoted as Go's strconv.Quote does (for the problem detail)."""
    out = ['"']
    for ch in s:
        e = _GO_ESC.get(ch)
        if e is not None:
            out.append(e)
        elif ch.isprintable():
            out.append(ch)
        elif ord(ch) < 0x80:
            out.append("\\x%02x" % ord(ch))
        elif ord(ch) <= 0xFFFF:
            out.append("\\u%04x" % ord(ch))
        else:
            out.append("\\U%08x" % ord(ch))
    out.append('"')
    return "".join(out)


def _go_json(obj):
    """obj as Go's encoding/json writes it: compact, UTF-8, <, > and & escaped."""
    s = json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
    s = s.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    s = s.replace("\u2028", "\\u2028").replace("\u2029", "\\u2029")
    return s.encode("utf-8")
