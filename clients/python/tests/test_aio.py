"""The asyncio client against the real daemon: pipelining on one connection, timeouts
with the late answer dropped, an unreachable sidecar."""

import asyncio
import os
import time

import pytest

import rlsidecar
from conftest import RULES
from fixedwindow import in_one_window_async


def run(coro):
    return asyncio.run(coro)


def test_pipelined_checks_on_one_connection(daemon):
    async def main():
        async with rlsidecar.AsyncClient(daemon.socket, timeout=2) as c:
            assert await c.ping()
            conn = c._conn

            def burst(n):
                lim = [{"key": "shared%d" % n, "limit": 150, "window_ms": 3600000, "algorithm": "fixed_window"}]
                return asyncio.gather(*(c.check({}, limits=lim) for _ in range(200)))
            ds = await in_one_window_async(3600000, burst)
            assert c._conn is conn  # one connection carried them all
            assert sum(d.allowed for d in ds) == 150
            # Pipelined in order: the answers' remaining count down with the request order.
            assert [d.remaining for d in ds[:150]] == list(range(149, -1, -1))
            assert all(not d.allowed and d.retry_after_ms > 0 for d in ds[150:])
    run(main())


def test_decisions_and_errors(daemon):
    async def main():
        async with rlsidecar.AsyncClient(daemon.socket, timeout=2) as c:
            sent = time.monotonic()
            ds = [await c.check({"user": "alice"})]
            await asyncio.sleep(0.01)  # so the retry is not whole seconds: rounding down would show
            ds += [await c.check({"user": "alice"}) for _ in range(5)]
            gap_ms = (time.monotonic() - sent) * 1000
            assert [d.allowed for d in ds] == [True] * 5 + [False]
            # 12 s after the first decision, less the time until the last (at most gap_ms),
            # rounded up to whole seconds: 12 unless the checks took over 1 s (it was "12":
            # a loaded machine failed the test).
            retry = ds[-1].retry_after_ms
            assert 12000 - gap_ms - 1 <= retry <= 12000, (retry, gap_ms)
            assert ds[-1].headers()["Retry-After"] == str(-(-retry // 1000))
            with pytest.raises(rlsidecar.ProtocolError) as e:
                await c.check({}, limits=[{"key": "k", "limit": 0, "window_ms": 1}])
            assert e.value.code == "invalid_limit" and e.value.decision.degraded
            with pytest.raises(TypeError):
                await c.check({"user": 7})
            assert (await c.check({"user": "bob"})).remaining == 4
        with pytest.raises(rlsidecar.ClosedError):
            await c.check({"user": "bob"})
    run(main())


@pytest.mark.parametrize("policy", ["open", "closed"])
def test_missing_socket(short_tmp, policy):
    # A timeout of 5 s: a missing socket fails the dial at once (ENOENT), and that is the
    # cause asserted. At the default 50 ms, an event loop run late (a loaded machine) let
    # the check's timeout come first: "no connection within the timeout" (1 run of the
    # suite in 10 under load).
    async def main():
        c = rlsidecar.AsyncClient(os.path.join(short_tmp, "none.sock"), on_unavailable=policy, timeout=5)
        d = await c.check({"user": "x"})
        assert d.allowed == (policy == "open") and d.degraded and d.unreachable and "none.sock" in d.cause
        causes = [(await c.check({"user": "x"})).cause for _ in range(20)]
        assert any("backing off" in cause for cause in causes), causes
        with pytest.raises(ConnectionError):
            await c.ping()
        await c.close()
    run(main())


def test_stalled_sidecar_late_answers_dropped(daemon):
    async def main():
        async with rlsidecar.AsyncClient(daemon.socket, timeout=2, on_unavailable="closed") as c:
            assert (await c.check({"user": "frank"})).remaining == 4
            conn = c._conn
            c.timeout = 0.1  # for the stalled checks only: the answers after them are awaited 2 s
            daemon.pause()
            try:
                t = time.monotonic()
                ds = await asyncio.gather(*(c.check({"user": "frank"}) for _ in range(3)))
                took = time.monotonic() - t
            finally:
                daemon.resume()
            c.timeout = 2
            assert all(not d.allowed and d.unreachable and "timeout" in d.cause for d in ds), ds
            assert 0.09 <= took < 3.0  # bounded by the timeout, not the daemon: it never answers while stopped
            # The connection stays; the three late answers are dropped in order, and the
            # next check gets its own answer (the three consumed when the daemon woke).
            d = await c.check({"user": "frank"})
            assert c._conn is conn
            assert d.allowed and not d.degraded and d.remaining == 0
    run(main())


async def _switch_to_successor(c, daemon, make_daemon, user, within):
    """Starts a successor to the frozen daemon on its socket's path (as in a blue/green
    switch) and checks user with c until an answer comes, failing after ``within``
    seconds; returns that answer. The successor allows 7 a user where the frozen daemon
    allows 5, so an answer's limit tells which one gave it."""
    successor = make_daemon(RULES.replace("requests: 5,", "requests: 7,"))
    os.rename(successor.socket, daemon.socket)  # the successor takes the path
    switched = time.monotonic()
    while True:
        d = await c.check({"user": user})
        if not d.unreachable:
            return d
        assert time.monotonic() - switched < within, \
            "still unanswered %d s after the switch (%s): the client keeps the frozen sidecar's connection" % (
                within, d.cause)


def test_stalled_connection_redials(daemon, make_daemon):
    """A sidecar that stops answering on its connection (frozen; or an old one stopped
    while its successor took the socket, in a blue/green switch) loses it: a connection
    that answers nothing for max(1 s, 4 timeouts) while checks time out on it is closed,
    and the next check redials, reaching whoever serves the socket now. Before, the
    client kept sending on it until the old process ended."""
    async def main():
        async with rlsidecar.AsyncClient(daemon.socket, timeout=0.02) as c:
            assert (await c.check({"user": "hal"})).allowed
            daemon.pause()
            try:
                assert (await c.check({"user": "hal"})).unreachable
                d = await _switch_to_successor(c, daemon, make_daemon, "hal", 3)
                # The successor's answer, from its own count. Its first check of hal may have
                # timed out on a slow machine and still have been counted.
                assert d.allowed and d.limit == 7 and d.remaining <= 6, d
            finally:
                daemon.resume()
    run(main())


def test_full_stalled_connection_redials(daemon, make_daemon):
    """As test_stalled_connection_redials, when the frozen sidecar's connection is full:
    a burst fills it with MAX_PENDING checks it never answers, and every later check waits
    for room and times out there, never sent on it. Such a timeout is a check the
    connection left unanswered too: it counts toward the stall. Before, only a check that
    timed out after it was sent counted, so a full connection was never given up: every
    check answered by the policy until the old process ended."""
    from rlsidecar import aio

    async def main():
        # Connected with a timeout of 5 s, then 20 ms for the checks of the test: the
        # ping's dial and answer within 20 ms failed on a loaded machine ("no connection
        # within the timeout", 1 run of the suite in 2 at load 10).
        async with rlsidecar.AsyncClient(daemon.socket, timeout=5) as c:
            await c.ping()
            c.timeout = 0.02
            daemon.pause()
            try:
                burst = await asyncio.gather(*(c.check({"user": "ida"}) for _ in range(aio.MAX_PENDING + 100)))
                assert all(d.unreachable for d in burst)
                assert c._conn is not None and len(c._conn.pending) == aio.MAX_PENDING, "the connection is full"
                d = await _switch_to_successor(c, daemon, make_daemon, "ida", 10)
                # The successor's own count (its first check of ida may have timed out).
                assert d.allowed and d.limit == 7 and d.remaining <= 6, d
            finally:
                daemon.resume()
    run(main())


RULES_ONE_SLOT = """
rules:
  - name: exports
    key: user
    concurrency: { max: 1, lease: 30s }
"""


def test_stall_keeps_leases_of_running_requests(make_daemon):
    """The sidecar frees a lease when the connection that took it closes. A connection
    given up for a stall that holds the lease of a request still running is retired, not
    closed: the next check redials, and the slot stays held until the lease is released.
    Before, it was closed, and once the daemon resumed it freed the slot: with max 1, a
    second request was admitted beside the first."""
    daemon = make_daemon(RULES_ONE_SLOT)

    async def main():
        async with rlsidecar.AsyncClient(daemon.socket, timeout=2) as c:
            first = await c.check({"user": "ann"})
            assert first.allowed and first.lease
            # 100 ms for the checks of the stall (given up after 1 s of them); every answer
            # after it is awaited 2 s: a release or a check that a loaded machine answers
            # in more than 100 ms is not a failure of what this tests.
            c.timeout = 0.1
            daemon.pause()
            try:
                start = time.monotonic()
                while not c._retired and time.monotonic() - start < 5:
                    assert (await c.check({"user": "bob"})).unreachable
                    await asyncio.sleep(0)
                assert len(c._retired) == 1, "the stalled connection holding a lease is retired"
            finally:
                daemon.resume()
            c.timeout = 2
            second = await c.check({"user": "ann"})
            assert not second.unreachable, second.cause
            assert not second.allowed, "a second request admitted beside the first: the stall freed its slot"
            assert await c.release(first.lease)
            assert not c._retired, "the retired connection is closed once its lease is released"
            third = await c.check({"user": "ann"})
            assert third.allowed and third.lease, third
            assert await c.release(third.lease)
    run(main())


@pytest.mark.parametrize("lease,release", [("3s", False), ("30s", True)], ids=["never-released", "release-unanswered"])
def test_retired_connection_held_for_the_lease_not_a_rate_window(make_daemon, lease, release):
    """A connection retired for a stall while it holds a lease never released is closed
    once that lease has expired: its lease is the concurrency rule's window, not the
    longest window of the answer's rules. Before, a check that also matched a rule of 1
    per day kept the retired connection open for a day, for each stall.

    A release the stalled daemon does not answer ends the lease all the same: the retired
    connection holding it, holding no other, is closed at once, which frees the lease on
    the daemon once it runs again. Before, it stayed open, its descriptor held, until the
    lease expired (30 s here, up to an hour)."""
    daemon = make_daemon(RULES_ONE_SLOT.replace("lease: 30s", "lease: " + lease)
                         + "  - name: per-day\n    key: user\n    limit: { requests: 1000, per: 1d }\n")

    async def main():
        async with rlsidecar.AsyncClient(daemon.socket, timeout=2) as c:
            first = await c.check({"user": "ann"})
            assert first.allowed and first.lease
            c.timeout = 0.1
            daemon.pause()
            try:
                start = time.monotonic()
                while not c._retired and time.monotonic() - start < 5:
                    assert (await c.check({"user": "bob"})).unreachable
                    await asyncio.sleep(0)
                assert len(c._retired) == 1, "the stalled connection holding a lease is retired"
                if release:
                    assert await c.release(first.lease) is False  # unanswered: the daemon is stopped
                start = time.monotonic()
                while c._retired and time.monotonic() - start < 5:
                    await asyncio.sleep(0.05)
                assert not c._retired, "the retired connection was held past its lease's end"
                assert not c._leases or not release, "the released lease is still tracked"
            finally:
                daemon.resume()
            if release:  # closing it was the release: the slot is free once the daemon runs
                c.timeout = 2
                deadline = time.monotonic() + 5
                again = await c.check({"user": "ann"})
                while not again.allowed and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                    again = await c.check({"user": "ann"})
                assert again.allowed and again.lease, again
                assert await c.release(again.lease)
    run(main())


def test_late_lease_does_not_keep_a_retired_connection(short_tmp):
    """A late answer's lease (its check timed out: _release_orphan) does not keep a retired
    connection open: no request runs under it, and closing frees it as the release does.
    Before, it was tracked until its release was answered, and a retired connection that
    had taken it stayed open (for the whole lease when that release was not answered in
    time), the other slots it held with it. A scripted stand-in: the first connection
    answers ann's check with a lease, then stalls; once it is retired it answers a held
    check late, with a lease; the second connection answers that lease's release only
    after its timeout."""
    import msgpack
    from rlsidecar import _proto

    path = os.path.join(short_tmp, "script.sock")
    rule = {"name": "exports", "limit": 1, "remaining": 0, "reset_ms": 0, "window_ms": 30000}
    writers, held = [], []
    orphan_asked = asyncio.Event()

    def send(w, m):
        body = msgpack.packb(m)
        w.write(len(body).to_bytes(4, "big") + body)

    async def serve(reader, writer):
        writers.append(writer)
        n = len(writers)
        try:
            while True:
                head = await reader.readexactly(4)
                req = _proto.decode(await reader.readexactly(_proto.frame_length(head)))
                if req.get("op") == "ping":
                    send(writer, {"id": req["id"], "version": "script"})
                elif n == 1 and req.get("attrs", {}).get("user") == "ann":
                    send(writer, {"id": req["id"], "allowed": True, "lease": "A", "rules": [rule]})
                elif n == 1:
                    held.append(req)  # the stall
                elif req.get("op") == "release":
                    if req["lease"] == "B":
                        orphan_asked.set()
                        await asyncio.sleep(0.15)  # past the release's timeout
                    send(writer, {"id": req["id"], "released": True})
                else:
                    send(writer, {"id": req["id"], "allowed": False, "lease": "", "retry_after_ms": 1000,
                                  "rules": [rule]})
        except (asyncio.IncompleteReadError, ConnectionError):
            pass

    async def main():
        srv = await asyncio.start_unix_server(serve, path)
        try:
            async with rlsidecar.AsyncClient(path, timeout=2) as c:
                a = await c.check({"user": "ann"})
                assert a.allowed and a.lease == "A", a
                # 50 ms from here: the stall's checks, and the late lease's release (answered
                # 150 ms late). The last release is awaited 2 s: the stand-in answers it at
                # once, but a loaded machine may take longer than 50 ms.
                c.timeout = 0.05
                start = time.monotonic()
                while not c._retired and time.monotonic() - start < 5:
                    assert (await c.check({"user": "bob"})).unreachable
                assert len(c._retired) == 1, "the stalled connection holding a lease is retired"
                send(writers[0], {"id": held[0]["id"], "allowed": True, "lease": "B", "rules": [rule]})  # late
                await asyncio.wait_for(orphan_asked.wait(), 2)
                await asyncio.sleep(0.3)  # that release timed out, then came late
                c.timeout = 2
                assert await c.release(a.lease)
                assert not c._retired, "the retired connection closed once the running request's lease was released"
        finally:
            for w in writers:
                w.close()
            srv.close()
            await srv.wait_closed()
    run(main())


def test_check_cancelled_as_its_answer_came_releases_its_lease(make_daemon, monkeypatch):
    """A check whose task is cancelled in the loop iteration its answer came in (an ASGI
    server cancelling the request as its client goes, asyncio.wait_for timing out): the
    answer is set on the check's future, not dropped as a late one, but the task raises
    CancelledError and nobody sees its lease. The client releases it, as a late answer's.
    Before, the slot stayed held for the whole lease (30 s; max 1: every later request of
    the user refused). The wrapper below only times the cancellation: it cancels the task
    right after the client has read the answer."""
    from rlsidecar import aio

    daemon = make_daemon(RULES_ONE_SLOT)
    victims = []
    read = aio._Protocol.data_received

    def data_received(self, data):
        read(self, data)
        while victims:
            victims.pop().cancel()
    monkeypatch.setattr(aio._Protocol, "data_received", data_received)

    async def main():
        async with rlsidecar.AsyncClient(daemon.socket, timeout=2) as c:
            await c.ping()  # connected: the next data_received is the check's answer
            task = asyncio.ensure_future(c.check({"user": "ann"}))
            victims.append(task)
            with pytest.raises(asyncio.CancelledError):
                await task
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                if (await c.check({"user": "ann"}, cost=0)).rules[0].remaining == 1:
                    break
                await asyncio.sleep(0.01)
            assert (await c.check({"user": "ann"}, cost=0)).rules[0].remaining == 1, \
                "the cancelled check's lease still holds the slot"
            assert not c._leases
    run(main())


def test_client_kept_across_event_loops(make_daemon):
    """One AsyncClient used by one asyncio.run after another (a job runner, a test
    framework's loop per test): each loop's checks are answered by the sidecar on a
    connection of that loop. Before, the second loop's checks were sent on the first
    loop's connection, which nothing read any more: each timed out (counted by the
    daemon all the same), one then raised RuntimeError ("Event loop is closed"), and
    every later one answered by the policy at once, for good. A lease taken on a loop
    since closed still holds its slot until it is released from the next loop."""
    daemon = make_daemon(RULES + RULES_ONE_SLOT.replace("rules:\n", "").replace("key: user", "key: job"))
    c = rlsidecar.AsyncClient(daemon.socket, timeout=2)

    async def check(attrs, cost=1):
        return await c.check(attrs, cost)
    try:
        ds = [asyncio.run(check({"user": "ann"})) for _ in range(3)]
        assert [(d.unreachable, d.remaining) for d in ds] == [(False, 4), (False, 3), (False, 2)], ds
        held = asyncio.run(check({"job": "nightly"}))
        assert held.allowed and held.lease
        free = asyncio.run(check({"job": "nightly"}, cost=0))
        assert not free.unreachable and [r.remaining for r in free.rules] == [0], \
            "the lease's slot was freed when its loop ended"
        assert asyncio.run(c.release(held.lease)) is True
        assert not c._retired, "the closed loop's connection is closed once its lease is released"
        assert [r.remaining for r in asyncio.run(check({"job": "nightly"}, cost=0)).rules] == [1]
    finally:
        asyncio.run(c.close())


def _sockets():
    """How many sockets this process has open."""
    n = 0
    for f in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink("/proc/self/fd/" + f).startswith("socket:")
        except OSError:
            pass
    return n


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts sockets in /proc/self/fd")
def test_client_alternating_open_event_loops_leaves_no_connection_behind(daemon):
    """One AsyncClient used from two event loops in turn, neither closed (run_until_complete
    on each): each switch dialed a connection on the loop now running and dropped the
    other loop's without closing it, a socket held open (and out of reach of close())
    for every switch: 20 after 20 checks. The other loop's connection is now given up on
    that loop, when it next runs."""
    c = rlsidecar.AsyncClient(daemon.socket, timeout=2)
    loops = [asyncio.new_event_loop() for _ in range(2)]
    try:
        base = _sockets()
        for _ in range(10):
            for loop in loops:
                assert not loop.run_until_complete(c.check({"user": "alt"}, cost=0)).unreachable
        for loop in loops:
            loop.run_until_complete(asyncio.sleep(0.05))  # the closes each loop has scheduled
        assert _sockets() - base <= 2, "connections left open: %d" % (_sockets() - base)
    finally:
        loops[-1].run_until_complete(c.close())
        for loop in loops:
            loop.run_until_complete(asyncio.sleep(0.05))
            loop.close()


def test_restarted_sidecar(daemon):
    async def main():
        async with rlsidecar.AsyncClient(daemon.socket, timeout=0.5) as c:
            assert (await c.check({"user": "gina"})).allowed
            daemon.stop()
            await asyncio.sleep(0.05)
            d = await c.check({"user": "gina"})
            assert d.allowed and d.unreachable
            daemon.start()
            deadline = time.monotonic() + 5
            while True:
                d = await c.check({"user": "gina"})
                if not d.unreachable or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.01)
            assert not d.unreachable and d.remaining == 4
    run(main())


def test_close_during_dial(daemon):
    """A check waiting for the connection when close() is called raises ClosedError."""
    async def main():
        c = rlsidecar.AsyncClient(daemon.socket, timeout=2)
        t = asyncio.ensure_future(c.check({"user": "x"}))
        await asyncio.sleep(0)  # the check has started the dial and waits for it
        await c.close()
        with pytest.raises(rlsidecar.ClosedError):
            await t
    run(main())


def test_frame_too_large_then_the_next_check_is_answered(daemon):
    async def main():
        async with rlsidecar.AsyncClient(daemon.socket, timeout=2) as c:
            assert (await c.check({"user": "ivy"})).allowed
            with pytest.raises(rlsidecar.ProtocolError) as e:
                await c.check({"user": "ivy", "blob": "x" * 70000})
            assert e.value.code == "frame_too_large"
            d = await c.check({"user": "ivy"})
            assert d.allowed and not d.degraded and d.remaining == 3, d
    run(main())


def test_burst_beyond_the_cap_waits_for_room(daemon, monkeypatch):
    """More concurrent checks than a connection holds (MAX_PENDING, made 8 here) are all
    answered by the sidecar: those past the cap wait for room, in turn, within their
    timeout. Before, they answered by the policy at once, so under "open" a burst of
    concurrent requests got past every limit."""
    monkeypatch.setattr(rlsidecar.aio, "MAX_PENDING", 8)

    async def main():
        async with rlsidecar.AsyncClient(daemon.socket, timeout=2, on_unavailable="open") as c:
            def burst(n):
                lim = [{"key": "burst%d" % n, "limit": 100, "window_ms": 3600000, "algorithm": "fixed_window"}]
                return asyncio.gather(*(c.check({}, limits=lim) for _ in range(300)))
            ds = await in_one_window_async(3600000, burst)
            assert not any(d.degraded for d in ds), [d.cause for d in ds if d.degraded][:3]
            assert sum(d.allowed for d in ds) == 100
            assert max(len(c._conn.pending), 0) == 0 and not c._conn.room
    run(main())


def test_waiting_for_room_ends_at_the_timeout(daemon, monkeypatch):
    """A check waiting for room on a stalled sidecar answers by the policy at its
    timeout, not before and not much after."""
    monkeypatch.setattr(rlsidecar.aio, "MAX_PENDING", 2)

    async def main():
        async with rlsidecar.AsyncClient(daemon.socket, timeout=0.2, on_unavailable="closed") as c:
            assert await c.ping()
            daemon.pause()
            try:
                t = time.monotonic()
                ds = await asyncio.gather(*(c.check({"user": "gus"}) for _ in range(5)))
                took = time.monotonic() - t
            finally:
                daemon.resume()
            assert all(not d.allowed and d.unreachable for d in ds), ds
            assert sum("no room" in d.cause for d in ds) == 3, [d.cause for d in ds]
            assert 0.19 <= took < 3.0
    run(main())


def test_async_max_conns_cause(make_daemon):
    """A daemon at its --max-conns answers a new connection too_many_connections and
    closes it: the check answers by the policy at once, its cause naming the reason.
    (Against the real daemon the refusal usually arrives before the check is sent; the
    other order is test_async_refusal_after_the_check.)"""
    import socket as socketmod

    d = make_daemon(RULES_AIO_MC, args=["--max-conns", "1"])
    holder = socketmod.socket(socketmod.AF_UNIX)
    holder.connect(d.socket)
    try:
        refused_at_once(d.socket)
    finally:
        holder.close()


def refused_at_once(socket_path):
    """One check through an AsyncClient (timeout 2 s) on a sidecar that refuses the
    connection as too_many_connections: answered by the policy, with that cause, at once
    (not after the timeout)."""
    async def main():
        c = rlsidecar.AsyncClient(socket_path, timeout=2)
        try:
            t0 = time.monotonic()
            dec = await c.check({"user": "ann"})
            return dec, time.monotonic() - t0
        finally:
            await c.close()
    dec, took = asyncio.run(main())
    assert dec.unreachable and "too_many_connections" in (dec.cause or ""), dec.cause
    assert took < 1, "waited %.2f s for a refusal the sidecar sent at once" % took


RULES_AIO_MC = """
rules:
  - name: per-user
    key: user
    limit: { requests: 5, per: 60s }
"""


def test_async_refusal_after_the_check(short_tmp):
    """A sidecar that reads the check, then answers too_many_connections (id 0) and
    closes: the check answers by the policy at once, with that cause. It waited out its
    whole timeout: the answer took it off the pending list, and the connection's failure
    woke only the checks still on it (as in the Node client; found by a client audit)."""
    import socket as socketmod
    import threading

    from rlsidecar import _proto

    path = os.path.join(short_tmp, "mc.sock")
    srv = socketmod.socket(socketmod.AF_UNIX)
    srv.bind(path)
    srv.listen(1)

    def serve():
        c, _ = srv.accept()
        with c:
            head = c.recv(4, socketmod.MSG_WAITALL)
            c.recv(_proto.frame_length(head), socketmod.MSG_WAITALL)  # the check, read whole
            c.sendall(_proto.encode({"id": 0, "error": {"code": "too_many_connections", "message": "full"}}))

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        refused_at_once(path)
    finally:
        srv.close()
        t.join(2)


def test_new_connection_closed_idle_before_the_dial_resumed_is_dialed_again(make_daemon, monkeypatch):
    """Under load the event loop runs late: the daemon's --idle-timeout closes a new
    connection before the dial task that made it resumes (here: the loop is held in
    connection_made until the daemon has closed it). No check was sent on it: the checks
    waiting for the dial go on a new one, and are answered. Before, they answered by the
    policy ("the sidecar closed the connection"), and the next checks backed off."""
    import select

    d = make_daemon(RULES, ["--idle-timeout", "100ms"])
    made = rlsidecar.aio._Protocol.connection_made
    held = []

    def late(self, transport):
        made(self, transport)
        if not held:  # the first connection only
            held.append(True)
            p = select.poll()
            p.register(transport.get_extra_info("socket").fileno(), select.POLLIN)
            assert p.poll(10000), "the daemon did not close the idle connection"

    monkeypatch.setattr(rlsidecar.aio._Protocol, "connection_made", late)

    async def main():
        async with rlsidecar.AsyncClient(d.socket, timeout=30, on_unavailable="closed") as c:
            ds = await asyncio.gather(*[c.check({"user": "u%d" % i}) for i in range(4)])
            return ds, c._failures

    ds, failures = run(main())
    assert held
    assert [(x.unreachable, x.remaining) for x in ds] == [(False, 4)] * 4, [x.cause for x in ds]
    assert failures == 0
