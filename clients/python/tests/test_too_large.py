"""Requests too large for the daemon (their frame over max_frame, 65,536 bytes by default):
not sent, refused with RequestTooLargeError, whose decision is a 431 (Request Header
Fields Too Large), never the failure policy (under "open" that let any request through
with a huge header). The same when the daemon refuses one (frame_too_large): a daemon
started with a smaller --max-frame than the client's max_frame."""

import asyncio
import json

import pytest

import rlsidecar
from rlsidecar import _proto

from test_middleware import asgi_get, hello_app, hello_asgi, wsgi_get

BIG = "x" * 70000
BODY_431 = (b'{"type":"about:blank","title":"Request Header Fields Too Large","status":431,'
            b'"detail":"This request\'s attributes (its path or header fields) are too large for the rate limiter to check."}')


def check_431(d):
    assert not d.allowed and not d.unreachable and not d.degraded and d.reason == "request_too_large"
    status, headers, body = d.rejection()
    assert (status, d.status, body) == (431, 431, BODY_431)
    assert headers == {"Content-Type": "application/problem+json", "Content-Length": str(len(BODY_431))}


def test_not_sent(daemon):
    with rlsidecar.Client(daemon.socket, timeout=2, pool_size=1, on_unavailable="open") as c:
        assert c.check({"user": "kim"}).remaining == 4
        conn = c._idle[0]
        with pytest.raises(rlsidecar.RequestTooLargeError) as e:
            c.check({"user": "kim", "ua": BIG})
        assert isinstance(e.value, rlsidecar.ProtocolError) and e.value.code == "frame_too_large"
        assert "65536" in e.value.message
        check_431(e.value.decision)
        # Nothing was sent: the daemon did not close the connection, nothing was consumed.
        assert c.check({"user": "kim"}).remaining == 3 and c._idle == [conn]
        # In a batch: refused before any of it is sent.
        with pytest.raises(rlsidecar.RequestTooLargeError):
            c.check_many([({"user": "kim"}, 1, None), ({"user": "kim", "ua": BIG}, 1, None)])
        assert c.check({"user": "kim"}).remaining == 2


def test_refused_even_when_the_daemon_is_away(short_tmp):
    """It does not depend on the daemon: 431, not the policy's 200 or 503."""
    import os

    with rlsidecar.Client(os.path.join(short_tmp, "none.sock"), on_unavailable="open") as c:
        with pytest.raises(rlsidecar.RequestTooLargeError) as e:
            c.check({"ua": BIG})
        check_431(e.value.decision)


def test_max_frame_is_exact(daemon):
    """A frame whose body is max_frame bytes is sent; one byte more is not."""
    with rlsidecar.Client(daemon.socket, timeout=2, max_frame=200) as c:
        base = len(_proto.encode(_proto.check_message(1, {"user": "lee", "pad": ""}, 1, None))) - 4
        pad = "p" * (200 - base - 1)  # a str8: one byte of length beyond 31 bytes; the ids stay below 128
        assert len(_proto.encode(_proto.check_message(1, {"user": "lee", "pad": pad}, 1, None))) - 4 == 200
        assert c.check({"user": "lee", "pad": pad}).allowed
        with pytest.raises(rlsidecar.RequestTooLargeError):
            c.check({"user": "lee", "pad": pad + "p"})
    for bad in (0, -1, 1.5, "64k"):
        with pytest.raises(ValueError):
            rlsidecar.Client("/x.sock", max_frame=bad)
        with pytest.raises(ValueError):
            rlsidecar.AsyncClient("/x.sock", max_frame=bad)


def test_refused_by_the_daemon(daemon):
    """A client allowing larger frames than the daemon: the daemon's frame_too_large is the
    same 431, and the connection it closed is not pooled."""
    with rlsidecar.Client(daemon.socket, timeout=2, max_frame=1 << 20, on_unavailable="open") as c:
        with pytest.raises(rlsidecar.RequestTooLargeError) as e:
            c.check({"user": "may", "ua": BIG})
        check_431(e.value.decision)
        assert "65536" in e.value.message  # the daemon's message
        assert c.check({"user": "may"}).remaining == 4


def test_refused_while_still_writing(short_tmp):
    """The daemon answers frame_too_large from the header and closes while the client is
    still writing the body: the write fails (EPIPE), and the answer, already in the
    client's receive queue, is still the 431, not the failure policy. Here a server that
    does just that, so that the write always fails (against the daemon it is a race the
    client sometimes won: test_refused_by_the_daemon)."""
    import os
    import socket
    import struct
    import threading

    import msgpack

    path = os.path.join(short_tmp, "refuse.sock")
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(path)
    srv.listen(1)

    def refuse():
        c, _ = srv.accept()
        c.recv(4)  # the header only
        body = msgpack.packb({"id": 0, "error": {"code": "frame_too_large",
                                                 "message": "a frame of 4000000 bytes is over this daemon's 65536"}})
        c.sendall(struct.pack(">I", len(body)) + body)
        c.close()

    t = threading.Thread(target=refuse)
    t.start()
    try:
        with rlsidecar.Client(path, timeout=5, max_frame=1 << 22, on_unavailable="open") as c:
            with pytest.raises(rlsidecar.RequestTooLargeError) as e:
                c.check({"user": "may", "ua": "x" * 4_000_000})
            check_431(e.value.decision)
            assert "65536" in e.value.message
    finally:
        t.join(5)
        srv.close()


def test_async_refused_while_still_writing(short_tmp):
    """As test_refused_while_still_writing, for AsyncClient: the transport's write of the
    rest fails once the server closed, and the answer read before it is still the 431."""
    import os
    import socket
    import struct
    import threading

    import msgpack

    path = os.path.join(short_tmp, "refuse.sock")
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(path)
    srv.listen(4)

    def refuse():
        for _ in range(3):
            c, _ = srv.accept()
            c.recv(4)  # the header only
            body = msgpack.packb({"id": 0, "error": {"code": "frame_too_large",
                                                     "message": "a frame of 4000000 bytes is over this daemon's 65536"}})
            c.sendall(struct.pack(">I", len(body)) + body)
            c.close()

    t = threading.Thread(target=refuse)
    t.start()

    async def main():
        for _ in range(3):
            async with rlsidecar.AsyncClient(path, timeout=5, max_frame=1 << 22, on_unavailable="open") as c:
                with pytest.raises(rlsidecar.RequestTooLargeError) as e:
                    await c.check({"user": "may", "ua": "x" * 4_000_000})
                check_431(e.value.decision)
    try:
        asyncio.run(main())
    finally:
        t.join(5)
        srv.close()


def test_async_write_failed_before_the_answer_was_read():
    """The loop may run a failed write (EPIPE: the sidecar answered frame_too_large from
    the header and closed) before it reads that answer; the transport then stops reading
    and calls connection_lost with the socket still open. The answer is read there: the
    check gets the 431. Here that order, forced: a socketpair whose other end wrote the
    answer and closed, and connection_lost called as the transport does."""
    import socket
    import struct

    import msgpack

    from rlsidecar.aio import _Protocol

    async def main():
        ours, theirs = socket.socketpair()
        ours.setblocking(False)
        body = msgpack.packb({"id": 0, "error": {"code": "frame_too_large", "message": "over 65536"}})
        theirs.sendall(struct.pack(">I", len(body)) + body)
        theirs.close()

        class Transport:
            def get_extra_info(self, name):
                return ours if name == "socket" else None

            def close(self):
                pass

            def set_write_buffer_limits(self, high=None, low=None):
                pass

        class Client:
            def _detach(self, conn):
                pass

        p = _Protocol(Client())
        p.connection_made(Transport())
        fut = asyncio.get_running_loop().create_future()
        p.pending.append((1, fut))
        p.connection_lost(BrokenPipeError(32, "Broken pipe"))
        assert fut.done() and not fut.exception(), fut
        assert _proto.error_of(fut.result())[0] == "frame_too_large"
        ours.close()
    asyncio.run(main())


def test_async(daemon):
    async def main():
        async with rlsidecar.AsyncClient(daemon.socket, timeout=2) as c:
            assert (await c.check({"user": "ned"})).remaining == 4
            conn = c._conn
            with pytest.raises(rlsidecar.RequestTooLargeError) as e:
                await c.check({"user": "ned", "ua": BIG})
            check_431(e.value.decision)
            assert (await c.check({"user": "ned"})).remaining == 3 and c._conn is conn  # not sent
        async with rlsidecar.AsyncClient(daemon.socket, timeout=2, max_frame=1 << 20) as c:
            with pytest.raises(rlsidecar.RequestTooLargeError) as e:
                await c.check({"user": "ned", "ua": BIG})
            check_431(e.value.decision)
            assert (await c.check({"user": "ned"})).remaining == 2
    asyncio.run(main())


def ua_attrs_wsgi(environ):
    return dict(rlsidecar.wsgi_attrs(environ), ua=environ.get("HTTP_USER_AGENT", ""))


def ua_attrs_asgi(scope):
    return dict(rlsidecar.asgi_attrs(scope), ua=dict(scope["headers"]).get(b"user-agent", b"").decode("latin-1"))


@pytest.mark.parametrize("policy", ["open", "closed"])
def test_middleware_answers_431(daemon, policy):
    """A huge header that the attrs function sends: 431 and the app is not called, under
    either policy (before: the policy, so "open" let it through unlimited)."""
    with rlsidecar.Client(daemon.socket, timeout=2, on_unavailable=policy) as client:
        app = rlsidecar.WSGIMiddleware(hello_app, client, attrs=ua_attrs_wsgi)
        status, headers, body = wsgi_get(app, "/api/x", HTTP_USER_AGENT=BIG)
        assert (status, headers["content-type"], body) == (431, "application/problem+json", BODY_431)
        assert wsgi_get(app, "/api/x", HTTP_USER_AGENT="curl")[0] == 200

    async def main():
        async with rlsidecar.AsyncClient(daemon.socket, timeout=2, on_unavailable=policy) as client:
            app = rlsidecar.ASGIMiddleware(hello_asgi, client, attrs=ua_attrs_asgi)
            got = await asgi_get(app, "/api/x", headers=[(b"user-agent", BIG.encode())])
            assert got == (431, {"content-type": "application/problem+json", "content-length": str(len(BODY_431))},
                           BODY_431)
            assert (await asgi_get(app, "/api/x", headers=[(b"user-agent", b"curl")]))[0] == 200
    asyncio.run(main())
    assert json.loads(BODY_431)["status"] == 431


def test_attr_too_large(make_daemon):
    """A value longer than the daemon's --max-attr-len (set below what the gateway lets
    through) is refused with attr_too_large on a connection that stays usable: a 431,
    never the failure policy (under "open" it was bad_request, which the policy decided,
    and such requests passed every limit)."""
    from conftest import RULES
    d = make_daemon(RULES, ("--max-attr-len", "100"))
    with rlsidecar.Client(d.socket, timeout=2, pool_size=1, on_unavailable="open") as c:
        with pytest.raises(rlsidecar.RequestTooLargeError) as e:
            c.check({"user": "u" * 300})
        assert e.value.code == "attr_too_large"
        check_431(e.value.decision)
        assert c.check({"user": "kim"}).allowed  # the same connection, still usable
        app = rlsidecar.WSGIMiddleware(hello_app, c)
        for _ in range(6):
            assert wsgi_get(app, "/" + "p" * 300)[0] == 431

    async def main():
        async with rlsidecar.AsyncClient(d.socket, timeout=2, on_unavailable="open") as c:
            with pytest.raises(rlsidecar.RequestTooLargeError) as e:
                await c.check({"user": "u" * 300})
            assert e.value.code == "attr_too_large"
            check_431(e.value.decision)
            assert (await c.check({"user": "kim"})).allowed
    asyncio.run(main())


def test_async_checks_pipelined_behind_a_refused_frame_are_sent_again(make_daemon):
    """The daemon answers frame_too_large from a frame's header and reads nothing more of
    the connection: the checks pipelined after that frame on it were not read, not
    decided, and go again on a new connection, each counted once. Before, each got the
    policy (40 of 40 here, under "closed": one oversized request among concurrent ones
    refused the others)."""
    from conftest import RULES
    d = make_daemon(RULES, args=["--max-frame", "1024"])

    async def main():
        async with rlsidecar.AsyncClient(d.socket, timeout=5, on_unavailable="closed", max_frame=1 << 20) as c:
            await c.check({"user": "warm"})  # the connection, dialed
            before = [asyncio.ensure_future(c.check({"user": "u%d" % i})) for i in range(10)]
            big = asyncio.ensure_future(c.check({"user": "big", "path": "/" + "x" * 2000}))
            after = [asyncio.ensure_future(c.check({"user": "u%d" % i})) for i in range(10, 50)]
            with pytest.raises(rlsidecar.RequestTooLargeError) as e:
                await big
            check_431(e.value.decision)
            ds = await asyncio.gather(*(before + after))
            causes = [x.cause for x in ds if x.unreachable]
            assert causes == [], "%d of 50 checks answered by the policy: %s" % (len(causes), causes[:1])
            assert [x.remaining for x in ds] == [4] * 50  # each counted once
    asyncio.run(main())


def test_checks_batched_behind_a_refused_frame(make_daemon):
    """check_many pipelines a batch on one connection: the daemon answers frame_too_large
    for an oversized frame in it and reads nothing more. The batch raises
    RequestTooLargeError (a 431), never the policy (under "open", that let the oversized
    request through), and the checks after that frame, never read, are sent again on a
    new connection, each counted once. Before, the whole batch got the policy."""
    from conftest import RULES
    from fixedwindow import in_one_window
    d = make_daemon(RULES, args=["--max-frame", "1024"])

    def batches(big):
        def run(attempt):
            users = ["u%d-%d-%d" % (len(big), attempt, i) for i in range(50)]
            batch = [({"user": u}, 1, None) for u in users]
            batch.insert(10, ({"user": "big", "ua": big}, 1, None))
            for _ in range(4):
                with pytest.raises(rlsidecar.RequestTooLargeError) as e:
                    c.check_many(batch)
                check_431(e.value.decision)
            return [x.remaining for x in c.check_many([({"user": u}, 0, None) for u in users])]
        return run

    with rlsidecar.Client(d.socket, timeout=5, on_unavailable="open", max_frame=1 << 20) as c:
        assert in_one_window(60000, batches("x" * 2000)) == [1] * 50  # each counted once a batch
        # A frame far over --max-frame (the daemon drains what follows it, unread, before
        # it closes): the same.
        assert in_one_window(60000, batches(BIG)) == [1] * 50


def test_batch_refused_while_still_writing(short_tmp):
    """As test_refused_while_still_writing, for a check_many batch: the daemon answers the
    checks before an oversized frame, then frame_too_large from its header, and closes
    while the client still writes the batch (EPIPE; the real daemon drains before closing,
    unless too many refused connections linger at once). The answers already in the
    receive queue are read: the batch raises the 431, and the checks after the oversized
    frame, never read, go on a new connection, once each. Here a server that does just
    that, so that the write always fails."""
    import os
    import socket
    import struct
    import threading

    import msgpack

    path = os.path.join(short_tmp, "refuse.sock")
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(path)
    srv.listen(2)
    seen = []  # the users checked on the second connection

    def send(c, m):
        body = msgpack.packb(m)
        c.sendall(struct.pack(">I", len(body)) + body)

    def frame(c):
        n = struct.unpack(">I", c.recv(4, socket.MSG_WAITALL))[0]
        return msgpack.unpackb(c.recv(n, socket.MSG_WAITALL))

    def serve():
        c, _ = srv.accept()
        m = frame(c)  # the first check, whole
        send(c, {"id": m["id"], "allowed": True, "remaining": 4})
        c.recv(4, socket.MSG_WAITALL)  # the oversized frame's header only
        send(c, {"id": 0, "error": {"code": "frame_too_large",
                                    "message": "a frame of 4000000 bytes is over this daemon's 65536"}})
        c.close()
        c, _ = srv.accept()
        for _ in range(2):
            m = frame(c)
            seen.append(m["attrs"]["user"])
            send(c, {"id": m["id"], "allowed": True, "remaining": 4})
        c.recv(1)  # until the client closes

    t = threading.Thread(target=serve)
    t.start()
    try:
        with rlsidecar.Client(path, timeout=5, max_frame=1 << 22, on_unavailable="open") as c:
            with pytest.raises(rlsidecar.RequestTooLargeError) as e:
                c.check_many([({"user": "a"}, 1, None), ({"user": "big", "ua": "x" * 4_000_000}, 1, None),
                              ({"user": "b"}, 1, None), ({"user": "c"}, 1, None)])
            check_431(e.value.decision)
    finally:
        t.join(5)
        srv.close()
    assert seen == ["b", "c"]


def test_asgi_requests_behind_a_refused_frame_are_answered(make_daemon):
    """The ASGI middleware's concurrent requests are pipelined on AsyncClient's connection:
    one whose frame the daemon refuses as too large gets its 431, and those behind it on
    the connection, which the daemon never read, are checked on a new one. Before, each
    got the policy (503s under "closed")."""
    from conftest import RULES
    d = make_daemon(RULES, args=["--max-frame", "1024"])

    async def main():
        async with rlsidecar.AsyncClient(d.socket, timeout=5, on_unavailable="closed", max_frame=1 << 20) as client:
            app = rlsidecar.ASGIMiddleware(hello_asgi, client, attrs=ua_attrs_asgi)
            assert (await asgi_get(app, "/warm"))[0] == 200  # the connection, dialed
            ua = [b"big" * 700 if i == 5 else b"curl" for i in range(30)]
            got = await asyncio.gather(*(asgi_get(app, "/api/x", ip="192.0.2.%d" % (i + 10), headers=[(b"user-agent", u)])
                                         for i, u in enumerate(ua)))
            assert [g[0] for g in got] == [431 if i == 5 else 200 for i in range(30)]
    asyncio.run(main())
