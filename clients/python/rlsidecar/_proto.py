"""The wire format of rlsidecar protocol v1 (proto/PROTOCOL.md): frames, requests, answers.

A frame is a 4-byte big-endian length, then one msgpack map. Requests are encoded in the
canonical field order of the Go encoder (id, op, attrs, limits, cost), so equal requests
give equal bytes and the shared test vectors hold byte for byte.
"""

import struct

import msgpack

from .decision import REQUEST_TOO_LARGE, Decision, RuleDecision

PROTOCOL = 1

#: The largest request frame body (bytes after the 4-byte length) the daemon accepts by
#: default (serve --max-frame); the clients' max_frame defaults to it.
MAX_FRAME = 65536

#: The largest answer frame the clients read; a longer announced length breaks the
#: connection (the sidecar never sends one).
MAX_RESPONSE_FRAME = 1 << 20

_LEN = struct.Struct(">I")
_LIMIT_REQUIRED = ("key", "limit", "window_ms")
_LIMIT_OPTIONAL = ("burst", "algorithm", "mode", "name")
_LIMIT_FIELDS = frozenset(_LIMIT_REQUIRED + _LIMIT_OPTIONAL)


class ProtocolError(Exception):
    """The sidecar answered a request with an error (bad_request, invalid_limit, ...).

    It means the request itself is wrong (a bug in what the caller sent), not that the
    sidecar is away. ``code`` and ``message`` are the sidecar's; ``decision`` is the
    client's on_unavailable decision, so a caller that ignores the error stays safe.
    """

    def __init__(self, code, message, decision=None):
        super().__init__("rlsidecar: %s: %s" % (code, message))
        self.code = code
        self.message = message
        self.decision = decision


class RequestTooLargeError(ProtocolError):
    """A request too large for the daemon: its frame is over the client's max_frame, so
    it was not sent, or the daemon refused it (frame_too_large: its --max-frame is
    smaller), or refused one of its values (attr_too_large: longer than its
    --max-attr-len). ``code`` is the daemon's, "frame_too_large" for one not sent;
    ``decision`` refuses the request with a 431 (Request Header Fields Too Large), whatever
    on_unavailable says: the failure policy would let "open" clients pass any request
    unlimited by making it large enough."""

    def __init__(self, message, code="frame_too_large"):
        super().__init__(code, message,
                         Decision(False, reason=REQUEST_TOO_LARGE, cause="%s: %s" % (code, message)))


def check_size(body_len, max_frame):
    """Raise RequestTooLargeError when a frame body of body_len bytes is over max_frame."""
    if body_len > max_frame:
        raise RequestTooLargeError("request frame of %d bytes exceeds max_frame %d; it was not sent"
                                   % (body_len, max_frame))


_MAX_UINT64 = (1 << 64) - 1


def check_max_frame(max_frame):
    if type(max_frame) is not int or max_frame < 1:
        raise ValueError("max_frame must be an int >= 1 (bytes), not %r" % (max_frame,))


class ClosedError(Exception):
    """The client was closed before or during the check."""


def _norm_limit(i, lim):
    if not isinstance(lim, dict):
        raise TypeError("limits[%d] must be a dict, not %s" % (i, type(lim).__name__))
    unknown = set(lim) - _LIMIT_FIELDS
    if unknown:
        raise ValueError("limits[%d]: unknown field(s) %s; known: %s"
                         % (i, ", ".join(sorted(map(str, unknown))), ", ".join(_LIMIT_REQUIRED + _LIMIT_OPTIONAL)))
    out = {}
    for f in _LIMIT_REQUIRED:
        if f not in lim:
            raise ValueError("limits[%d]: %r is required" % (i, f))
        out[f] = lim[f]
    for f in _LIMIT_OPTIONAL:
        v = lim.get(f)
        if v is not None and v != "" and v != 0:
            out[f] = v
    return out


def check_message(req_id, attrs, cost, limits):
    """Return the request map of a check, in canonical field order.

    ``attrs`` is a dict of str to str or bytes, sent in its order: a str value as a
    msgpack str (its UTF-8 bytes), a bytes value as a msgpack bin of exactly its bytes
    (the daemon matches and keys on the bytes either way; bytes carry a value that is not
    UTF-8, such as a path with %FF in it); a None value (a header the request does not
    have) leaves the attribute out, as the Lua clients leave out nil. ``limits`` a list of dicts with
    ``key``, ``limit``, ``window_ms`` and optionally ``burst``, ``algorithm``, ``mode``,
    ``name``. Wrong types raise TypeError or ValueError before anything is sent.
    """
    msg = {"id": req_id, "op": "check"}
    if attrs is not None and not isinstance(attrs, dict):
        raise TypeError("attrs must be a dict of str to str or bytes, not %s" % type(attrs).__name__)
    if attrs:
        absent = False
        for k, v in attrs.items():
            if v is None and type(k) is str:
                absent = True  # a header the request does not have: the attribute is left out
            elif type(k) is not str or (type(v) is not str and type(v) is not bytes):
                raise TypeError("attrs must map str to str or bytes; %r: %r" % (k, v))
        if absent:
            attrs = {k: v for k, v in attrs.items() if v is not None}
        if attrs:
            msg["attrs"] = attrs
    if limits is not None and not isinstance(limits, (list, tuple)):
        raise TypeError("limits must be a list of dicts, not %s" % type(limits).__name__)
    if limits:
        msg["limits"] = [_norm_limit(i, lim) for i, lim in enumerate(limits)]
    if cost != 1:
        if type(cost) is not int or cost < 0:
            raise ValueError("cost must be an int >= 0, not %r" % (cost,))
        # A cost past the wire's uint64 exceeds every limit as 2^64 - 1 does (it raised
        # OverflowError from msgpack).
        msg["cost"] = min(cost, _MAX_UINT64)
    return msg


def encode(msg):
    """Return msg as one frame (length prefix included)."""
    body = msgpack.packb(msg, use_bin_type=True)
    return _LEN.pack(len(body)) + body


_ID0 = b"\xa2id\x00"


def body(msg):
    """Return the msgpack body of msg, a request map whose id is 0 (its first field, as
    every request map here has it); frame() puts the real id in. Its length is the
    shortest the frame can have: an id takes 1 byte (0 to 127) to 9."""
    b = msgpack.packb(msg, use_bin_type=True)
    if b[1:5] != _ID0:
        raise AssertionError("BUG: a request body must start with id 0: %r" % b[:8])
    return b


def frame(body0, req_id):
    """Return the frame of body0 (from body()) with the id req_id: the bytes encode()
    gives for the same map with that id."""
    b = body0[:4] + msgpack.packb(req_id) + body0[5:]
    return _LEN.pack(len(b)) + b


def frame_length(header):
    """Return the body length announced by a 4-byte frame header."""
    (n,) = _LEN.unpack(header)
    return n


def decode(body):
    """Return the msgpack map of a frame body; ValueError when it is not one."""
    try:
        msg = msgpack.unpackb(body, raw=False, strict_map_key=False)
    except Exception as e:  # msgpack raises several types; all mean a bad frame
        raise ValueError("undecodable answer: %s" % e) from None
    if not isinstance(msg, dict):
        raise ValueError("answer is a %s, not a map" % type(msg).__name__)
    return msg


def _str(v):
    return v.decode("utf-8", "replace") if isinstance(v, (bytes, bytearray)) else v


def decision(msg):
    """Return the Decision of a check answer, as decoded by decode()."""
    g = msg.get
    rules = [
        RuleDecision(_str(r.get("name", "")), r.get("limit", 0), r.get("window_ms", 0), r.get("remaining", 0),
                     r.get("reset_ms", 0), r.get("retry_after_ms", 0), r.get("allowed", False),
                     r.get("shadow", False), _str(r.get("reason", "")),
                     r.get("warning", False), r.get("delay_ms", 0), r.get("banned", False),
                     r.get("unasked", False), r.get("concurrency", False), r.get("degraded", False))
        for r in (g("rules") or ())
    ]
    return Decision(g("allowed", False), _str(g("rule", "")), g("limit", 0), g("remaining", 0), g("reset_ms", 0),
                    g("retry_after_ms", 0), g("degraded", False), rules, _str(g("reason", "")),
                    lease=_str(g("lease", "")), warning=g("warning", False), delay_ms=g("delay_ms", 0),
                    banned=g("banned", False))


def lease_ms(rules):
    """How long, in ms, the lease of a check answer's ``rules`` (dicts as decoded, or
    RuleDecisions) lasts at least: the longest window of its concurrency entries (a
    concurrency rule's window is its lease). A rate rule's window says nothing of it:
    before, it counted too, and a check that also matched a rule of 1 per day held its
    connection open for a day when its release went unanswered (a restart, an outage),
    where the lease itself ended in seconds. From a daemon that does not flag its
    concurrency entries (an earlier version), the longest window of all."""
    conc, every = 0, 0
    for r in rules or ():
        if isinstance(r, dict):
            w, c = r.get("window_ms", 0), r.get("concurrency", False)
        else:
            w, c = r.window_ms, r.concurrency
        if not isinstance(w, int):
            continue
        every = max(every, w)
        if c is True:
            conc = max(conc, w)
    return conc if conc else every


def lease_message(req_id, op, lease, lease_ms=None):
    """Return the request map of a release or renew (canonical field order)."""
    if not isinstance(lease, str):
        raise TypeError("lease must be a str, not %s" % type(lease).__name__)
    msg = {"id": req_id, "op": op, "lease": lease}
    if lease_ms:
        if type(lease_ms) is not int or lease_ms < 0:
            raise ValueError("lease_ms must be an int >= 0, not %r" % (lease_ms,))
        msg["lease_ms"] = lease_ms
    return msg


def error_of(msg):
    """Return (code, message) when msg is an error answer, else None."""
    e = msg.get("error")
    if e is None:
        return None
    if not isinstance(e, dict):
        return ("internal", repr(e))
    return (_str(e.get("code", "")), _str(e.get("message", "")))
