"""The blocking client: a pool of kept-alive connections, one check in flight on each."""

import os
import random
import select
import socket
import threading
import time
import weakref

from . import _proto
from ._outage import OutageLog
from .decision import Decision

#: Failed connection attempts back off from 10 ms, doubling, up to 1 s (with jitter).
BACKOFF_MIN = 0.010
BACKOFF_MAX = 1.0

_POLICIES = ("open", "closed")

#: check_many writes at most this many frames before reading their answers.
BATCH_WINDOW = 256

#: The longest wait, after the sidecar refused a new connection at its --max-conns, for
#: another connection of the pool to be put back (s); then the check redials.
REFUSED_PAUSE = 0.010


def _lost(why, ids, answered):
    """What _exchange returns when it gives up (why): why, or, when the first requests
    were answered before a drain's farewell, (None, their ids, their answers, their
    count, why)."""
    return (None, ids, answered, len(answered), why) if answered else why


def _check_options(socket_path, timeout, on_unavailable, max_frame):
    if not socket_path or not isinstance(socket_path, str):
        raise ValueError("socket_path must be a non-empty str")
    if not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ValueError("timeout must be a number of seconds > 0, not %r" % (timeout,))
    if on_unavailable not in _POLICIES:
        raise ValueError('on_unavailable must be "open" or "closed", not %r' % (on_unavailable,))
    _proto.check_max_frame(max_frame)


def backoff(failures):
    """The wait in seconds after n consecutive failed attempts: 10 ms·2^(n-1), at most
    1 s, then a random half to all of it."""
    d = BACKOFF_MAX if failures >= 8 else min(BACKOFF_MIN * (1 << (failures - 1)), BACKOFF_MAX)
    return d / 2 + random.random() * d / 2


#: The live Clients, for the fork hook below.
_clients = weakref.WeakSet()


def _after_fork_in_child():
    """A forked child (gunicorn --preload, uWSGI, multiprocessing) inherits the parent's
    pooled sockets: the same connections, and the same request ids on them. Two
    processes checking on one connection read each other's answers, and the ids match.
    The child drops them, unused (closing its copies of the descriptors leaves the
    parent's connections open), and dials its own."""
    for c in list(_clients):
        c._forget_connections()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class _NotRead(Exception):
    """The daemon closed a pooled connection without reading the request sent on it;
    farewell: it said so itself (the drain's error shutting_down, id 0). answered: the
    answers that came before the farewell (a batch), to the first of the requests; the
    others were not read."""

    def __init__(self, why, farewell=False, answered=()):
        super().__init__(why)
        self.farewell = farewell
        self.answered = answered


class _WriteCut(Exception):
    """A write failed (err: EPIPE, ECONNRESET) after sent bytes of its data went out."""

    def __init__(self, err, sent):
        super().__init__(str(err))
        self.err = err
        self.sent = sent


class _Conn:
    __slots__ = ("sock", "buf", "next_id", "served", "leases", "hold_until", "unsure")

    def __init__(self, sock):
        self.sock = sock
        self.buf = bytearray()  # bytes read beyond the last frame
        self.next_id = 0
        self.served = False  # an answer arrived: the sidecar is really there
        self.leases = 0  # leases taken on it and not released through this client
        self.hold_until = 0.0  # (monotonic) when the last of them expires, unless renewed
        # A lease taken on it was released through this client without released: true
        # (answered false, or unanswered): the sidecar it goes to may still hold it, and
        # closing the connection frees it there (release).
        self.unsure = False


class Client:
    """Asks one sidecar for decisions over its Unix socket.

    Connections are kept open and pooled: a check takes an idle connection (or dials one),
    sends its frame, reads the answer and puts the connection back, so concurrent threads
    each use their own connection and a single thread reuses one. At most ``pool_size``
    idle connections are kept. check_many() pipelines a batch of checks on one
    connection (one write, answers read in order).

    The sidecar is a dependency that can be down, restarting or slow; check() never
    raises for that. When no answer arrives within ``timeout`` seconds (default 50 ms) —
    socket missing, connection refused or dropped, sidecar stalled — it returns the
    ``on_unavailable`` decision: "open" allows, "closed" rejects (the HTTP form is then
    a 503); either way ``degraded`` and ``unreachable`` are True. A connection that timed
    out is closed (a late answer must not be read as the next one's). Failed dials, and
    connections dropped before their first answer, back off from 10 ms to 1 s; meanwhile
    checks answer by the policy at once. A connection refused at the daemon's
    --max-conns (too_many_connections, none of it read) is such a failed dial; its check
    waits up to 10 ms for another thread's connection to be put back and goes on it (or
    on a new one once the backoff has ended), at most pool_size times, then answers by
    the policy. Such a sidecar is logged (logger "rlsidecar",
    WARNING): the first check decided by the policy at once, then at most one line per
    10 s while checks keep being so decided, with their count, and one line when the
    sidecar answers again.

    A pooled connection the daemon has closed since (a restart, serve --idle-timeout) is
    noticed when a request is sent on it; when the daemon certainly did not read the
    request (the write fails, or the connection is reset with the request unread), it is
    sent again, once, on a new connection, within the same timeout, so it is counted
    once. A connection closed with no answer after the daemon read the request is not
    retried (the request may have counted): that check answers by the policy.

    Concurrency leases: an allowed check that matched a concurrency rule has
    ``decision.lease``; release() it when the request ends (idempotent), renew() it for a
    long one. The sidecar frees a lease when the connection that took it closes, so a
    connection holding leases is set aside, open and unused, until they are released
    (a release the sidecar does not answer closes it, which frees them) or expire (a
    lease never released is not held past its expiry): a check on it that timed out
    would close it, and free the slots of requests still running. It is closed, not
    used again, once its last lease is released unless every release of its leases was
    answered ``released: true``: a release answered false came from a sidecar that does
    not hold the lease (expired, released already; or taken through another one, an old
    sidecar in a blue/green switch, which still holds it on this connection). close()
    frees them all.

    Too large: a request whose frame body is over ``max_frame`` bytes (default 65,536,
    the daemon's default --max-frame) is not sent; check() raises RequestTooLargeError,
    a ProtocolError whose decision refuses it with a 431, and so does a frame_too_large
    answer of a daemon whose --max-frame is smaller. The policy never applies to it:
    under "open" that would let any request through unlimited, given a huge header.

    It raises only ProtocolError (the sidecar refused the request as malformed: a bug in
    what the caller sent; RequestTooLargeError) and ClosedError. Safe for use by many
    threads; close() it (or use it as a context manager) to close its connections.
    """

    def __init__(self, socket_path, timeout=0.05, on_unavailable="open", pool_size=4, max_frame=_proto.MAX_FRAME):
        _check_options(socket_path, timeout, on_unavailable, max_frame)
        if not isinstance(pool_size, int) or pool_size < 1:
            raise ValueError("pool_size must be an int >= 1, not %r" % (pool_size,))
        self.socket_path = socket_path
        self.timeout = float(timeout)
        self.on_unavailable = on_unavailable
        self.pool_size = pool_size
        self.max_frame = max_frame
        self._lock = threading.Lock()
        self._put_back = threading.Condition(self._lock)  # notified by _put when checks wait on it
        self._waiting = 0  # checks waiting on _put_back
        self._idle = []
        self._closed = False
        self._failures = 0
        self._retry_at = 0.0
        self._last_error = None
        self._lease_conn = {}  # lease → the _Conn that took it
        self._holding = set()  # connections holding leases: open, not used for requests
        self._next_unpark = 0.0  # (monotonic) when _take next looks for expired holds
        self._outage = OutageLog(socket_path, on_unavailable)  # logs an unreachable sidecar
        self._pid = os.getpid()
        _clients.add(self)

    def _forget_connections(self):
        """In a forked child: drop the connections (and leases) inherited from the
        parent, unused. The lock is new too: another thread of the parent may have held
        it at the fork, and it would never be released here."""
        self._lock = threading.Lock()
        self._put_back = threading.Condition(self._lock)
        self._waiting = 0
        conns = self._idle + list(self._holding)
        self._idle, self._holding, self._lease_conn = [], set(), {}
        self._pid = os.getpid()
        for c in conns:
            try:
                c.sock.close()  # this process's copy of the descriptor only
            except OSError:
                pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        """Close every idle connection; later checks raise ClosedError. Idempotent."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
            idle.extend(self._holding)
            self._holding.clear()
        for c in idle:
            c.sock.close()

    def check(self, attrs, cost=1, limits=None):
        """Ask whether a request with these attributes may pass, and consume ``cost``.

        ``attrs``: dict of str to str (``user``, ``ip``, ``path``, ... — whatever the rules
        match on), sent in its order. ``cost``: what the request consumes; 0 asks without
        consuming. ``limits``: inline limits, dicts with ``key``, ``limit``,
        ``window_ms`` and optionally ``burst``, ``algorithm``, ``mode``, ``name``.
        Returns a Decision; see the class doc for an unreachable sidecar.
        """
        return self.check_many([(attrs, cost, limits)])[0]

    def check_many(self, checks):
        """Check several requests at once, pipelined on one connection: ``checks`` is a
        list of ``(attrs, cost, limits)`` tuples; returns their Decisions in order. The
        timeout covers the whole batch. Raises ProtocolError for the first check the
        sidecar refused (its ``decision`` is the policy one; use check() to isolate it),
        after releasing the leases the others took."""
        if self._closed:
            raise ClosedError("rlsidecar: client closed")
        if not checks:
            return []
        # Every request is built (and bad input refused, and a request over max_frame even
        # with the shortest id) before anything is sent.
        bodies = [_proto.body(_proto.check_message(0, attrs, cost, limits)) for attrs, cost, limits in checks]
        for b in bodies:
            _proto.check_size(len(b), self.max_frame)
        got = self._exchange(bodies, time.monotonic() + self.timeout)
        if isinstance(got, str):
            return self._unreachable(got, len(checks))
        conn, ids, msgs, own = got[:4]
        lost = got[4] if len(got) > 4 else None  # why the requests after msgs have no answer
        out = []
        err = None
        keep = conn is not None
        unanswered = None  # (cause, count) of the requests written whole with no answer
        for i, msg in enumerate(msgs):
            if isinstance(msg, str):
                # Written whole before a failed write, and no answer came: the daemon may
                # have read it (_read_after_cut).
                out.append(self._policy(msg))
                unanswered = (msg, (unanswered[1] if unanswered else 0) + 1)
                continue
            mid = msg.get("id")
            e = _proto.error_of(msg)
            if mid != ids[i] and not (e is not None and mid == 0):
                if conn is not None:
                    conn.sock.close()
                return self._unreachable("answer id %r where %d was due" % (mid, ids[i]), len(checks))
            if e is not None:
                if e[0] in ("too_many_connections", "shutting_down"):
                    if conn is not None:
                        conn.sock.close()
                    return self._unreachable("the sidecar closed the connection: %s" % e[0], len(checks))
                if e[0] == "frame_too_large":
                    if i >= own:  # (before own: on a connection already closed)
                        keep = False  # the sidecar closes the connection after this answer
                    pe = _proto.RequestTooLargeError(e[1])
                elif e[0] == "attr_too_large":  # a value over its --max-attr-len
                    pe = _proto.RequestTooLargeError(e[1], e[0])
                else:
                    d = self._policy(None)
                    d.unreachable, d.cause = False, "%s: %s" % e
                    pe = _proto.ProtocolError(e[0], e[1], d)
                if err is None:
                    err = pe
                out.append(pe.decision)
            else:
                d = _proto.decision(msg)
                if d.lease and i >= own:  # (before own: taken on a connection its drain closed, which freed it)
                    hold = time.monotonic() + _proto.lease_ms(d.rules) / 1000
                    with self._lock:
                        conn.leases += 1
                        conn.hold_until = max(conn.hold_until, hold)
                        self._lease_conn[d.lease] = conn
                out.append(d)
        if unanswered is not None:
            self._outage.unreachable(*unanswered)
        if lost is not None:
            out.extend(self._unreachable(lost, len(checks) - len(msgs)))
        elif unanswered is None and self._outage.failing:
            self._outage.answered()
        if keep:
            self._put(conn)
        elif conn is not None:
            conn.sock.close()
        if err is not None:
            # The caller gets the error, not the decisions: the leases the batch's allowed
            # checks took are released here, or they held their slots for a whole lease.
            for d in out:
                if d.lease:
                    try:
                        self.release(d.lease)
                    except _proto.ProtocolError:
                        pass  # it expires on its own
            raise err
        return out

    def release(self, lease):
        """Free the slots ``lease`` holds; True when it did, False when the lease was
        unknown, expired or already released, and when the sidecar is unreachable or
        gives no answer within the timeout or the client is closed (on False the
        connection that took the lease is closed, once it holds no other, which frees it
        where it may still be held; else it expires): call it in a finally, it raises
        only ProtocolError, on an error answer (a malformed release)."""
        if not lease:
            return False
        try:
            msg = self._call("release", lease, None)
        except (OSError, ClosedError):
            # No answer: the connection that took the lease, set aside for it, is closed
            # once it holds no other, and the sidecar frees the lease with it (at once, or
            # when a stalled sidecar runs again). Before, it was kept open until the lease
            # expired (up to an hour): a sidecar restarted under load left one descriptor
            # open, on a dead connection, per leased request that ended meanwhile.
            msg = None
        released = msg is not None and bool(msg.get("released", False))
        # Answered false: the sidecar that answered does not hold the lease. The one the
        # connection goes to may (a blue/green switch: the release went to the successor
        # on the socket's path; the old sidecar holds the lease on this connection), so
        # it is closed as for no answer, which frees it there. Before, it was pooled again:
        # the lease stayed held on the old sidecar, and the checks sent on the connection
        # went to that sidecar, a concurrency rule's refused by the slot of the request
        # that had ended (test_release_answered_false_closes_the_set_aside_connection).
        conn = self._forget_lease(lease, unsure=not released)
        if conn is not None:
            if conn.unsure:
                conn.sock.close()
            else:
                self._put(conn)  # it holds no lease any more: usable again
        return released

    def _forget_lease(self, lease, unsure=False):
        """Forget lease (released; unsure: its release unanswered or answered false, and
        then the connection that took it is closed once it holds no other); return the
        connection set aside for it when it holds no other lease now, taken out of the
        set-aside ones."""
        with self._lock:
            conn = self._lease_conn.pop(lease, None)
            if conn is None:
                return None
            conn.unsure = conn.unsure or unsure
            conn.leases -= 1
            if conn.leases > 0 or conn not in self._holding:
                return None
            self._holding.discard(conn)
            return conn

    def renew(self, lease, lease_ms=None):
        """Extend a live lease to ``lease_ms`` from now (None: each rule's own lease; at
        most 3,600,000). Returns (renewed, expires_ms). Raises OSError when the sidecar is
        unreachable, ClosedError once closed, ProtocolError on an error answer."""
        msg = self._call("renew", lease, lease_ms)
        renewed, expires_ms = bool(msg.get("renewed", False)), msg.get("expires_ms", 0)
        if renewed:
            with self._lock:
                conn = self._lease_conn.get(lease)
                if conn is not None:
                    conn.hold_until = max(conn.hold_until, time.monotonic() + expires_ms / 1000)
        return renewed, expires_ms

    def _call(self, op, lease, lease_ms):
        """Send a release or renew and return its answer map."""
        if self._closed:
            raise ClosedError("rlsidecar: client closed")
        msg = self._ask(_proto.body(_proto.lease_message(0, op, lease, lease_ms)), idempotent=op == "release")
        e = _proto.error_of(msg)
        if e is not None:
            raise _proto.ProtocolError(*e)
        return msg

    def ping(self):
        """Return the sidecar's version string; raises OSError when it is unreachable."""
        msg = self._ask(_proto.body({"id": 0, "op": "ping"}))
        e = _proto.error_of(msg)
        if e is not None:
            raise _proto.ProtocolError(*e)
        return msg.get("version", "")

    def _ask(self, body, idempotent=False):
        """Send one request (a body from _proto.body) and return its answer map (the
        connection is pooled again); raises ConnectionError when there is none.
        idempotent: see _exchange."""
        got = self._exchange([body], time.monotonic() + self.timeout, idempotent)
        if isinstance(got, str):
            raise ConnectionError("rlsidecar: sidecar unreachable: %s" % got)
        conn, (first,), (msg,), _ = got
        if msg.get("id") != first:
            # An error of id 0 is about the connection, which the sidecar closes after it:
            # not pooled again. too_many_connections is an unreachable sidecar (release()
            # returns False, renew() and ping() raise OSError, as documented); before, it
            # was raised as a ProtocolError, from a release called in a finally too, and
            # the closed connection went back to the pool.
            conn.sock.close()
            e = _proto.error_of(msg)
            if e is None:
                raise ConnectionError("rlsidecar: answer id %r where %d was due" % (msg.get("id"), first))
            if e[0] == "too_many_connections":
                raise ConnectionError("rlsidecar: sidecar unreachable: the sidecar closed the connection: %s" % e[0])
            return msg
        self._put(conn)
        return msg

    def _exchange(self, bodies, deadline, idempotent=False):
        """Send the requests (bodies from _proto.body, numbered here, in order, on the
        connection they go out on) pipelined on one connection and read their answers. Returns (conn,
        the ids they were sent with, the answer maps, the index of the first answered on
        conn), conn not yet back in the pool; or a str saying why there is no answer (the
        connection is then closed), or, when requests were answered before a farewell and
        the rest got none, (None, their ids, their answers, their count, why). An answer
        may be a str: the policy's cause for a request written whole before a failed
        write, which got no answer (_read_after_cut).

        A pooled connection may be one the daemon has closed since its last answer (a
        restart, --idle-timeout). Sent on such a connection, a request is sent again, once,
        on a new connection, within the same deadline, when the daemon certainly did not
        read it:

        - the first write fails (EPIPE, ECONNRESET): nothing of it reached the daemon;
        - a single request was written whole, and the read fails with ECONNRESET before any
          byte of the answer: on a Unix socket that is the daemon closing the connection
          with bytes of ours unread in it, and it reads a request whole before deciding it.

        - the daemon's first word is the drain's farewell (an error shutting_down with id
          0, after its last answer on the connection): nothing after that answer was read.
          In a batch, the farewell may come after the answers to its first requests (a
          window of BATCH_WINDOW sent after the drain began): those answers stand, and
          only the requests after them are sent again.
        - a write of a batch fails after its first bytes went out: the requests the
          socket never took whole were not read, and are sent again; the answers to those
          it took whole are read, and one of those that gets none (the daemon died or
          closed while deciding it) answers by the policy (_read_after_cut).

        Never after end-of-file with no answer: on a Unix socket that means the daemon took
        every byte sent (a daemon closing with bytes unread resets the connection instead),
        then closed without answering: it died, or a drain timed out, while deciding a
        request it may have counted. Except
        for an idempotent request (a release: releasing twice frees nothing more), sent
        again once after such an end too: to the daemon's successor on the socket, which
        frees a global lease the dead daemon may not have (the Go, Node and asyncio clients
        send a release again after any broken connection).
        """
        conn, pooled = self._take(deadline)
        resent = False
        fresh_farewells = 0
        refusals = 0
        ids, answered = [], []  # of the requests answered before a farewell, on other connections
        while True:
            if isinstance(conn, str):
                return _lost(conn, ids, answered)
            first = conn.next_id + 1
            frames = []
            for b in bodies:
                conn.next_id += 1
                frames.append(_proto.frame(b, conn.next_id))
            try:
                for f in frames:  # with their ids: a few bytes longer
                    _proto.check_size(len(f) - 4, self.max_frame)
            except _proto.RequestTooLargeError:
                self._put(conn)  # nothing was sent on it
                raise
            try:
                msgs = self._send_read(conn, frames, deadline, pooled)
            except _NotRead as e:
                conn.sock.close()
                farewell = e.farewell
                if e.answered:
                    # The first requests were answered before the farewell: kept, and only
                    # the rest sent again. Before, the whole batch got the policy, the
                    # answers the daemon had given (its refusals too) thrown away.
                    n = len(e.answered)
                    ids.extend(range(first, first + n))
                    answered.extend(e.answered)
                    bodies = bodies[n:]
                if resent and not farewell and not e.answered:
                    # (a frame_too_large in the resent rest: answers came, so the loop ends)
                    return _lost("connection lost: %s" % e, ids, answered)
                if farewell and not pooled and not e.answered:
                    # A farewell on a new connection, before any answer: the sidecar may say
                    # it to every connection (a drain whose successor is not up, a stand-in).
                    # Sent again after it at most pool_size times, each after a pause: before,
                    # a check redialed in a loop for its whole timeout (12,000 a second).
                    fresh_farewells += 1
                    if fresh_farewells > self.pool_size or time.monotonic() + 0.01 >= deadline:
                        return _lost("connection lost: %s" % e, ids, answered)
                    time.sleep(0.01)
                # not read by the sidecar: sent again, once, within the deadline; as often as
                # a drain's farewell says so (a resend may meet another draining connection)
                resent = True
                conn, pooled = self._take(deadline, pool=False)  # a fresh one: the others may be stale too
                continue
            except (OSError, ValueError) as e:
                conn.sock.close()
                if isinstance(e, socket.timeout):
                    return _lost("no answer within the timeout", ids, answered)
                why = "connection lost: %s" % e
                if idempotent and conn.served and not resent and time.monotonic() < deadline:
                    resent = True
                    conn, pooled = self._take(deadline, pool=False)
                    continue
                if not conn.served:
                    # A sidecar that accepts and then drops is not hammered either: back off.
                    self._failed(why)
                return _lost(why, ids, answered)
            except BaseException:  # interrupted: the connection is out of step
                conn.sock.close()
                raise
            e = _proto.error_of(msgs[0]) if msgs and isinstance(msgs[0], dict) and msgs[0].get("id") == 0 else None
            if e is not None and e[0] == "too_many_connections" and not conn.served:
                # Refused as it was accepted (--max-conns), before any answer: a failed dial,
                # backed off. Before, every check dialed a daemon at its cap again at once.
                conn.sock.close()
                why = self._failed("the sidecar closed the connection: %s" % e[0])
                # The sidecar read none of it: the requests were not decided. Another
                # thread's connection of the pool, put back meanwhile, may serve them: they
                # go on it (or on a new one, once the backoff has ended) after a pause, at
                # most pool_size times, then the policy. Before, the policy at once, though
                # the pool's other connection was served.
                refusals += 1
                if refusals > self.pool_size or time.monotonic() + REFUSED_PAUSE >= deadline:
                    return _lost(why, ids, answered)
                self._wait_put_back(REFUSED_PAUSE)
                conn, pooled = self._take(deadline)
                if isinstance(conn, str) and conn.startswith("backing off"):
                    conn = why  # none put back, and no dial yet: the refusal is the cause
                continue
            conn.served = True
            with self._lock:
                self._failures = 0
            return conn, ids + list(range(first, first + len(msgs))), answered + msgs, len(answered)

    def _send_read(self, conn, frames, deadline, pooled):
        """Write frames on conn and read as many answers; raises _NotRead (see _exchange)
        when conn came from the pool and the daemon certainly read none of them."""
        left = deadline - time.monotonic()
        if left <= 0:
            raise socket.timeout("no answer within the timeout")
        conn.sock.settimeout(left)
        msgs = []
        # In windows of BATCH_WINDOW frames: a batch larger than the socket buffers would
        # otherwise fill them both ways, the sidecar waiting for us to read.
        for i in range(0, len(frames), BATCH_WINDOW):
            window = frames[i:i + BATCH_WINDOW]
            data = window[0] if len(window) == 1 else b"".join(window)
            if i == 0:
                try:
                    n = conn.sock.send(data)  # one write: it delivers some bytes or none
                except (BrokenPipeError, ConnectionResetError) as e:
                    if pooled:
                        raise _NotRead(e) from None
                    raise
                if n < len(data):
                    try:
                        self._send_rest(conn, data, n)
                    except _WriteCut as cut:
                        if len(frames) > 1:
                            return self._read_after_cut(conn, deadline, msgs, window, len(frames), cut)
                        refused = self._refused(conn, deadline)
                        if refused is None:
                            raise cut.err from None
                        return [refused]
            else:
                try:
                    self._send_rest(conn, data, 0)
                except _WriteCut as cut:
                    return self._read_after_cut(conn, deadline, msgs, window, len(frames), cut)
            for _ in window:
                msg = self._read(conn, deadline, unread_is_stale=pooled and len(frames) == 1)
                e = _proto.error_of(msg) if msg.get("id") == 0 else None
                if e is not None and e[0] == "shutting_down":
                    # A drain's last word (or a connection it accepted and does not serve):
                    # no frame after the answers before it was read, so none decided: they
                    # are sent again on a new connection (to the successor).
                    raise _NotRead("the sidecar closed the connection: shutting_down", farewell=True, answered=msgs)
                msgs.append(msg)
                self._past_refusal(msg, msgs, len(frames))
        return msgs

    @staticmethod
    def _past_refusal(msg, msgs, total):
        """Raise _NotRead when msg (the last of msgs) is a frame_too_large with frames
        written after it: the daemon answers it from the frame's header and reads nothing
        more of the connection, so the frames after it were not read, not decided. They are
        sent again on a new connection (the answers before, the refusal included, stand).
        Before, the whole batch got the policy: under "open" the oversized request too."""
        if len(msgs) < total:
            e = _proto.error_of(msg)
            if e is not None and e[0] == "frame_too_large":
                raise _NotRead("the sidecar closed the connection: frame_too_large", answered=msgs)

    @staticmethod
    def _send_rest(conn, data, sent):
        """Write data[sent:] on conn; a write that fails (EPIPE, ECONNRESET) raises
        _WriteCut, which says how many bytes of data went out before it."""
        view = memoryview(data)
        try:
            while sent < len(data):
                sent += conn.sock.send(view[sent:])
        except (BrokenPipeError, ConnectionResetError) as e:
            raise _WriteCut(e, sent) from None

    def _read_after_cut(self, conn, deadline, msgs, window, total, cut):
        """A write of a batch failed (cut) after the first bytes went out: the window's
        frames written whole before it may have been read; those after, and the one cut
        short, were not. Read the answers the daemon wrote before it stopped reading, onto
        msgs: to the frames written whole, and then any already come (its frame_too_large
        to a frame it refused from the header; _past_refusal raises _NotRead after one).
        Return msgs when every frame has its answer. Else raise _NotRead for the frames
        after those read or written whole, which _exchange sends again on a new
        connection; a frame written whole with no answer (the daemon died or closed
        while deciding it) answers by the policy (a cause str in place of its answer).
        Before, a failure after the first write gave the whole batch the policy: 256 of
        256 checks of a batch written to a frozen sidecar that was then killed and
        restarted, the 149 the socket never took included."""
        whole, end = 0, 0
        for f in window:
            end += len(f)
            if end > cut.sent:
                break
            whole += 1
        want = len(msgs) + whole  # the frames written whole: the windows before were all answered
        why = "connection lost: %s" % cut.err
        while len(msgs) < total and (len(msgs) < want or conn.buf or self._readable(conn)):
            try:
                msg = self._read(conn, deadline)
            except (OSError, ValueError):
                break
            e = _proto.error_of(msg) if msg.get("id") == 0 else None
            if e is not None and e[0] == "shutting_down":
                raise _NotRead("the sidecar closed the connection: shutting_down", farewell=True, answered=msgs)
            msgs.append(msg)
            self._past_refusal(msg, msgs, total)
        if len(msgs) < want:
            msgs.extend([why] * (want - len(msgs)))  # written whole, unanswered: may have been read
        if len(msgs) >= total:
            return msgs
        if not msgs and not conn.served:
            raise cut.err  # a new connection that answered nothing: a failed attempt, backed off
        raise _NotRead(why, answered=msgs)

    @staticmethod
    def _readable(conn):
        """Whether conn has bytes, its end or an error to read now, without waiting (a
        recv on a socket with a timeout waits for it, MSG_DONTWAIT or not). poll, not
        select: select refuses a descriptor >= 1024 (ValueError), common in a server
        process with many open, and the socket was then taken for readable: the read
        waited for a connection the daemon keeps open (its read side shut at
        --idle-timeout, holding leases) until the deadline, and the requests it never read
        answered by the policy instead of being sent again."""
        p = select.poll()
        try:
            p.register(conn.sock.fileno(), select.POLLIN)
            return bool(p.poll(0))
        except (OSError, ValueError):
            return True  # the read says what

    def _refused(self, conn, deadline):
        """The answer the daemon wrote before it stopped reading a request we were still
        writing (a frame over its --max-frame: frame_too_large, then it closes), or None.
        On a Unix socket that answer stays readable after our write fails; without it the
        request would get the failure policy instead of its 431."""
        try:
            msg = self._read(conn, deadline)
        except (OSError, ValueError):
            return None
        return msg if _proto.error_of(msg) is not None else None

    def _unreachable(self, why, n):
        """The policy decisions of n checks the sidecar gave no answer to (why), logged
        (see the class doc)."""
        self._outage.unreachable(why, n)
        return [self._policy(why) for _ in range(n)]

    def _policy(self, cause):
        return Decision(self.on_unavailable == "open", degraded=True, unreachable=cause is not None, cause=cause)

    def _take(self, deadline, pool=True):
        """Return (an idle connection, True), or (a new one, False), or (a str saying why
        there is none, False). pool=False: a new one."""
        now = time.monotonic()
        if self._holding and now >= self._next_unpark:
            self._unpark(now)
        with self._lock:
            if pool and self._idle:
                return self._idle.pop(), True
            if self._failures and now < self._retry_at:
                return "backing off after %d failed attempt(s): %s" % (self._failures, self._last_error), False
        if now >= deadline:
            return "no connection within the timeout", False
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(deadline - now)
        try:
            s.connect(self.socket_path)
        except OSError as e:
            s.close()
            return self._failed("connecting to %s: %s" % (self.socket_path, e)), False
        return _Conn(s), False

    def _failed(self, why):
        """Count a failed attempt, start the backoff and return why."""
        with self._lock:
            self._failures += 1
            self._retry_at = time.monotonic() + backoff(self._failures)
            self._last_error = why
        return why

    def _put(self, conn):
        with self._lock:
            if not self._closed and conn.leases > 0:
                self._holding.add(conn)  # kept open for its leases, not used (see the class doc)
                return
            if not self._closed and not conn.unsure and len(self._idle) < self.pool_size:
                self._idle.append(conn)
                if self._waiting:
                    self._put_back.notify()
                return
        conn.sock.close()

    def _wait_put_back(self, pause):
        """Wait up to pause seconds for an idle connection in the pool (see _exchange)."""
        with self._lock:
            if self._idle or self._closed:
                return
            self._waiting += 1
            try:
                self._put_back.wait(pause)
            finally:
                self._waiting -= 1

    def _unpark(self, now):
        """Return to use the connections set aside whose leases have all expired (taken
        and never released through this client), at most once a second."""
        freed = []
        with self._lock:
            self._next_unpark = now + 1.0
            for conn in [c for c in self._holding if now >= c.hold_until]:
                self._holding.discard(conn)
                conn.leases = 0
                conn.unsure = False  # (expired: the sidecar holds none of them)
                freed.append(conn)
            if freed:
                gone = set(freed)
                for lease in [k for k, c in self._lease_conn.items() if c in gone]:
                    del self._lease_conn[lease]
        for conn in freed:
            self._put(conn)

    @staticmethod
    def _read(conn, deadline, unread_is_stale=False):
        """Read one frame from conn and decode it; socket.timeout past the deadline. With
        unread_is_stale, a reset before any byte raises _NotRead (see Client._exchange)."""
        buf = conn.buf
        sock = conn.sock
        need = 4
        while True:
            if len(buf) >= need:
                if need == 4:
                    need = 4 + _proto.frame_length(buf[:4])
                    if need - 4 > _proto.MAX_RESPONSE_FRAME:
                        raise ValueError("answer frame of %d bytes" % (need - 4))
                    continue
                body = bytes(buf[4:need])
                del buf[:need]
                return _proto.decode(body)
            left = deadline - time.monotonic()
            if left <= 0:
                raise socket.timeout("no answer within the timeout")
            sock.settimeout(left)
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError as e:
                if unread_is_stale and not buf:
                    raise _NotRead(e) from None
                raise
            if not chunk:
                raise ConnectionError("the sidecar closed the connection")
            buf += chunk


ClosedError = _proto.ClosedError
