"""The asyncio client: checks pipelined over one kept-alive connection."""

import asyncio
import collections
import os
import socket
import time
import weakref

from . import _proto
from ._outage import OutageLog
from .client import _check_options, backoff
from .decision import Decision

#: Checks in flight (abandoned ones included) on the connection at most: a check that
#: finds it full waits for room, in turn, until its timeout, and only then answers by
#: the policy (a burst of concurrent checks is answered by the sidecar, not the policy).
MAX_PENDING = 4096

#: Seconds a connection may answer no check while checks time out on it, or waiting for
#: room on it (or 4 timeouts, if longer), before it is closed and the next check redials
#: (_Protocol.timed_out).
STALL_FOR = 1.0


#: The live AsyncClients, for the fork hook below.
_clients = weakref.WeakSet()


def _after_fork_in_child():
    """A forked child inherits the parent's connection (and its request ids): checks of
    both processes on it would read each other's answers. The child drops it, unused,
    and dials its own on its own event loop."""
    for c in list(_clients):
        c._forget_connection()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class _NotRead(ConnectionError):
    """The connection broke with this check's frame certainly unread by the sidecar: a
    write failed (EPIPE), or it was reset (ECONNRESET) with no byte of an answer come, and
    this check was the last pending, whose frame the unread bytes (the end of the stream)
    hold. A graceful restart's drain (or --idle-timeout) closes a connection a check was
    just written on. It was not decided: _round_trip sends it again, once. Or the sidecar
    said so itself (farewell: a drain's error of id 0, shutting_down, after its last
    answer): sent again as often as such a word comes, within the deadline (a resend may
    meet another connection to the same draining sidecar)."""

    def __init__(self, why, farewell=False, fresh=False):
        super().__init__(why)
        self.farewell = farewell
        # fresh: the farewell came on a connection that had answered nothing: it may be a
        # sidecar that says it to every connection (a drain whose successor is not up, a
        # stand-in), so _round_trip resends after it once, after a pause, not in a loop.
        self.fresh = fresh


# The pause before a check a fresh connection's farewell gave back is sent again (s).
FRESH_FAREWELL_PAUSE = 0.01


class _Protocol(asyncio.Protocol):
    """One connection: frames out in the transport's buffer, answers matched in order."""

    def __init__(self, client):
        self.client = client
        self.loop = asyncio.get_running_loop()  # the event loop it was dialed on, which reads it
        self.transport = None
        self.buf = bytearray()
        self.pending = collections.deque()  # (id, future), in request order
        self.next_id = 0
        self.served = False
        self.heard = False  # an answer arrived since the last check that timed out (timed_out)
        self.quiet_from = time.monotonic()  # when its quiet spell began: since it was dialed
        self.broken = None  # why the connection broke; None while usable
        self.room = collections.deque()  # futures of checks waiting for room, in turn
        self.fresh_farewell = False  # a farewell came before any answer (_NotRead.fresh)
        self.rest_end = None  # ends read_rest's reading of the answers after a failed write
        self.ended_unused = False  # closed by the sidecar (end of file) before any check or word
        self.farewell_unused = False  # a drain's farewell came before any check was sent on it
        # The frames of the last len(unsent) pending checks, not yet handed to the
        # transport: it holds at most one frame not yet taken by the socket (send), so
        # that a failed write's checks are known (fail).
        self.unsent = collections.deque()
        self.paused = False  # the transport holds a frame the socket has not taken whole
        # The leases taken on it and not yet released, and (monotonic) when the last of
        # them expires: given up for a stall while it holds some, it is retired, not
        # closed (give_up), and expiry is then the timer that closes it.
        self.leases = 0
        self.hold_until = 0.0
        self.retired = False
        self.expiry = None

    def connection_made(self, transport):
        self.transport = transport
        # pause_writing as soon as the transport holds a byte the socket did not take,
        # resume_writing once it holds none (see send).
        transport.set_write_buffer_limits(high=0, low=0)

    def send(self, frame):
        """Write a check's frame (its check the last pending), or queue it behind the one
        the socket has not taken whole yet. When a write fails (EPIPE, ECONNRESET) asyncio
        drops, unsent, what its buffer holds, and says nothing of how much of it went out
        before: with several frames there, a check whose frame the sidecar never got could
        not be told from one it had read and counted. So asyncio's buffer holds at most
        the rest of one frame, the last handed to it, and the frames after it wait here:
        on a failed write, that frame and the queued ones were certainly not read (fail,
        read_rest), and each is sent again on a new connection. Before, they all went to
        asyncio's buffer, and only the last was sent again: the others got on_unavailable
        (1,999 of 2,000 checks written to a frozen sidecar that was then killed and
        restarted: test_checks_the_socket_never_took_are_sent_again_after_a_kill)."""
        if self.unsent or self.paused:
            self.unsent.append(frame)
        else:
            self.transport.write(frame)

    def pause_writing(self):
        self.paused = True

    def resume_writing(self):
        """The socket took the whole frame asyncio held: hand it the queued ones, one at
        a time, until one is not taken whole (pause_writing, called from write) or none is
        left."""
        self.paused = False
        while self.unsent and not self.paused and self.broken is None and not self.transport.is_closing():
            self.transport.write(self.unsent.popleft())

    def data_received(self, data):
        buf = self.buf
        buf += data
        while len(buf) >= 4:
            n = _proto.frame_length(buf[:4])
            if n > _proto.MAX_RESPONSE_FRAME:
                return self.fail("answer frame of %d bytes" % n)
            if len(buf) < 4 + n:
                return
            body = bytes(buf[4:4 + n])
            del buf[:4 + n]
            try:
                msg = _proto.decode(body)
            except ValueError as e:
                return self.fail(str(e))
            if not self.pending:
                e = _proto.error_of(msg)
                if e is not None and e[0] == "shutting_down" and not self.served:
                    self.farewell_unused = True  # a drain's, before any check was sent on it (_do_dial)
                return self.fail("the sidecar closed the connection: %s" % e[0] if e else "an answer nobody asked for")
            want, fut = self.pending.popleft()
            self.wake_one()
            got = msg.get("id")
            e = _proto.error_of(msg)
            if got != want and not (e is not None and got == 0):
                return self.fail("answer id %r where %d was due" % (got, want))
            if e is not None and e[0] in ("too_many_connections", "shutting_down"):
                why = "the sidecar closed the connection: %s" % e[0]
                # shutting_down: a drain's last word (or a connection it accepted and does
                # not serve): this check and every one after it were not read, not decided,
                # and each is sent again on a new connection (to the successor).
                unread = e[0] == "shutting_down"
                if unread:
                    self.fresh_farewell = not self.served
                    self.served = True  # it answered: no backoff before the redial
                if not fut.done():  # taken off pending above: fail would not wake it
                    fut.set_exception(_NotRead(why, True, self.fresh_farewell) if unread else ConnectionError(why))
                return self.fail(why, unread_all=unread)
            self.served = True
            self.heard = True
            lease = msg.get("lease") if e is None else None
            if isinstance(lease, str) and lease:
                self.client._track_lease(self, lease, msg)  # before its caller can release it
            if not fut.done():
                fut.set_result(msg)
            else:  # the caller gave up: the answer is dropped, and a lease it took released
                lease = msg.get("lease")
                if isinstance(lease, str) and lease:
                    self.client._release_orphan(lease)  # may close this connection (retired)
                    if self.broken is not None:
                        return
            if e is not None and e[0] == "frame_too_large":
                # The sidecar closes the connection after this answer: no check may follow on it.
                # It answered from the frame's header and reads nothing more of the
                # connection: every check still pending (pipelined after that frame) was not
                # read, not decided, and goes again on a new connection. Before, each got
                # the policy: one oversized request refused the concurrent ones behind it.
                return self.fail("the sidecar closed the connection: frame_too_large", unread_rest=True)

    def timed_out(self):
        """Note a check this connection left unanswered for the whole timeout: the first
        since an answer starts its quiet spell; one that ends a spell of STALL_FOR (or 4
        timeouts, if longer) gives the connection up. A sidecar that stopped answering on
        it (frozen; or an old one stopped while its successor took the socket, in a
        blue/green switch) would otherwise keep it until that process ended."""
        now = time.monotonic()
        if self.heard:
            self.heard = False
            self.quiet_from = now
            return
        quiet = now - self.quiet_from
        if quiet >= max(STALL_FOR, 4 * self.client.timeout):
            self.give_up("no answer on this connection for %d ms (the sidecar stalled?): it is given up, "
                         "the next check redials" % (quiet * 1000))

    def give_up(self, why):
        """End a connection that stalled: close it, unless it holds leases of requests
        still running. The sidecar frees a lease when the connection that took it closes,
        so closing it would free their slots and, after any stall, admit past a
        concurrency rule's max. It is retired instead: detached (the next check redials)
        and sent nothing more, but kept open, its late answers dropped, until its leases
        are released through this client, or have expired, or the client is closed."""
        if self.retired or self.broken is not None:
            return
        client = self.client
        if self.leases <= 0 or time.monotonic() >= self.hold_until or client._closed:
            return self.fail(why)
        self.retired = True
        client._retired.add(self)
        client._detach(self)
        while self.room:  # the checks waiting for room try again, on a new connection
            w = self.room.popleft()
            if not w.done() and not self.loop.is_closed():
                w.set_result(None)
        self.expire()

    def expire(self):
        """Close a retired connection once every lease it holds has expired."""
        left = self.hold_until - time.monotonic()
        if self.leases > 0 and left > 0:
            self.expiry = asyncio.get_running_loop().call_later(left, self.expire)
            return
        self.fail("a connection given up for a stall closed once its leases ended")

    def wake_one(self):
        """Give the place just freed to the first check still waiting for room."""
        while self.room:
            w = self.room.popleft()
            if not w.done():
                w.set_result(None)
                return

    def connection_lost(self, exc):
        if exc is None and self.broken is None and not self.served and not self.pending:
            self.ended_unused = True  # closed with nothing said, no check sent (_do_dial)
        unread = False
        why = "connection lost: %s" % exc if exc else "the sidecar closed the connection"
        if isinstance(exc, (BrokenPipeError, ConnectionResetError)) and self.pending:
            ended = self.read_left()
            if isinstance(exc, BrokenPipeError) and self.served and not ended \
                    and len(self.pending) > len(self.unsent) + 1 and self.read_rest(why):
                return
            # The frame last handed to the transport is unread (with the queued ones after
            # it, which fail gives back in any case) when no byte of an answer came, or it
            # was never whole in the socket: the transport still held part of it (paused:
            # asyncio drops that part unsent), or the write that failed (EPIPE) was its own
            # (the transport writes nothing else: send). Before, part of an answer to an
            # earlier check in buf gave it on_unavailable in those cases too.
            unread = not self.buf or self.paused or isinstance(exc, BrokenPipeError)
        self.fail(why, unread)

    def read_rest(self, why):
        """After a failed write (EPIPE), send its check (the last handed to the
        transport) and the ones queued after it (send) again at once, and read the
        answers still to come to the checks written before it, whole. The daemon at
        --idle-timeout shuts an idle connection's read side, answers what the socket held
        then (a check written as the timeout fired), and closes it: a check written after
        the shut fails its write, and the answer to the one before comes later. Before,
        the connection was failed at once, and that check, decided by the daemon, got
        on_unavailable. The transport closes its socket once connection_lost returns:
        the rest is read on a duplicate of its descriptor, for at most the client's
        timeout (each check's own timer still bounds its wait). Detached at once: no
        check is sent on it any more. False when it cannot be read so."""
        sock = self.transport.get_extra_info("socket") if self.transport is not None else None
        try:
            fd = os.dup(sock.fileno())
        except (AttributeError, OSError):
            return False
        client = self.client
        client._detach(self)
        client._reading_rest.add(self)
        # The failed write's check (the last handed to the transport: its write is the
        # one that failed, so it was never whole in the socket, part of an answer to an
        # earlier check in buf or not) and the ones queued after it go again at once.
        for _ in range(len(self.unsent) + 1):
            _, fut = self.pending.pop()
            if not fut.done():
                fut.set_exception(_NotRead(why))
        self.unsent.clear()
        loop = self.loop
        timer = None

        def end(cause=why, **unread):  # once: fail() calls it, with its flags, when it is in progress
            self.rest_end = None
            client._reading_rest.discard(self)
            timer.cancel()
            if not loop.is_closed():
                loop.remove_reader(fd)
            os.close(fd)
            self.fail(cause, **unread)

        def ready():
            try:
                data = os.read(fd, 65536)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if data:
                self.data_received(data)
                if self.rest_end is None or self.pending:
                    return  # ended (data_received failed it), or more to come
            end()

        self.rest_end = end
        timer = loop.call_later(self.client.timeout, end)
        loop.add_reader(fd, ready)
        return True

    def read_left(self):
        """Hand data_received what the sidecar wrote before a write failed. The sidecar
        refuses a frame over its --max-frame from its header: it answers frame_too_large
        and closes, and the write of the rest fails (EPIPE), though the answer is already
        in the receive queue. When the loop runs the write before the read, the transport
        stops reading and the check would get the policy, not its 431; the socket is still
        open here (the transport closes it after connection_lost), so the answer is read
        from its descriptor (non-blocking: until nothing more, or the end). True when it
        read the end (or a reset)."""
        sock = self.transport.get_extra_info("socket") if self.transport is not None else None
        if sock is None:
            return False
        try:
            fd = sock.fileno()
        except OSError:
            return False
        while self.broken is None and fd >= 0:
            try:
                data = os.read(fd, 65536)
            except BlockingIOError:  # nothing more for now
                return False
            except OSError:  # the connection reset
                return True
            if not data:
                return True
            self.data_received(data)
        return False

    def fail(self, why, unread_last=False, unread_all=False, unread_rest=False):
        """Break the connection once: close it and fail every pending check (with
        _NotRead: those whose frames were queued, never handed to the transport (send),
        and the one before them too when unread_last (the frame last handed to it);
        every one when unread_all, a farewell's, or unread_rest, not a farewell: each is
        sent again once)."""
        if self.broken is not None:
            return
        if self.rest_end is not None:  # read_rest's reading ends with it, its flags kept
            # (a farewell read there says the checks after it were not read: before, they
            # got on_unavailable)
            return self.rest_end(why, unread_last=unread_last, unread_all=unread_all, unread_rest=unread_rest)
        self.broken = why
        if self.transport is not None:
            if not self.loop.is_closed():
                self.transport.close()
            else:
                # Its loop was closed (asyncio.run returned): the transport cannot close
                # through it, nor can any check still wait on it. The socket is shut down,
                # so the sidecar sees the end (and frees its leases); its descriptor is
                # closed when the transport is collected.
                self.pending.clear()
                self.room.clear()
                try:
                    self.transport.get_extra_info("socket").shutdown(socket.SHUT_RDWR)
                except (AttributeError, OSError):
                    pass
        self.client._detach(self)
        if self.retired:
            self.client._retired.discard(self)
            if self.expiry is not None:
                self.expiry.cancel()
        err = ConnectionError(why)
        unread_tail = len(self.unsent) + (1 if unread_last else 0)  # the last pending checks not read
        self.unsent.clear()
        while self.pending:
            _, fut = self.pending.popleft()
            if not fut.done():
                fut.set_exception(_NotRead(why, unread_all, unread_all and self.fresh_farewell)
                                  if unread_all or unread_rest or len(self.pending) < unread_tail else err)
        while self.room:  # the checks waiting for room try again, on a new connection
            w = self.room.popleft()
            if not w.done():
                w.set_result(None)


def _expire(fut):
    if not fut.done():
        fut.set_exception(TimeoutError("no answer within the timeout"))


class AsyncClient:
    """Asks one sidecar for decisions from asyncio code, pipelining every check over one
    kept-alive connection: concurrent checks each write their frame at once (no waiting
    for the previous answer) and the answers, which come back in order, are matched to
    them. Use it from one event loop at a time (it is not thread-safe): a check on
    another loop than its connection's (asyncio.run called again) dials a connection of
    its own, and the old one is closed once its loop is.

    ``timeout`` (seconds, default 50 ms) bounds each check; when the sidecar gives no
    answer by then — socket missing, refused, dropped, stalled — check() returns the
    ``on_unavailable`` decision ("open" allows, "closed" rejects; degraded and unreachable
    are True). A late answer is dropped and the connection stays in use; a lease the late
    answer took is released (the check was decided without its slot). A broken
    connection is redialled by the next check; failed dials back off from 10 ms to 1 s,
    and meanwhile checks answer by the policy at once. An unreachable sidecar is logged as
    by Client (logger "rlsidecar").

    A request over ``max_frame`` bytes is not sent: check() raises RequestTooLargeError
    (a 431), as Client.check does.

    check() raises only ProtocolError (a malformed request; RequestTooLargeError) and
    ClosedError. Close it with ``await client.close()`` or ``async with``.
    """

    def __init__(self, socket_path, timeout=0.05, on_unavailable="open", max_frame=_proto.MAX_FRAME):
        _check_options(socket_path, timeout, on_unavailable, max_frame)
        self.socket_path = socket_path
        self.timeout = float(timeout)
        self.on_unavailable = on_unavailable
        self.max_frame = max_frame
        self._conn = None
        self._dial = None  # the dial task in progress
        self._closed = False
        self._failures = 0
        self._retry_at = 0.0
        self._last_error = None
        self._orphans = set()  # tasks releasing the leases of late answers
        self._leases = {}  # lease -> [connection that took it, (monotonic) expiry]: not yet released
        self._lease_prune = 0
        self._retired = set()  # connections given up for a stall while holding leases (give_up)
        self._reading_rest = set()  # connections reading answers after a failed write (read_rest)
        self._outage = OutageLog(socket_path, on_unavailable)  # logs an unreachable sidecar
        _clients.add(self)

    def _forget_connection(self):
        """In a forked child: drop the connection inherited from the parent, unused. Its
        transport belongs to the parent's event loop, which closes this process's copy
        of the descriptor if it is ever run or collected here; closing it from outside
        the transport could close another descriptor given the same number since."""
        self._conn, self._dial, self._orphans = None, None, set()
        self._leases, self._retired = {}, set()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()

    async def close(self):
        """Close the connection, failing checks in flight (they answer by the policy);
        later checks raise ClosedError. Idempotent."""
        self._closed = True
        if self._dial is not None and self._dial.get_loop() is asyncio.get_running_loop():
            self._dial.cancel()
            try:
                await self._dial
            except BaseException:
                pass
        self._dial = None
        if self._conn is not None:
            self._conn.fail("client closed")
        for conn in list(self._retired) + list(self._reading_rest):
            conn.fail("client closed")

    def _track_lease(self, conn, lease, msg):
        """Note a lease taken on conn; its answer's rules say how long it lasts at least
        (a concurrency rule's window is its lease). Forgotten at its release, or once
        expired if never released."""
        now = time.monotonic()
        rules = msg.get("rules")
        until = now + _proto.lease_ms([r for r in rules if isinstance(r, dict)] if isinstance(rules, list) else ()) / 1000
        if len(self._leases) >= max(self._lease_prune, 1024):
            for k, v in list(self._leases.items()):
                if now > v[1]:
                    del self._leases[k]
                    v[0].leases -= 1
            self._lease_prune = 2 * len(self._leases)
        if lease in self._leases:
            return
        self._leases[lease] = [conn, until]
        conn.leases += 1
        conn.hold_until = max(conn.hold_until, until)

    def _lease_renewed(self, lease, expires_ms):
        v = self._leases.get(lease)
        if v is not None:
            until = time.monotonic() + expires_ms / 1000
            v[1] = max(v[1], until)
            v[0].hold_until = max(v[0].hold_until, until)

    def _lease_ended(self, lease):
        """Forget a lease whose release ended, answered or not (or whose check's caller
        had left); a retired connection that held it closes once it holds no other."""
        v = self._leases.pop(lease, None)
        if v is not None:
            v[0].leases -= 1
            if v[0].retired and v[0].leases <= 0:
                v[0].fail("a connection given up for a stall closed once its leases ended")

    async def check(self, attrs, cost=1, limits=None):
        """Ask whether a request with these attributes may pass; see Client.check."""
        msg = await self._round_trip(_proto.body(_proto.check_message(0, attrs, cost, limits)))
        if isinstance(msg, str):
            self._outage.unreachable(msg)
            return Decision(self.on_unavailable == "open", degraded=True, unreachable=True, cause=msg)
        if self._outage.failing:
            self._outage.answered()
        e = _proto.error_of(msg)
        if e is not None and e[0] in ("frame_too_large", "attr_too_large"):
            raise _proto.RequestTooLargeError(e[1], e[0])
        if e is not None:
            d = Decision(self.on_unavailable == "open", degraded=True, cause="%s: %s" % e)
            raise _proto.ProtocolError(e[0], e[1], d)
        return _proto.decision(msg)

    async def release(self, lease):
        """Free the slots ``lease`` holds; see Client.release (False, too, when the
        sidecar is unreachable or slow, or the client closed: call it in a finally). Its
        one connection holds every lease it took: closing the client frees them."""
        if not lease:
            return False
        try:
            msg = await self._lease_call("release", lease, None)
        except (OSError, _proto.ClosedError):
            return False
        finally:
            # Answered or not, the caller is done with the lease: a connection retired for
            # a stall that holds no other closes now, which frees it on the sidecar.
            # Before, an unanswered release (the sidecar still stalled) kept that
            # connection open, its descriptor held, until the lease expired (up to an hour).
            self._lease_ended(lease)
        return bool(msg.get("released", False))

    def _release_orphan(self, lease):
        """Release, in a task, the lease of an answer that came after its check gave up
        (its timeout, or its task cancelled): the check was decided without the slot, and
        nothing else would free it before it expires (a sidecar slowed past the timeout
        would otherwise leave a slot held for a whole lease per late admission)."""
        # No request runs under it: a connection retired for a stall need not stay open
        # for it (closing frees it as the release does), whether or not the release is
        # answered. Before, it was tracked until its release was answered, and a retired
        # connection stayed open for it, for a whole lease when that release failed.
        self._lease_ended(lease)
        if self._closed:
            return  # close() closes the connection, which frees its leases
        task = asyncio.get_running_loop().create_task(self._quiet_release(lease))
        self._orphans.add(task)  # a task nobody references may be collected mid-run
        task.add_done_callback(self._orphans.discard)

    async def _quiet_release(self, lease):
        try:
            await self.release(lease)
        except (ConnectionError, _proto.ProtocolError, _proto.ClosedError):
            pass  # unreachable or closed: the lease expires, or goes with its connection

    async def renew(self, lease, lease_ms=None):
        """Extend a live lease; returns (renewed, expires_ms). See Client.renew."""
        msg = await self._lease_call("renew", lease, lease_ms)
        renewed, expires_ms = bool(msg.get("renewed", False)), msg.get("expires_ms", 0)
        if renewed:
            self._lease_renewed(lease, expires_ms)
        return renewed, expires_ms

    async def _lease_call(self, op, lease, lease_ms):
        # A release is sent again after any break of its connection, read or not: it is
        # idempotent, and sent to the sidecar's successor when this one died (SIGKILL)
        # it frees a global lease's slots in Redis. Failed, they stayed held for the
        # whole lease with no request running.
        msg = await self._round_trip(_proto.body(_proto.lease_message(0, op, lease, lease_ms)),
                                     repeatable=op == "release")
        if isinstance(msg, str):
            raise ConnectionError("rlsidecar: sidecar unreachable: " + msg)
        e = _proto.error_of(msg)
        if e is not None:
            raise _proto.ProtocolError(*e)
        return msg

    async def ping(self):
        """Return the sidecar's version string; raises ConnectionError when unreachable."""
        msg = await self._round_trip(_proto.body({"id": 0, "op": "ping"}))
        if isinstance(msg, str):
            raise ConnectionError("rlsidecar: sidecar unreachable: " + msg)
        e = _proto.error_of(msg)
        if e is not None:
            raise _proto.ProtocolError(*e)
        return msg.get("version", "")

    async def _round_trip(self, body, repeatable=False):
        """Send the request body (from _proto.body) and return the answer map, or a str
        saying why there is none. RequestTooLargeError, before anything is sent, when it
        is over max_frame. repeatable: the request may be sent twice (a release), so it
        is sent again, once, when its connection breaks, whether or not it was read."""
        if self._closed:
            raise _proto.ClosedError("rlsidecar: client closed")
        _proto.check_size(len(body), self.max_frame)  # with the shortest id: before dialing
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        resent = False
        fresh_farewells = 0
        while True:
            msg = await self._send_once(loop, body, deadline, repeatable)
            if not isinstance(msg, _NotRead):
                return msg
            if self._closed:
                raise _proto.ClosedError("rlsidecar: client closed") from None
            if (resent and not msg.farewell) or loop.time() >= deadline:
                return str(msg)
            if msg.farewell and msg.fresh:
                # A farewell on a connection that had answered nothing: once, after a
                # pause. Before, a sidecar that says farewell to every connection was
                # redialed in a loop for the check's whole timeout (2,800 a second).
                fresh_farewells += 1
                if fresh_farewells > 1 or loop.time() + FRESH_FAREWELL_PAUSE >= deadline:
                    return str(msg)
                await asyncio.sleep(FRESH_FAREWELL_PAUSE)
            resent = True  # not read by the sidecar: sent again, once, within the deadline

    async def _send_once(self, loop, body, deadline, repeatable=False):
        """One attempt of _round_trip: the answer map, a str saying why there is none, or
        a _NotRead (the sidecar certainly did not read it)."""
        woken = False
        closing = False  # this check waited for a closing connection to be given up
        while True:
            conn = self._conn
            if conn is not None and conn.loop is not loop:
                self._moved(conn)
                conn = None
            if conn is None:
                conn = await self._connect(loop, deadline)
                if isinstance(conn, (str, _NotRead)):
                    return conn
            if conn.broken is not None:
                return conn.broken
            if conn.transport.is_closing():
                # A write failed (EPIPE: a restart's drain closed the connection) or the
                # sidecar closed it, and the connection_lost that gives it up is due: the
                # transport would drop this frame unsent, and the check get the policy.
                # Nothing was sent: wait for that, then go to a new connection.
                if loop.time() >= deadline:
                    return "no answer within the timeout"
                await asyncio.sleep(0.001 if closing else 0)  # connection_lost runs first
                closing = True
                continue
            # Room, and no earlier check waiting for it (one just woken goes first).
            if len(conn.pending) < MAX_PENDING and (woken or not conn.room):
                break
            w = loop.create_future()
            conn.room.append(w)
            timer = loop.call_at(deadline, _expire, w)
            try:
                await w
            except TimeoutError:
                # The full connection left this check unanswered for its whole timeout, as
                # if it had timed out on it: that counts toward its stall (timed_out). Else
                # a connection a stalled sidecar filled (a burst of MAX_PENDING) was never
                # given up: no check was sent on it, so none timed out on it, and every
                # check answered by the policy until that process ended.
                conn.timed_out()
                return "no room on the connection within the timeout (%d checks in flight)" % MAX_PENDING
            finally:
                timer.cancel()
            woken = True
        frame = _proto.frame(body, conn.next_id + 1)
        _proto.check_size(len(frame) - 4, self.max_frame)  # with its id; before anything is queued
        conn.next_id += 1
        fut = loop.create_future()
        conn.pending.append((conn.next_id, fut))
        conn.send(frame)
        timer = loop.call_at(deadline, _expire, fut)
        try:
            return await fut
        except TimeoutError:
            conn.timed_out()
            return "no answer within the timeout"
        except asyncio.CancelledError:
            # Cancelled in the loop iteration its answer came in: the answer is set, so
            # data_received did not take it for a late one, and nobody will see its lease.
            # Released here, as a late answer's is (it held the slot for a whole lease).
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                lease = fut.result().get("lease")
                if isinstance(lease, str) and lease:
                    self._release_orphan(lease)
            raise
        except _NotRead as e:
            return e
        except ConnectionError as e:
            if self._closed:
                raise _proto.ClosedError("rlsidecar: client closed") from None
            if repeatable:
                return _NotRead(str(e))
            return str(e)
        finally:
            timer.cancel()

    def _moved(self, conn):
        """This check runs on another event loop than the one conn was dialed on: a
        client kept across asyncio.run calls (one per job or per request), or across a
        test framework's loop per test. Only its own loop reads conn: a check sent on
        it here would never see its answer. Before, every check timed out on it, then
        one raised RuntimeError ("Event loop is closed"), and every later one answered
        by the policy at once, for good. conn is detached, and this check dials its
        own. When its loop is closed, nothing can use conn again: it is closed, or
        retired while it holds leases not yet expired (they may be released from this
        loop). A loop still open gives conn up when it next runs (closed, or retired
        while it holds leases): dropped unclosed, a client used from two loops in turn
        kept a socket open for every switch, out of reach of close()."""
        self._conn = None
        if conn.loop.is_closed():
            conn.give_up("its event loop is closed")
        else:
            try:
                conn.loop.call_soon_threadsafe(conn.give_up, "the client went on to another event loop")
            except RuntimeError:  # closed meanwhile (by another thread)
                conn.give_up("its event loop is closed")

    async def _connect(self, loop, deadline):
        if self._dial is not None and self._dial.get_loop() is not loop:
            self._dial = None  # another loop's (see _moved): this one dials its own
        if self._dial is None:
            if self._failures and time.monotonic() < self._retry_at:
                return "backing off after %d failed attempt(s): %s" % (self._failures, self._last_error)
            self._dial = loop.create_task(self._do_dial())
        try:
            return await asyncio.wait_for(asyncio.shield(self._dial), max(deadline - loop.time(), 0))
        except asyncio.TimeoutError:
            return "no connection within the timeout"
        except asyncio.CancelledError:
            if self._closed:  # close() cancelled the dial this check waited for
                raise _proto.ClosedError("rlsidecar: client closed") from None
            raise

    async def _do_dial(self):
        try:
            for attempt in range(2):
                try:
                    _, conn = await asyncio.wait_for(
                        asyncio.get_running_loop().create_unix_connection(lambda: _Protocol(self), self.socket_path),
                        max(self.timeout, 0.1))
                except (OSError, asyncio.TimeoutError) as e:
                    self._failed("connecting to %s: %s" % (self.socket_path, e or "timed out"))
                    return self._last_error
                if self._closed:
                    conn.fail("client closed")
                    return "client closed"
                if conn.broken is None:
                    self._conn = conn
                    return conn
                if conn.ended_unused and attempt == 0:
                    # Closed with nothing said before this dial took it: the daemon's
                    # --idle-timeout, when the event loop ran late (under load) between
                    # the accept and this resumption. No check was sent on it: dialed
                    # again, once (a sidecar that drops every connection it accepts is
                    # backed off after the second). Before, the checks waiting for the
                    # dial answered by the policy, "the sidecar closed the connection".
                    continue
                # It ended before this dial took it (a farewell or a too_many_connections
                # refusal the moment it was accepted, read while the dial was resuming):
                # its fail() had no connection to detach. Kept, it answered every later
                # check with this cause at once, never redialing. A failed attempt, as one
                # detached.
                self._failed(conn.broken)
                if conn.farewell_unused:
                    # A drain's farewell (shutting_down), with no check sent on it: the
                    # checks waiting for this dial go again, once, after a pause, as
                    # after a fresh connection's farewell read once a check was written
                    # (_round_trip), to the drain's successor. Before, they answered by
                    # the policy at once. A refusal (too_many_connections) answers by the
                    # policy either way (the README's "Unreachable sidecar").
                    return _NotRead(conn.broken, farewell=True, fresh=True)
                return conn.broken
        finally:
            if self._dial is asyncio.current_task():
                self._dial = None

    def _failed(self, why):
        self._failures += 1
        self._retry_at = time.monotonic() + backoff(self._failures)
        self._last_error = why

    def _detach(self, conn):
        if self._conn is not conn:
            return
        self._conn = None
        if conn.served:
            self._failures = 0
        else:
            self._failed(conn.broken)
