"""Concurrency leases through the blocking client, against the real daemon."""

import os
import threading

import pytest

import rlsidecar
from conftest import wsgi_server

RULES = """
rules:
  - name: exports
    key: user
    concurrency: { max: 2, lease: 30s }
"""


def test_release_in_finally_never_raises_for_an_absent_sidecar(make_daemon):
    """release() is called in a finally: a sidecar stalled, or the client closed, gives
    False (the lease expires, or goes with its connection) rather than an exception that
    would turn a request that succeeded into an error (it raised ConnectionError; found
    by a client audit). Both clients."""
    import asyncio

    d = make_daemon(RULES)
    c = rlsidecar.Client(d.socket, timeout=2)
    ac = rlsidecar.AsyncClient(d.socket, timeout=2)
    loop = asyncio.new_event_loop()
    try:
        a = c.check({"user": "ann"})
        b = loop.run_until_complete(ac.check({"user": "ann"}))
        assert a.lease and b.lease
        c.timeout = ac.timeout = 0.1  # the stall: the releases time out
        d.pause()
        try:
            assert c.release(a.lease) is False
            assert loop.run_until_complete(ac.release(b.lease)) is False
        finally:
            d.resume()
        c.close()
        loop.run_until_complete(ac.close())
        assert c.release(a.lease) is False
        assert loop.run_until_complete(ac.release(b.lease)) is False
    finally:
        c.close()
        loop.close()


def test_lease_release_renew(make_daemon):
    d = make_daemon(RULES)
    with rlsidecar.Client(d.socket, timeout=2) as c:
        a = c.check({"user": "ann"})
        b = c.check({"user": "ann"})
        assert a.allowed and b.allowed and a.lease and b.lease and a.lease != b.lease
        assert (a.rules[0].limit, a.rules[0].window_ms, a.rules[0].remaining) == (2, 30000, 1)
        refused = c.check({"user": "ann"})
        assert not refused.allowed and refused.lease == "" and 0 < refused.retry_after_ms <= 1000
        assert c.renew(b.lease, 60000) == (True, 60000)
        assert c.release(a.lease) is True
        assert c.release(a.lease) is False
        assert c.release("") is False and c.release("nope") is False
        assert c.renew(a.lease) == (False, 0)
        assert c.check({"user": "ann"}).allowed


def test_leases_survive_a_small_pool(make_daemon):
    # pool_size 1, 4 threads: the connections holding leases stay open, so no slot is
    # freed before its release.
    d = make_daemon(RULES.replace("max: 2", "max: 4"))
    with rlsidecar.Client(d.socket, timeout=2, pool_size=1) as c:
        got, barrier = [], threading.Barrier(4)

        def take():
            barrier.wait()
            got.append(c.check({"user": "ann"}))
        ts = [threading.Thread(target=take) for _ in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        assert all(x.allowed and x.lease for x in got)
        assert not c.check({"user": "ann"}).allowed
        for x in got:
            assert c.release(x.lease)
        assert c.check({"user": "ann"}, cost=0).rules[0].remaining == 4


def test_close_frees_leases(make_daemon):
    d = make_daemon(RULES)
    c = rlsidecar.Client(d.socket, timeout=2)
    assert c.check({"user": "ann"}).lease and c.check({"user": "ann"}).lease
    c.close()
    with rlsidecar.Client(d.socket, timeout=2) as c2:
        import time
        for _ in range(200):
            if c2.check({"user": "ann"}, cost=0).rules[0].remaining == 2:
                break
            time.sleep(0.01)
        assert c2.check({"user": "ann"}, cost=0).rules[0].remaining == 2


def test_a_timeout_does_not_free_other_requests_leases(make_daemon):
    # A connection holding a lease is set aside, not used for the next check: that check
    # times out on a stalled daemon and its connection is closed, which must not free
    # the slot of the request still running (before, it went on the same connection).
    import time
    d = make_daemon(RULES.replace("max: 2", "max: 1"))
    with rlsidecar.Client(d.socket, timeout=0.5) as c:
        held = c.check({"user": "ann"})
        assert held.allowed and held.lease
        d.pause()
        try:
            assert c.check({"user": "bob"}).unreachable
        finally:
            d.resume()
        time.sleep(0.1)  # time for the daemon to read the timed-out connection's close
        for _ in range(5):
            assert c.check({"user": "ann"}, cost=0).rules[0].remaining == 0, "the running request's slot was freed"
            time.sleep(0.02)
        assert c.release(held.lease) is True
        assert c.check({"user": "ann"}, cost=0).rules[0].remaining == 1
        assert not c._holding  # released: the connection is back in use


def test_connection_set_aside_returns_when_its_leases_expire(make_daemon):
    # A lease never released (a caller's bug) expires at the daemon; the connection set
    # aside for it is used again after that, not kept open for good.
    import time
    d = make_daemon(RULES.replace("lease: 30s", "lease: 1s"))
    with rlsidecar.Client(d.socket, timeout=2, pool_size=1) as c:
        assert c.check({"user": "ann"}).lease
        assert len(c._holding) == 1
        time.sleep(1.2)
        time.sleep(max(0.0, c._next_unpark - time.monotonic()))
        assert c.check({"user": "bob"}, cost=0).allowed
        assert not c._holding and not c._lease_conn


def test_unanswered_release_closes_the_set_aside_connection(make_daemon):
    """A release the sidecar does not answer (restarting, or stalled past the timeout)
    closes the connection set aside for the lease, once it holds no other: the sidecar
    frees a lease when its connection closes, so closing it is the release. Before, the
    connection was kept open until the lease expired (30 s here, up to an hour): a
    sidecar restarted under load left one descriptor open per request that ended while
    it was away. The slot is free afterwards either way."""
    import time
    d = make_daemon(RULES.replace("max: 2", "max: 1"))
    with rlsidecar.Client(d.socket, timeout=2, pool_size=1) as c:
        held = c.check({"user": "ann"})
        assert held.allowed and held.lease
        (conn,) = c._holding
        d.stop()  # killed: the release finds no sidecar
        c.timeout = 0.1
        assert c.release(held.lease) is False
        assert not c._holding and not c._lease_conn, "the connection set aside is kept for the whole lease"
        assert conn.sock.fileno() == -1, "its descriptor is still open"
        d.start()
        c.timeout = 2
        deadline = time.monotonic() + 5
        while True:  # (the client backs off its dials after the refused one: policy decisions meanwhile)
            peek = c.check({"user": "ann"}, cost=0)
            if not peek.unreachable and peek.rules[0].remaining == 1:
                break
            assert time.monotonic() < deadline, "the ended request's slot still held"
            time.sleep(0.05)


def test_release_refused_too_many_connections_returns_false(make_daemon):
    """A release the daemon answers too_many_connections (it is at --max-conns, the
    connection closed unread) is a sidecar that gives no answer: release() returns False,
    as documented, and renew() and ping() raise OSError. Before, each raised a
    ProtocolError, from a release called in a finally too (a request that succeeded
    turned into an error), and the connection the daemon had closed went back to the
    pool."""
    d = make_daemon(RULES, args=["--max-conns", "1"])
    with rlsidecar.Client(d.socket, timeout=2, pool_size=1) as c:
        held = c.check({"user": "ann"})  # its connection, set aside for the lease, is the one allowed
        assert held.allowed and held.lease
        with pytest.raises(OSError):
            c.renew(held.lease)
        with pytest.raises(OSError):
            c.ping()
        assert not c._idle, "a connection the daemon closed went back to the pool"
        assert c.release(held.lease) is False


RULES_WITH_A_DAY = """
rules:
  - name: exports
    key: user
    concurrency: { max: 2, lease: 1s }
  - name: per-day
    key: user
    limit: { requests: 1000, per: 1d }
"""


def test_connection_set_aside_is_held_for_the_lease_not_a_rate_window(make_daemon):
    """A connection set aside for a lease whose release went unanswered (the daemon
    restarted meanwhile) is used again once the lease has expired: its lease, the
    concurrency rule's window, not the longest window of the answer's rules. Before, a
    check that also matched a rule of 1 per day kept its connection open for a day:
    every restart under load left one descriptor open a day for each request that
    finished during it (40 threads, 3 restarts: 120 of them)."""
    import time
    d = make_daemon(RULES_WITH_A_DAY)
    with rlsidecar.Client(d.socket, timeout=2, pool_size=1) as c:
        held = c.check({"user": "ann"})
        assert held.lease
        assert len(c._holding) == 1
        d.stop()
        c.timeout = 0.1
        assert c.release(held.lease) is False  # the daemon is away: unanswered
        d.start()
        c.timeout = 2
        time.sleep(1.2)  # the lease has expired
        time.sleep(max(0.0, c._next_unpark - time.monotonic()))
        deadline = time.monotonic() + 5
        while c._holding and time.monotonic() < deadline:
            c.check({"user": "bob"}, cost=0)  # a check on a fresh connection (backoff past)
            time.sleep(0.05)
        assert not c._holding and not c._lease_conn, "held past its lease, for the day rule's window"


def test_late_lease_freed_with_its_connection(make_daemon):
    # The blocking client closes a connection whose check timed out (a late answer must
    # not be read as the next one's): the daemon frees the lease the late check took.
    import time
    d = make_daemon(RULES.replace("max: 2", "max: 1"), args=("--admin", "127.0.0.1:0"))
    closed = 'rlsidecar_leases_total{rule="exports",result="closed"}'
    with rlsidecar.Client(d.socket, timeout=2) as c:
        assert not c.check({"user": "bob"}, cost=0).unreachable  # connected
        c.timeout = 0.05  # for the stalled check only: the probes below are awaited 2 s
        d.pause()
        try:
            late = c.check({"user": "ann"})
        finally:
            d.resume()
        c.timeout = 2
        assert late.unreachable and late.lease == ""
        # A probe decided before the late check would see the slot free whether or not
        # the daemon frees it: so wait until the daemon counts the late check's lease
        # freed by its closed connection, and only then see the slot free.
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and d.metric(closed) < 1:
            time.sleep(0.01)
        assert d.metric(closed) == 1, "the late check's lease was not freed with its connection"
        assert c.check({"user": "ann"}, cost=0).rules[0].remaining == 1


def test_async_late_lease_released(make_daemon):
    # A check sent to a stalled daemon times out (the policy decides, without a slot);
    # the daemon then answers it allowed with a lease that nobody holds: the client
    # releases it, so the slot is free again long before the lease's 30 s.
    import asyncio
    import time
    d = make_daemon(RULES.replace("max: 2", "max: 1"))

    async def main():
        async with rlsidecar.AsyncClient(d.socket, timeout=2) as c:
            assert not (await c.check({"user": "bob"}, cost=0)).unreachable  # connected
            c.timeout = 0.05  # for the stalled check only: every answer after it is awaited 2 s
            d.pause()
            try:
                late = await c.check({"user": "ann"})
            finally:
                d.resume()
            c.timeout = 2
            assert late.unreachable and late.lease == ""
            deadline = time.monotonic() + 3
            while time.monotonic() < deadline:
                if (await c.check({"user": "ann"}, cost=0)).rules[0].remaining == 1:
                    break
                await asyncio.sleep(0.01)
            assert (await c.check({"user": "ann"}, cost=0)).rules[0].remaining == 1
            again = await c.check({"user": "ann"})
            assert again.allowed and again.lease
    asyncio.run(main())


def test_async_client_and_middlewares_release(make_daemon):
    import asyncio
    d = make_daemon(RULES.replace("max: 2", "max: 1"))

    async def run():
        async with rlsidecar.AsyncClient(d.socket, timeout=2) as c:
            a = await c.check({"user": "ann"})
            assert a.allowed and a.lease
            assert not (await c.check({"user": "ann"})).allowed
            assert await c.renew(a.lease, 5000) == (True, 5000)
            assert await c.release(a.lease) is True
            assert await c.release(a.lease) is False

            seen = []

            async def app(scope, receive, send):
                seen.append((await c.check({"user": "ann"}, cost=0)).rules[0].remaining)
                await send({"type": "http.response.start", "status": 200, "headers": []})
                await send({"type": "http.response.body", "body": b"ok"})
            mw = rlsidecar.ASGIMiddleware(app, c, attrs=lambda scope: {"user": "ann"})
            sent = []

            async def send(m):
                sent.append(m)
            for _ in range(3):
                await mw({"type": "http", "method": "GET", "path": "/"}, None, send)
            assert seen == [0, 0, 0] and sent[0]["status"] == 200
            assert (await c.check({"user": "ann"}, cost=0)).rules[0].remaining == 1
    asyncio.run(run())

    with rlsidecar.Client(d.socket, timeout=2) as c:
        during = []

        def app(environ, start_response):
            during.append(c.check({"user": "ann"}, cost=0).rules[0].remaining)
            start_response("200 OK", [])
            return [b"ok"]
        mw = rlsidecar.WSGIMiddleware(app, c, attrs=lambda environ: {"user": "ann"})
        for _ in range(3):
            body = mw({}, lambda status, headers, exc_info=None: None)
            assert list(body) == [b"ok"]
            body.close()
        assert during == [0, 0, 0]
        assert c.check({"user": "ann"}, cost=0).rules[0].remaining == 1


def test_lease_and_delay_together(make_daemon):
    """One answer carries a concurrency lease and a rule's delay; an ASGI request cancelled
    while held frees its slot."""
    import asyncio
    d = make_daemon(RULES.replace("max: 2", "max: 1") + """
  - name: queue
    key: user
    limit: { requests: 1, per: 10s }
    delay: 30s
""")

    async def run():
        async with rlsidecar.AsyncClient(d.socket, timeout=2) as c:
            first = await c.check({"user": "ann"})
            assert first.allowed and first.lease and first.delay_ms == 0
            assert await c.release(first.lease) is True
            second = await c.check({"user": "ann"})
            assert second.allowed and second.lease and 9_000 <= second.delay_ms <= 10_000
            assert await c.release(second.lease) is True

            async def app(scope, receive, send):
                raise AssertionError("reached the app while held")
            mw = rlsidecar.ASGIMiddleware(app, c, attrs=lambda scope: {"user": "ann"})

            async def send(m):
                pass

            async def receive():  # the server's: the client neither sends nor leaves
                await asyncio.Event().wait()
            try:
                await asyncio.wait_for(mw({"type": "http", "method": "GET", "path": "/"}, receive, send), 0.2)
            except asyncio.TimeoutError:
                pass
            else:
                raise AssertionError("the delayed request was not held")
            for _ in range(200):  # the release runs as the cancelled task unwinds
                if (await c.check({"user": "ann"}, cost=0)).rules[0].remaining == 1:
                    break
                await asyncio.sleep(0.01)
            assert (await c.check({"user": "ann"}, cost=0)).rules[0].remaining == 1
    asyncio.run(run())


def test_asgi_client_gone_while_held(make_daemon):
    """A request held for a rule's delay whose client disconnects (receive() gives
    http.disconnect, as an ASGI server does): the wait ends at once, the app is not
    called, nothing is sent, and its slot is freed — not 10 s later. A request whose body
    arrives during the wait gets it whole in the app, in order."""
    import asyncio
    d = make_daemon(RULES.replace("max: 2", "max: 1") + """
  - name: queue
    key: user
    limit: { requests: 1, per: 10s }
    delay: 30s
  - name: short-queue
    key: who
    limit: { requests: 1, per: 300ms }
    delay: 5s
""")

    async def run():
        async with rlsidecar.AsyncClient(d.socket, timeout=2) as c:
            first = await c.check({"user": "ann"})
            assert await c.release(first.lease) is True

            async def app(scope, receive, send):
                raise AssertionError("reached the app")
            mw = rlsidecar.ASGIMiddleware(app, c, attrs=lambda scope: {"user": "ann"})
            sent = []

            async def send(m):
                sent.append(m)
            gone = asyncio.Event()
            body = [{"type": "http.request", "body": b"abc", "more_body": False}]

            async def receive():  # the body, then the disconnect once the client leaves
                if body:
                    return body.pop(0)
                await gone.wait()
                return {"type": "http.disconnect"}
            loop = asyncio.get_running_loop()
            loop.call_later(0.2, gone.set)
            start = loop.time()
            await asyncio.wait_for(mw({"type": "http", "method": "POST", "path": "/"}, receive, send), 5)
            assert loop.time() - start < 5 and sent == []
            # The slot is free (released before the middleware returned).
            assert (await c.check({"user": "ann"}, cost=0)).rules[0].remaining == 1

            # Held about 300 ms with its body arriving meanwhile, in two parts: the app
            # reads both, then the disconnect as any receive() after the response.
            got = []

            async def reader(scope, receive, send):
                while True:
                    m = await receive()
                    got.append(m)
                    if not m.get("more_body", False):
                        break
                await send({"type": "http.response.start", "status": 200, "headers": []})
                await send({"type": "http.response.body", "body": b"ok"})
            mw = rlsidecar.ASGIMiddleware(reader, c, attrs=lambda scope: {"who": "bo"})
            assert (await c.check({"who": "bo"})).allowed
            parts = [{"type": "http.request", "body": b"pa", "more_body": True},
                     {"type": "http.request", "body": b"rt", "more_body": False}]
            done = asyncio.Event()

            async def receive2():
                if parts:
                    await asyncio.sleep(0.05)
                    return parts.pop(0)
                await done.wait()
                return {"type": "http.disconnect"}
            sent.clear()
            await asyncio.wait_for(mw({"type": "http", "method": "POST", "path": "/"}, receive2, send), 5)
            done.set()
            assert [m["body"] for m in got] == [b"pa", b"rt"]
            assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
    asyncio.run(run())


def test_asgi_frees_the_slot_before_the_response_ends(make_daemon):
    """The last body message reaches the server only once the lease is released: a
    client that has the whole response and asks again at once finds the slot free. A
    streamed body holds the slot until its last part."""
    import asyncio
    d = make_daemon(RULES.replace("max: 2", "max: 1"))

    async def run():
        async with rlsidecar.AsyncClient(d.socket, timeout=2) as c:
            async def app(scope, receive, send):
                await send({"type": "http.response.start", "status": 200, "headers": []})
                await send({"type": "http.response.body", "body": b"part", "more_body": True})
                await send({"type": "http.response.body", "body": b"end"})
            mw = rlsidecar.ASGIMiddleware(app, c, attrs=lambda scope: {"user": "ann"})
            free_when_sent = []

            async def send(m):
                if m["type"] == "http.response.body":
                    free_when_sent.append((await c.check({"user": "ann"}, cost=0)).rules[0].remaining)
            for _ in range(3):
                await mw({"type": "http", "method": "GET", "path": "/"}, None, send)
            assert free_when_sent == [0, 1] * 3  # held while streaming, free before the end
    asyncio.run(run())


def test_wsgi_frees_the_slot_before_the_last_part(make_daemon):
    """The server gets the body's last part only once the lease is released, when the
    last part is known (a list body, or the Content-Length reached); a streamed body of
    unknown length holds the slot until the server closes it."""
    d = make_daemon(RULES.replace("max: 2", "max: 1"))
    with rlsidecar.Client(d.socket, timeout=2) as c:
        def remaining():
            return c.check({"user": "ann"}, cost=0).rules[0].remaining

        def stream(length):
            def app(environ, start_response):
                start_response("200 OK", [("Content-Length", str(length))] if length is not None else [])
                yield b"ab"
                yield b"cd"
            return app

        def listed(environ, start_response):
            start_response("200 OK", [])
            return [b"ab", b"cd"]
        for app, want in ((listed, [0, 1]), (stream(4), [0, 1]), (stream(None), [0, 0])):
            mw = rlsidecar.WSGIMiddleware(app, c, attrs=lambda environ: {"user": "ann"})
            body = mw({}, lambda status, headers, exc_info=None: None)
            free_when_handed = [remaining() for _ in body]
            body.close()
            assert free_when_handed == want, app
            assert remaining() == 1


def test_wsgi_threaded_server_requests_in_a_row(make_daemon):
    """A threaded WSGI server, max 1 in flight, 200 requests one after the other (a new
    connection each): each finds the slot the previous one freed, though the server reads
    the next request before it closes the previous response."""
    import urllib.request

    d = make_daemon(RULES.replace("max: 2", "max: 1"))
    with rlsidecar.Client(d.socket, timeout=2) as c:
        def app(environ, start_response):
            start_response("200 OK", [("Content-Length", "2")])
            return [b"ok"]
        with wsgi_server(rlsidecar.WSGIMiddleware(app, c, attrs=lambda environ: {"user": "ann"}), threaded=True) as port:
            codes = []
            for _ in range(200):
                try:
                    with urllib.request.urlopen("http://127.0.0.1:%d/" % port, timeout=10) as r:
                        codes.append(r.status)
                except urllib.error.HTTPError as e:
                    codes.append(e.code)
            assert codes == [200] * 200


def test_wsgi_leased_one_part_body_gets_its_content_length(make_daemon):
    """A leased response whose body is a list of one part, without a Content-Length from
    the app: a real WSGI server (wsgiref, which takes len() of the body as PEP 3333 lets
    it) sends its Content-Length, as it does for the same response without a lease (the
    body the middleware returned had no len(), so the leased one went without). The
    slot is freed all the same; a generator body is not given a len()."""
    import http.client

    d = make_daemon(RULES.replace("max: 2", "max: 1"))
    with rlsidecar.Client(d.socket, timeout=2) as c:
        def app(environ, start_response):
            start_response("200 OK", [("Content-Type", "text/plain")])
            return [b"hello"]

        def user(environ):
            return {"user": environ.get("HTTP_X_USER", "")} if environ.get("HTTP_X_USER") else {}
        with wsgi_server(rlsidecar.WSGIMiddleware(app, c, attrs=user)) as port:
            for who in ("", "ann", "ann"):  # no rule (no lease), then leased twice
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
                conn.request("GET", "/", headers={"X-User": who} if who else {})
                r = conn.getresponse()
                assert (r.status, r.read(), r.getheader("Content-Length")) == (200, b"hello", "5"), who
                conn.close()
                if who:
                    assert r.getheader("RateLimit") is not None  # the check took a lease
        assert c.check({"user": "ann"}, cost=0).rules[0].remaining == 1

        def streamed(environ, start_response):
            start_response("200 OK", [])
            yield b"hello"
        body = rlsidecar.WSGIMiddleware(streamed, c, attrs=lambda environ: {"user": "ann"})({}, lambda *a: None)
        assert not hasattr(body, "__len__")
        assert c.check({"user": "ann"}, cost=0).rules[0].remaining == 0
        body.close()
        assert c.check({"user": "ann"}, cost=0).rules[0].remaining == 1


def test_asgi_renews_a_long_request_lease(make_daemon):
    """ASGIMiddleware renews a request's lease while the app runs: a request longer than
    its rule's lease (2 s here) keeps its slot, and frees it when it ends; with
    renew_leases=False the slot is lost once the lease expires. Both at once."""
    import asyncio
    d = make_daemon(RULES.replace("max: 2, lease: 30s", "max: 1, lease: 2s"))

    async def run():
        async with rlsidecar.AsyncClient(d.socket, timeout=2) as c:
            finish = asyncio.Event()

            async def app(scope, receive, send):
                await finish.wait()
                await send({"type": "http.response.start", "status": 200, "headers": []})
                await send({"type": "http.response.body", "body": b"ok"})

            async def send(m):
                pass

            async def receive():
                return {"type": "http.request", "body": b"", "more_body": False}

            async def free(user):
                return (await c.check({"user": user}, cost=0)).rules[0].remaining
            runs = [asyncio.ensure_future(rlsidecar.ASGIMiddleware(app, c, attrs=lambda scope, u=u: {"user": u},
                                                                   renew_leases=renew)(
                {"type": "http", "method": "PUT", "path": "/upload"}, receive, send))
                for u, renew in (("ren", True), ("lou", False))]
            for _ in range(500):
                if await free("ren") == 0 and await free("lou") == 0:
                    break
                await asyncio.sleep(0.01)
            assert (await free("ren"), await free("lou")) == (0, 0)
            await asyncio.sleep(4.5)  # more than twice the lease
            assert await free("ren") == 0, "renewed: still held after 4.5 s of a 2 s lease"
            assert await free("lou") == 1, "not renewed: expired"
            finish.set()
            await asyncio.wait_for(asyncio.gather(*runs), 5)
            assert await free("ren") == 1
    asyncio.run(run())


def test_wsgi_renews_a_long_request_lease(make_daemon):
    """As test_asgi_renews_a_long_request_lease, for WSGIMiddleware (a thread renews)."""
    import threading
    import time
    d = make_daemon(RULES.replace("max: 2, lease: 30s", "max: 1, lease: 2s"))
    with rlsidecar.Client(d.socket, timeout=2) as c:
        finish = threading.Event()
        started = threading.Semaphore(0)

        def app(environ, start_response):
            started.release()
            finish.wait(30)
            start_response("200 OK", [])
            return [b"ok"]

        def free(user):
            return c.check({"user": user}, cost=0).rules[0].remaining
        results = {}

        def serve(user, renew):
            mw = rlsidecar.WSGIMiddleware(app, c, attrs=lambda environ: {"user": user}, renew_leases=renew)
            body = mw({}, lambda status, headers, exc_info=None: None)
            results[user] = list(body)
            body.close()
        threads = [threading.Thread(target=serve, args=a) for a in (("ren", True), ("lou", False))]
        for t in threads:
            t.start()
        try:
            assert started.acquire(timeout=10) and started.acquire(timeout=10)
            assert (free("ren"), free("lou")) == (0, 0)
            time.sleep(4.5)  # more than twice the lease
            assert free("ren") == 0, "renewed: still held after 4.5 s of a 2 s lease"
            assert free("lou") == 1, "not renewed: expired"
        finally:
            finish.set()
            for t in threads:
                t.join(10)
        assert results == {"ren": [b"ok"], "lou": [b"ok"]}
        assert free("ren") == 1
        assert not [t for t in threading.enumerate() if t.name == "rlsidecar-renew"]


def _renew_stand_in(path, state):
    """A stand-in sidecar: every check allowed with a lease of 3 s beside a rate rule of
    1 s; renewals unanswered until state["answering"], then renewed (counted in
    state["renewed"]); releases answered."""
    import socket
    import struct

    import msgpack

    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(16)
    rules = [{"name": "exports", "limit": 1, "window_ms": 3000, "remaining": 0, "reset_ms": 0,
              "retry_after_ms": 0, "allowed": True, "shadow": False, "concurrency": True},
             {"name": "per-second", "limit": 100, "window_ms": 1000, "remaining": 99, "reset_ms": 10,
              "retry_after_ms": 0, "allowed": True, "shadow": False}]

    def serve(c):
        with c:
            try:
                while True:
                    head = c.recv(4, socket.MSG_WAITALL)
                    if len(head) < 4:
                        return
                    req = msgpack.unpackb(c.recv(struct.unpack(">I", head)[0], socket.MSG_WAITALL), raw=False)
                    if req["op"] == "renew":
                        if not state["answering"]:
                            continue  # no answer: the renewal times out
                        state["renewed"] += 1
                        m = {"id": req["id"], "renewed": True, "expires_ms": 3000}
                    elif req["op"] == "release":
                        m = {"id": req["id"], "released": True}
                    else:
                        m = {"id": req["id"], "allowed": True, "rule": "exports", "limit": 1, "remaining": 0,
                             "reset_ms": 0, "retry_after_ms": 0, "degraded": False, "rules": rules, "lease": "L1"}
                    body = msgpack.packb(m)
                    c.sendall(struct.pack(">I", len(body)) + body)
            except OSError:
                pass

    def accept():
        while True:
            try:
                c, _ = srv.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(c,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    return srv


def test_wsgi_renews_through_an_outage_shorter_than_the_lease(short_tmp):
    """WSGIMiddleware keeps renewing through a sidecar that does not answer for longer
    than the shortest rate window, as long as the lease itself lasts: its expiry is the
    concurrency rule's window (3 s), not twice the first renewal's wait (half the rate
    rule's 1 s). Before, renewals that got no answer for a second (a sidecar stalled or
    restarting) stopped for good, and the lease expired under the running request."""
    import os
    import time
    state = {"answering": False, "renewed": 0}
    srv = _renew_stand_in(os.path.join(short_tmp, "r.sock"), state)
    try:
        with rlsidecar.Client(os.path.join(short_tmp, "r.sock"), timeout=0.1) as c:
            threading.Timer(1.5, lambda: state.update(answering=True)).start()

            def app(environ, start_response):
                deadline = time.monotonic() + 5
                while not state["renewed"] and time.monotonic() < deadline:
                    time.sleep(0.01)
                start_response("200 OK", [])
                return [b"ok"]
            body = rlsidecar.WSGIMiddleware(app, c, attrs=lambda environ: {"user": "ann"})(
                {}, lambda status, headers, exc_info=None: None)
            assert list(body) == [b"ok"]
            body.close()
            assert state["renewed"], "no renewal after the sidecar answered again 1.5 s in"
    finally:
        srv.close()


def test_asgi_renews_through_an_outage_shorter_than_the_lease(short_tmp):
    """As test_wsgi_renews_through_an_outage_shorter_than_the_lease, for ASGIMiddleware."""
    import asyncio
    import os
    state = {"answering": False, "renewed": 0}
    srv = _renew_stand_in(os.path.join(short_tmp, "r.sock"), state)

    async def run():
        async with rlsidecar.AsyncClient(os.path.join(short_tmp, "r.sock"), timeout=0.1) as c:
            asyncio.get_running_loop().call_later(1.5, lambda: state.update(answering=True))

            async def app(scope, receive, send):
                for _ in range(500):
                    if state["renewed"]:
                        break
                    await asyncio.sleep(0.01)
                await send({"type": "http.response.start", "status": 200, "headers": []})
                await send({"type": "http.response.body", "body": b"ok"})

            async def send(m):
                pass

            async def receive():
                return {"type": "http.request", "body": b"", "more_body": False}
            await rlsidecar.ASGIMiddleware(app, c, attrs=lambda scope: {"user": "ann"})(
                {"type": "http", "method": "PUT", "path": "/upload"}, receive, send)
    try:
        asyncio.run(run())
        assert state["renewed"], "no renewal after the sidecar answered again 1.5 s in"
    finally:
        srv.close()


def test_asgi_request_cancelled_while_releasing_frees_its_slot(make_daemon):
    """An ASGI request task cancelled while the middleware releases its lease still frees
    the slot: cancelled as its last body message goes out (a server cancelling the
    request as its client goes), and cancelled in the app and again in the release
    (an anyio cancel scope, as Starlette's and FastAPI's task groups use, cancels at
    every await until the scope is left). Before, the release first awaited the end of
    the lease's renewal task, the cancellation came there, and the release was never
    sent: the slot stayed held for the whole lease (30 s)."""
    import asyncio
    import time
    d = make_daemon(RULES.replace("max: 2", "max: 1"))

    async def run():
        async with rlsidecar.AsyncClient(d.socket, timeout=2) as c:
            loop = asyncio.get_running_loop()

            async def free():
                deadline = time.monotonic() + 5
                while time.monotonic() < deadline:
                    n = (await c.check({"user": "ann"}, cost=0)).rules[0].remaining
                    if n == 1:
                        break
                    await asyncio.sleep(0.01)
                return n

            async def send(m):
                pass

            async def cancelled_at_the_end(scope, receive, send):
                await send({"type": "http.response.start", "status": 200, "headers": []})
                loop.call_soon(asyncio.current_task().cancel)  # runs once the next send awaits
                await send({"type": "http.response.body", "body": b"ok"})

            in_app = asyncio.Event()

            async def cancelled_in_the_app(scope, receive, send):
                in_app.set()
                await asyncio.Event().wait()

            scope = {"type": "http", "method": "GET", "path": "/"}
            mw = rlsidecar.ASGIMiddleware(cancelled_at_the_end, c, attrs=lambda scope: {"user": "ann"})
            task = asyncio.ensure_future(mw(scope, None, send))
            with pytest.raises(asyncio.CancelledError):
                await task
            assert await free() == 1, "cancelled as the response ended: the slot is still held"

            mw = rlsidecar.ASGIMiddleware(cancelled_in_the_app, c, attrs=lambda scope: {"user": "ann"})
            task = asyncio.ensure_future(mw(scope, None, send))
            await asyncio.wait_for(in_app.wait(), 5)
            task.cancel()
            loop.call_soon(task.cancel)  # again, once the release awaits
            with pytest.raises(asyncio.CancelledError):
                await task
            assert await free() == 1, "cancelled twice: the slot is still held"
    asyncio.run(run())


def test_asgi_frees_the_slot_before_a_file_is_sent(make_daemon):
    """A response whose last message is a file sent through an extension (Starlette's
    FileResponse sends http.response.pathsend where the server offers it; a last
    http.response.zerocopysend likewise) goes out only once the slot is free, as a last
    body message does. Before, only http.response.body counted as the last message: the
    slot was freed after the server had the whole file, and a client asking again at once
    was refused (max 1)."""
    import asyncio
    d = make_daemon(RULES.replace("max: 2", "max: 1"))

    async def run():
        async with rlsidecar.AsyncClient(d.socket, timeout=2) as c:
            free_when_sent = []

            async def send(m):
                if m["type"] != "http.response.start":
                    free_when_sent.append((m["type"], (await c.check({"user": "ann"}, cost=0)).rules[0].remaining))
            ends = ({"type": "http.response.pathsend", "path": "/srv/report.pdf"},
                    {"type": "http.response.zerocopysend", "file": 0, "more_body": True},
                    {"type": "http.response.zerocopysend", "file": 0})
            for last in ends:
                async def app(scope, receive, send):
                    await send({"type": "http.response.start", "status": 200, "headers": []})
                    await send(last)
                mw = rlsidecar.ASGIMiddleware(app, c, attrs=lambda scope: {"user": "ann"})
                await mw({"type": "http", "method": "GET", "path": "/report",
                          "extensions": {"http.response.pathsend": {}, "http.response.zerocopysend": {}}}, None, send)
            assert free_when_sent == [("http.response.pathsend", 1), ("http.response.zerocopysend", 0),
                                      ("http.response.zerocopysend", 1)]
    asyncio.run(run())


def test_renewals_stop_once_the_client_is_closed(make_daemon):
    """A request's lease is not renewed again and again once its client is closed: every
    renewal of a closed client fails at once, and was retried at half of what was left of
    the lease, down to every 10 ms, until its expiry (8 renewals over a 2 s lease). Now
    the first that finds the client closed is the last. Both middlewares."""
    import asyncio
    import threading
    import time
    d = make_daemon(RULES.replace("max: 2, lease: 30s", "max: 1, lease: 2s"))

    def counting(client):
        calls = []
        renew = client.renew

        def count(*args):
            calls.append(time.monotonic())
            return renew(*args)
        client.renew = count
        return calls

    def wait_past(calls):
        """Until a renewal was tried, then past the lease's expiry, when the old middleware
        had stopped retrying too."""
        deadline = time.monotonic() + 10
        while not calls and time.monotonic() < deadline:
            time.sleep(0.01)
        assert calls, "no renewal tried"
        time.sleep(max(0.0, calls[0] + 1.5 - time.monotonic()))

    c = rlsidecar.Client(d.socket, timeout=2)
    calls = counting(c)
    finish, started = threading.Event(), threading.Event()

    def app(environ, start_response):
        started.set()
        finish.wait(30)
        start_response("200 OK", [])
        return [b"ok"]

    def serve():
        body = rlsidecar.WSGIMiddleware(app, c, attrs=lambda environ: {"user": "wes"})({}, lambda *a: None)
        list(body)
        body.close()
    t = threading.Thread(target=serve)
    t.start()
    try:
        assert started.wait(10)
        c.close()
        wait_past(calls)
        assert len(calls) == 1, "WSGI: %d renewals of a closed client" % len(calls)
    finally:
        finish.set()
        t.join(10)

    async def run():
        ac = rlsidecar.AsyncClient(d.socket, timeout=2)
        calls = counting(ac)
        finish, started = asyncio.Event(), asyncio.Event()

        async def app(scope, receive, send):
            started.set()
            await finish.wait()
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})

        async def send(m):
            pass
        mw = rlsidecar.ASGIMiddleware(app, ac, attrs=lambda scope: {"user": "ada"})
        task = asyncio.ensure_future(mw({"type": "http", "method": "GET", "path": "/"}, None, send))
        await asyncio.wait_for(started.wait(), 10)
        await ac.close()
        await asyncio.get_running_loop().run_in_executor(None, wait_past, calls)
        finish.set()
        await asyncio.wait_for(task, 10)
        assert len(calls) == 1, "ASGI: %d renewals of a closed client" % len(calls)
    asyncio.run(run())


def test_check_many_refused_releases_the_batch_leases(make_daemon):
    """A batch one of whose checks the sidecar refuses (invalid_limit) raises
    ProtocolError, and its caller never sees the other checks' decisions: the leases they
    took are released before it raises. Before, each held its slot (and its connection,
    set aside) for the whole lease: with max 1, the user's next request was refused for
    30 s."""
    d = make_daemon(RULES.replace("max: 2", "max: 1"))
    with rlsidecar.Client(d.socket, timeout=2) as c:
        with pytest.raises(rlsidecar.ProtocolError) as e:
            c.check_many([({"user": "ann"}, 1, None), ({}, 1, [{"key": "k", "limit": 0, "window_ms": 1}])])
        assert e.value.code == "invalid_limit"
        assert c.check({"user": "ann"}, cost=0).rules[0].remaining == 1, "the batch's lease still holds the slot"
        assert not c._holding and not c._lease_conn


def test_wsgi_renewal_thread_that_cannot_start_frees_the_slot(make_daemon, monkeypatch):
    """A process at its thread limit (ulimit -u, a container's pids limit) cannot start a
    leased request's renewal thread: Thread.start raises RuntimeError, the request fails,
    and its lease is released. Before, the thread was started before the part that
    releases on an error: each such request left its slot held for the whole lease (30 s),
    so under that load a concurrency rule soon refused everyone."""
    import threading
    d = make_daemon(RULES.replace("max: 2", "max: 1"))
    with rlsidecar.Client(d.socket, timeout=2) as c:
        def app(environ, start_response):
            raise AssertionError("reached the app")
        mw = rlsidecar.WSGIMiddleware(app, c, attrs=lambda environ: {"user": "ann"})

        def cannot_start(self):
            raise RuntimeError("can't start new thread")
        with monkeypatch.context() as m:
            m.setattr(threading.Thread, "start", cannot_start)
            with pytest.raises(RuntimeError, match="can't start new thread"):
                mw({}, lambda status, headers, exc_info=None: None)
        assert c.check({"user": "ann"}, cost=0).rules[0].remaining == 1, "the failed request's lease holds the slot"


def test_release_answered_false_closes_the_set_aside_connection(make_daemon):
    """A release answered ``released: false`` came from a sidecar that does not hold the
    lease; the one the connection set aside for it goes to may. In a blue/green switch
    the successor takes the socket's path, the release goes to it (unknown there: false),
    and the old sidecar holds the lease on that connection: it is closed, as for a release
    unanswered, which frees the lease there. Before, it was pooled again: the slot stayed
    held on the old sidecar, and the next check went on that connection to it and was
    refused by the slot of the request that had ended."""
    rules = RULES.replace("max: 2", "max: 1")
    old, new = make_daemon(rules), make_daemon(rules)
    with rlsidecar.Client(old.socket, timeout=2) as c, rlsidecar.Client(old.socket, timeout=2) as watch:
        watch.ping()  # its pooled connection stays on the old sidecar: it sees that one's slot
        held = c.check({"user": "ann"})
        assert held.allowed and held.lease
        (conn,) = c._holding
        os.rename(new.socket, old.socket)  # the successor takes the path
        assert c.release(held.lease) is False  # the successor does not know it
        # The old sidecar freed the slot when the connection closed (a check that finds
        # it full first frees the leases of connections their clients have closed).
        assert watch.check({"user": "ann"}, cost=0).rules[0].remaining == 1, "the old sidecar still holds the lease"
        d = c.check({"user": "ann"})
        assert d.allowed and d.lease, "refused: the check went to the old sidecar, on the connection set aside"
        assert c.release(d.lease) is True  # the successor's own lease
        assert not c._holding and not c._lease_conn
        assert conn.sock.fileno() == -1 and conn not in c._idle, "the connection set aside is used again"
