"""A stand-in for the daemon, for clients/lua/test/e2e.sh: it answers every check allowed
with a lease of its own numbering (L1, L2, ...), held for delay_ms when the check's path
starts with /held/ (as a rule with `delay` would), and answers every release (released:
true) only RELEASE_MS after it came, so that a gateway's next request finds it under way
(at once for the leases of checks whose path starts with /twice/, which HAProxy checks
twice: their two releases would take longer than the check's timeout).
It writes one line per event to LOG, with the time in ms since it started:

    check PATH LEASE T          a check came
    release LEASE T_IN T_OUT    a release came at T_IN and was answered at T_OUT

A check whose user is "stale-pool" is answered allowed without a lease (its connection
goes back to the gateway's pool), and the next check that comes on that connection is not
read: once it is there the stand-in closes the connection with it unread (the gateway's
read is reset), as the daemon closes a connection (a restart, --idle-timeout) that the
gateway takes from its pool before it sees the close:

    stale T                     a check came on a connection closed with it unread

A check whose user is "eof-pool" is answered the same way, and the next check on that
connection is read whole and the connection closed without an answer (the gateway reads
end-of-file), as a daemon that dies, or whose drain times out, while deciding it: the
check may have been counted, and is not to be sent again:

    eof USER T                  a check read, its connection closed unanswered

A check whose user is "farewell-pool" is answered the same way, and the next check on that
connection is read and answered with the drain's farewell (an error shutting_down, id 0),
then the connection closed, as a draining daemon ends a connection it has read to its end:

    farewell USER T             a check came on a connection the farewell ended

Every other check whose user is "farewell-alt" (the 1st, 3rd, ...) is answered with the
farewell at once, as a draining daemon answers a connection it accepted during the drain:
a gateway that connects per check (HAProxy) meets it on its first connection.

A check whose user is "farewell-release" is leased as any other, and the first release of
its lease is answered with the farewell at once, as a draining daemon answers a
connection it accepted during the drain (HAProxy sends the releases of a keep-alive
connection's previous transaction first, on the next check's connection):

    farewell-release LEASE T    the release of LEASE came on a connection the farewell ended

A check whose user is "eof-release" is leased as any other, and the first release of its
lease is read whole and its connection closed without an answer, as a daemon that dies
(SIGKILL), or whose drain times out, while deciding it; a release is idempotent, so the
gateway sends it again, and that one is answered at once:

    eof-release LEASE T         the release of LEASE read, its connection closed unanswered

A check whose user is "renew-any" is leased with the rules of a lease of 1 s, and every
renewal of its lease is answered renewed, whether or not the connection that took it is
still open, as a successor daemon answers for a global lease it finds in Redis, taken
from a daemon that was SIGKILLed (which never read that connection's close); its
release is answered at once:

    renewed LEASE T             a renewal of such a lease answered

The first check whose user is "fresh-reset", if it is the first frame of its connection,
is not read: the stand-in closes that connection with it unread (the gateway's read is
reset), as a daemon SIGKILLed (or stopped) having accepted a new connection:

    fresh-reset T               that check came, its new connection closed unread

A check whose user is "renew-outage" is leased with the rules of a lease of 3 s (a
concurrency entry) beside a rate rule of 1 s, and the renewals of its lease are left
unanswered for the first 1.5 s after the check (a daemon stalled or restarting), then
answered renewed for 3 s:

    renewed LEASE T             a renewal of such a lease answered

Usage: /usr/bin/python3 held_sidecar.py SOCKET LOG (Debian's python3-msgpack).
"""

import itertools
import select
import socket
import struct
import sys
import threading
import time

import msgpack

RELEASE_MS = 1000
HELD_DELAY_MS = 5000

start = time.monotonic()
leases = itertools.count(1)
alt = itertools.count(1)
quick = set()  # leases whose release is answered at once (their checks' paths start with /twice/)
farewell_release = set()  # leases whose first release gets the farewell (farewell-release's)
eof_release = set()  # leases whose first release is read and not answered (eof-release's)
renew_outage = {}  # lease -> when its check came (ms): renewals unanswered for 1.5 s after
renew_any = set()  # leases whose every renewal is answered renewed (renew-any's)
fresh_reset = []  # one element once the first fresh-reset check was closed unread
log_lock = threading.Lock()


def now_ms():
    return int((time.monotonic() - start) * 1000)


def log(line):
    with log_lock:
        with open(sys.argv[2], "a") as f:
            f.write(line + "\n")


def read_exact(c, n):
    b = b""
    while len(b) < n:
        d = c.recv(n - len(b))
        if not d:
            return None
        b += d
    return b


def serve(c):
    stale = False  # the connection answered a stale-pool check: the next is not read
    eof = False  # the connection answered an eof-pool check: the next is read, not answered
    farewell = False  # the connection answered a farewell-pool check: the next gets the farewell
    with c:
        # The first frame of the connection, peeked: a fresh-reset check is closed unread.
        select.select([c], [], [])
        peek = c.recv(65536, socket.MSG_PEEK)
        if len(peek) >= 4 and len(peek) >= 4 + struct.unpack(">I", peek[:4])[0] and not fresh_reset:
            try:
                first = msgpack.unpackb(peek[4:4 + struct.unpack(">I", peek[:4])[0]], raw=False)
            except Exception:
                first = None
            if isinstance(first, dict) and dict(first.get("attrs") or {}).get("user") == "fresh-reset":
                fresh_reset.append(1)
                log("fresh-reset %d" % now_ms())
                return
        while True:
            if stale:
                select.select([c], [], [])
                if c.recv(1, socket.MSG_PEEK):  # the next check is there: closed unread
                    log("stale %d" % now_ms())
                return
            head = read_exact(c, 4)
            if head is None:
                return
            body = read_exact(c, struct.unpack(">I", head)[0])
            if body is None:
                return
            req = msgpack.unpackb(body, raw=False)
            rid, op = req.get("id", 0), req.get("op")
            user = dict(req.get("attrs") or {}).get("user", "")
            if eof:
                log("eof %s %d" % (user, now_ms()))
                return
            if farewell:
                log("farewell %s %d" % (user, now_ms()))
                out = msgpack.packb({"id": 0, "error": {"code": "shutting_down", "message": "draining"}})
                c.sendall(struct.pack(">I", len(out)) + out)
                c.shutdown(socket.SHUT_WR)
                return
            if op == "release" and req.get("lease") in farewell_release:
                farewell_release.discard(req.get("lease"))
                log("farewell-release %s %d" % (req.get("lease"), now_ms()))
                out = msgpack.packb({"id": 0, "error": {"code": "shutting_down", "message": "draining"}})
                c.sendall(struct.pack(">I", len(out)) + out)
                c.shutdown(socket.SHUT_WR)
                return
            if op == "release" and req.get("lease") in eof_release:
                eof_release.discard(req.get("lease"))
                log("eof-release %s %d" % (req.get("lease"), now_ms()))
                return
            if op == "check" and user == "farewell-alt" and next(alt) % 2 == 1:
                log("farewell %s %d" % (user, now_ms()))
                out = msgpack.packb({"id": 0, "error": {"code": "shutting_down", "message": "draining"}})
                c.sendall(struct.pack(">I", len(out)) + out)
                c.shutdown(socket.SHUT_WR)
                return
            if op == "check" and user in ("stale-pool", "eof-pool", "farewell-pool"):
                stale, eof, farewell = user == "stale-pool", user == "eof-pool", user == "farewell-pool"
                log("check %s - %d" % (user, now_ms()))
                ans = {"id": rid, "allowed": True, "rule": "", "limit": 0, "remaining": 0, "reset_ms": 0,
                       "retry_after_ms": 0, "rules": []}
            elif op == "check":
                path = dict(req.get("attrs") or {}).get("path", "")
                lease = "L%d" % next(leases)
                log("check %s %s %d" % (path, lease, now_ms()))
                ans = {"id": rid, "allowed": True, "rule": "", "limit": 0, "remaining": 0, "reset_ms": 0,
                       "retry_after_ms": 0, "rules": [], "lease": lease}
                if path.startswith("/held/"):
                    ans["delay_ms"] = HELD_DELAY_MS
                if path.startswith("/twice/"):
                    quick.add(lease)
                if user == "renew-outage":
                    renew_outage[lease] = now_ms()
                    ans["rules"] = [
                        {"name": "exports", "limit": 1, "window_ms": 3000, "remaining": 0, "reset_ms": 0,
                         "retry_after_ms": 0, "allowed": True, "shadow": False, "concurrency": True},
                        {"name": "per-second", "limit": 100, "window_ms": 1000, "remaining": 99, "reset_ms": 10,
                         "retry_after_ms": 0, "allowed": True, "shadow": False}]
                if user == "farewell-release":
                    farewell_release.add(lease)
                    quick.add(lease)
                if user == "renew-any":
                    renew_any.add(lease)
                    quick.add(lease)
                    ans["rules"] = [
                        {"name": "exports", "limit": 1, "window_ms": 1000, "remaining": 0, "reset_ms": 0,
                         "retry_after_ms": 0, "allowed": True, "shadow": False, "concurrency": True}]
                if user == "eof-release":
                    eof_release.add(lease)
                    quick.add(lease)
            elif op == "renew" and req.get("lease") in renew_any:
                log("renewed %s %d" % (req.get("lease"), now_ms()))
                ans = {"id": rid, "renewed": True, "expires_ms": 1000}
            elif op == "renew" and req.get("lease") in renew_outage:
                if now_ms() - renew_outage[req.get("lease")] < 1500:
                    continue  # no answer: the daemon is away
                log("renewed %s %d" % (req.get("lease"), now_ms()))
                ans = {"id": rid, "renewed": True, "expires_ms": 3000}
            elif op == "release":
                t_in = now_ms()
                if req.get("lease") not in quick:
                    time.sleep(RELEASE_MS / 1000)
                log("release %s %d %d" % (req.get("lease"), t_in, now_ms()))
                ans = {"id": rid, "released": True}
            else:
                ans = {"id": rid, "error": {"code": "unknown_op", "message": "not here"}}
            out = msgpack.packb(ans)
            try:
                c.sendall(struct.pack(">I", len(out)) + out)
            except OSError:  # the gateway gave up waiting (its timeout) and closed
                return


def main():
    s = socket.socket(socket.AF_UNIX)
    s.bind(sys.argv[1])
    s.listen(64)
    while True:
        c, _ = s.accept()
        threading.Thread(target=serve, args=(c,), daemon=True).start()


main()
