"""WSGI and ASGI middleware: the shared header table end to end (a fake sidecar sends each
case's decision), and the real daemon with the default attributes."""

import asyncio
import json
import os
import socketserver
import threading
import time

import msgpack
import pytest

import rlsidecar
from rlsidecar import _proto
from conftest import wsgi_server

from test_headers import CASES


class _StandInHandler(socketserver.StreamRequestHandler):
    """Answers each request frame with the map self.server.answer(request) returns, its id
    set to the request's."""

    def handle(self):
        while True:
            head = self.rfile.read(4)
            if len(head) < 4:
                return
            req = _proto.decode(self.rfile.read(_proto.frame_length(head)))
            body = msgpack.packb(dict(self.server.answer(req), id=req["id"]))
            self.wfile.write(len(body).to_bytes(4, "big") + body)


def _case_answer(cases):
    def answer(req):
        resp = dict(cases[req["attrs"]["path"][1:]]["decision"], degraded=False)
        if not resp["reason"]:
            del resp["reason"]
        return resp
    return answer


@pytest.fixture
def fake_sidecar(short_tmp):
    """A sidecar that answers a check of path /<case name> with that case's decision."""
    path = os.path.join(short_tmp, "fake.sock")
    srv = socketserver.ThreadingUnixStreamServer(path, _StandInHandler)
    srv.daemon_threads = True
    srv.answer = _case_answer({c["name"]: c for c in CASES})
    t = threading.Thread(target=srv.serve_forever)
    t.start()
    yield path
    srv.shutdown()
    srv.server_close()
    t.join()


def hello_app(environ, start_response):
    start_response("200 OK", [("Content-Type", "text/plain"), ("X-Next", "1")])
    return [b"hello"]


def wsgi_get(app, path, method="GET", ip="192.0.2.1", **environ):
    got = {}

    def start_response(status, headers, exc_info=None):
        got["status"] = int(status.split()[0])
        got["headers"] = {k.lower(): v for k, v in headers}

    body = b"".join(app(dict({"REQUEST_METHOD": method, "PATH_INFO": path, "SCRIPT_NAME": "", "REMOTE_ADDR": ip,
                              "QUERY_STRING": "q=1"}, **environ), start_response))
    return got["status"], got["headers"], body


async def hello_asgi(scope, receive, send):
    await send({"type": "http.response.start", "status": 200, "headers": [(b"x-next", b"1")]})
    await send({"type": "http.response.body", "body": b"hello"})


async def asgi_get(app, path, method="GET", ip="192.0.2.1", **scope):
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(m):
        sent.append(m)

    await app(dict({"type": "http", "method": method, "path": path, "query_string": b"q=1", "client": (ip, 4711),
                    "headers": []}, **scope), receive, send)
    start = sent[0]
    return start["status"], {k.decode(): v.decode() for k, v in start["headers"]}, b"".join(
        m.get("body", b"") for m in sent[1:])


def check_case(c, status, headers, body):
    assert status == c["status"], c["name"]
    for k in ("ratelimit-policy", "ratelimit", "retry-after"):
        assert headers.get(k) == {n.lower(): v for n, v in c["headers"].items()}.get(k), (c["name"], k)
    assert (headers.get("x-next") == "1") == (status == 200)
    if status == 429:
        assert headers["content-type"] == "application/problem+json"
        p = json.loads(body)
        assert p["status"] == 429 and p.get("rule") == (c["decision"]["rule"] or None)
        assert str(p.get("retry_after", "")) == c["headers"].get("Retry-After", "")
    else:
        assert body == b"hello"


def test_wsgi_table(fake_sidecar):
    with rlsidecar.Client(fake_sidecar, timeout=2) as client:
        app = rlsidecar.WSGIMiddleware(hello_app, client)
        for c in CASES:
            check_case(c, *wsgi_get(app, "/" + c["name"]))


def test_asgi_table(fake_sidecar):
    async def main():
        async with rlsidecar.AsyncClient(fake_sidecar, timeout=2) as client:
            app = rlsidecar.ASGIMiddleware(hello_asgi, client)
            for c in CASES:
                check_case(c, *await asgi_get(app, "/" + c["name"]))
    asyncio.run(main())


RULES_IP = """
rules:
  - name: per-ip
    match: { path: /api/** }
    key: [ip, method]
    limit: { requests: 2, per: 60s }
"""


def assert_retry_after(got, full_ms, gap_ms):
    """got (status, headers, body) is per-ip's refusal of the third request, full_ms after
    the first took the token it waits for, less the time between their decisions (at most
    gap_ms, 1 ms for rounding): whole seconds, rounded up, in Retry-After, RateLimit's t and
    the body's retry_after. It was exactly 30: requests spread over more than a second on a
    loaded machine failed the test."""
    ra = int(got[1]["retry-after"])
    assert -(-(full_ms - gap_ms - 1) // 1000) <= ra <= full_ms // 1000, (ra, gap_ms)
    assert got[1]["ratelimit"] == '"per-ip";r=0;t=%d' % ra
    p = json.loads(got[2])
    assert (p["rule"], p["retry_after"]) == ("per-ip", ra)


def test_wsgi_real_daemon(make_daemon):
    d = make_daemon(RULES_IP)
    with rlsidecar.Client(d.socket, timeout=2) as client:
        app = rlsidecar.WSGIMiddleware(hello_app, client, cost=lambda env: 1)
        sent = time.monotonic()
        got = [wsgi_get(app, "/api/x")]
        time.sleep(0.01)  # so the retry is not whole seconds: rounding down would show
        got += [wsgi_get(app, "/api/x") for _ in range(2)]
        gap_ms = (time.monotonic() - sent) * 1000
        assert [g[0] for g in got] == [200, 200, 429]
        assert got[0][1]["ratelimit"] == '"per-ip";r=1;t=30' and got[0][1]["x-next"] == "1"
        assert_retry_after(got[2], 30000, gap_ms)
        # The key is ip and method: another method, another IP, an unmatched path pass.
        assert wsgi_get(app, "/api/x", method="POST")[0] == 200
        assert wsgi_get(app, "/api/x", ip="192.0.2.2")[0] == 200
        status, headers, _ = wsgi_get(app, "/other")
        assert status == 200 and "ratelimit" not in headers


def test_asgi_real_daemon(make_daemon):
    d = make_daemon(RULES_IP)

    async def main():
        async with rlsidecar.AsyncClient(d.socket, timeout=2) as client:
            app = rlsidecar.ASGIMiddleware(hello_asgi, client)
            sent = time.monotonic()
            got = [await asgi_get(app, "/api/x")]
            await asyncio.sleep(0.01)  # so the figures are not whole seconds: rounding down would show
            got += [await asgi_get(app, "/api/x") for _ in range(2)]
            gap_ms = (time.monotonic() - sent) * 1000
            assert [g[0] for g in got] == [200, 200, 429]
            # Full again 60 s after the first request was decided, less the time until the
            # second's decision (at most gap_ms), rounded up (it was t=60: a loaded machine
            # failed the test).
            t = int(got[1][1]["ratelimit"].rpartition(";t=")[2])
            assert got[1][1]["ratelimit"] == '"per-ip";r=0;t=%d' % t and -(-(60000 - gap_ms - 1) // 1000) <= t <= 60, gap_ms
            assert_retry_after(got[2], 30000, gap_ms)
            # Lifespan and other scopes pass through unchecked.
            seen = []

            async def other(scope, receive, send):
                seen.append(scope["type"])
            await rlsidecar.ASGIMiddleware(other, client)({"type": "lifespan"}, None, None)
            assert seen == ["lifespan"]
    asyncio.run(main())


def test_none_attribute_is_left_out(daemon):
    """An attrs function passing a header the request lacks (None) leaves the attribute
    out: the rule keyed on it does not apply, and the request is not an exception."""
    with rlsidecar.Client(daemon.socket, timeout=2) as client:
        app = rlsidecar.WSGIMiddleware(hello_app, client,
                                       attrs=lambda env: dict(rlsidecar.wsgi_attrs(env), user=env.get("HTTP_X_USER")))
        got = [wsgi_get(app, "/api/x", HTTP_X_USER="bob")[0] for _ in range(6)]
        assert got == [200, 200, 200, 200, 200, 429]
        for _ in range(6):
            status, headers, body = wsgi_get(app, "/api/x")
            assert status == 200 and body == b"hello" and "ratelimit" not in headers

    async def main():
        async with rlsidecar.AsyncClient(daemon.socket, timeout=2) as client:
            def attrs(scope):
                user = dict(scope["headers"]).get(b"x-user")
                return dict(rlsidecar.asgi_attrs(scope), user=user.decode() if user is not None else None)
            app = rlsidecar.ASGIMiddleware(hello_asgi, client, attrs=attrs)
            got = [(await asgi_get(app, "/api/x", headers=[(b"x-user", b"carol")]))[0] for _ in range(6)]
            assert got == [200, 200, 200, 200, 200, 429]
            for _ in range(6):
                status, headers, body = await asgi_get(app, "/api/x")
                assert status == 200 and body == b"hello" and "ratelimit" not in headers
    asyncio.run(main())


@pytest.mark.parametrize("policy, want", [("open", 200), ("closed", 503)])
def test_unreachable_policies(short_tmp, policy, want):
    path = os.path.join(short_tmp, "none.sock")
    with rlsidecar.Client(path, on_unavailable=policy) as client:
        status, headers, body = wsgi_get(rlsidecar.WSGIMiddleware(hello_app, client), "/api/x")
    assert status == want
    if want == 503:
        assert headers["retry-after"] == "1" and json.loads(body)["title"] == "Service Unavailable"
    else:
        assert body == b"hello" and "ratelimit" not in headers

    async def main():
        async with rlsidecar.AsyncClient(path, on_unavailable=policy) as client:
            return await asgi_get(rlsidecar.ASGIMiddleware(hello_asgi, client), "/api/x")
    status, headers, body = asyncio.run(main())
    assert status == want and (want == 200 or headers["retry-after"] == "1")


def test_protocol_error_follows_the_policy(short_tmp):
    """An error answer the caller caused is answered by the policy, as for an unreachable
    sidecar."""
    path = os.path.join(short_tmp, "bad.sock")
    srv = socketserver.ThreadingUnixStreamServer(path, _StandInHandler)
    srv.daemon_threads = True
    srv.answer = lambda req: {"error": {"code": "bad_request", "message": "cost must be an unsigned integer"}}
    t = threading.Thread(target=srv.serve_forever)
    t.start()
    try:
        with rlsidecar.Client(path, timeout=2, on_unavailable="closed") as client:
            status, headers, body = wsgi_get(rlsidecar.WSGIMiddleware(hello_app, client), "/")
    finally:
        srv.shutdown()
        srv.server_close()
        t.join()
    assert status == 503


@pytest.mark.parametrize("policy", ["open", "closed"])
def test_too_many_attrs_is_431(daemon, policy):
    """Attributes taken from the HTTP client's headers: too many of them, or a name too
    long, is 431 whatever the policy (the daemon answered bad_request, which the policy
    decided: "open" let 100 headers past every limit)."""
    many = {"a%d" % i: "v" for i in range(100)}
    for attrs in (many, {"n" * 300: "v"}):
        with rlsidecar.Client(daemon.socket, timeout=2, on_unavailable=policy) as client:
            status, headers, body = wsgi_get(rlsidecar.WSGIMiddleware(hello_app, client, attrs=lambda env: attrs), "/")
        assert status == 431


@pytest.mark.parametrize("policy, want", [("open", 200), ("closed", 503)])
def test_closed_client_follows_the_policy(daemon, policy, want):
    client = rlsidecar.Client(daemon.socket, timeout=2, on_unavailable=policy)
    client.close()
    assert wsgi_get(rlsidecar.WSGIMiddleware(hello_app, client), "/api/x")[0] == want

    async def main():
        c = rlsidecar.AsyncClient(daemon.socket, timeout=2, on_unavailable=policy)
        await c.close()
        return await asgi_get(rlsidecar.ASGIMiddleware(hello_asgi, c), "/api/x")
    assert asyncio.run(main())[0] == want


RULES_BYTES = """
rules:
  - name: cafe
    match: { path: "/café/**" }
    key: ip
    limit: { requests: 2, per: 60s }
  - name: per-path
    match: { path: "/b/**" }
    key: path
    limit: { requests: 1, per: 60s }
"""


def test_wsgi_sends_the_paths_bytes(make_daemon):
    """PATH_INFO is the path's bytes decoded as latin-1 (PEP 3333): the middleware sends
    those bytes, so a rule on /café/** (UTF-8) matches, as under ASGI."""
    d = make_daemon(RULES_BYTES)
    with rlsidecar.Client(d.socket, timeout=2) as client:
        app = rlsidecar.WSGIMiddleware(hello_app, client)
        cafe = "/café/menu".encode("utf-8").decode("latin-1")  # what a WSGI server puts in PATH_INFO
        got = [wsgi_get(app, cafe) for _ in range(3)]
        assert [g[0] for g in got] == [200, 200, 429]
        assert got[0][1]["ratelimit"] == '"cafe";r=1;t=30'
        # Bytes that are not UTF-8 reach the daemon as they are (msgpack bin), each its own
        # key: \xff and \xfe are not both replaced with U+FFFD.
        assert [wsgi_get(app, p)[0] for p in ("/b/\xff", "/b/\xfe", "/b/\xff")] == [200, 200, 429]


def test_asgi_sends_the_paths_bytes(make_daemon):
    d = make_daemon(RULES_BYTES)

    async def main():
        async with rlsidecar.AsyncClient(d.socket, timeout=2) as client:
            app = rlsidecar.ASGIMiddleware(hello_asgi, client)
            got = [await asgi_get(app, "/café/menu") for _ in range(3)]
            assert [g[0] for g in got] == [200, 200, 429]
    asyncio.run(main())


def test_attribute_bytes_are_sent_as_bin():
    """A str attribute is a msgpack str (its UTF-8 bytes); a bytes one is a msgpack bin of
    exactly its bytes (the daemon takes either); anything else is refused."""
    frame = _proto.encode(_proto.check_message(1, {"path": b"/\xff"}, 1, None))
    assert frame.endswith(b"\xa5attrs\x81\xa4path\xc4\x02/\xff")
    frame = _proto.encode(_proto.check_message(1, {"path": "/café"}, 1, None))
    assert frame.endswith(b"\xa5attrs\x81\xa4path\xa6/caf\xc3\xa9")
    for bad in ({"path": 1}, {"path": bytearray(b"/")}, {b"path": "/"}):
        with pytest.raises(TypeError):
            _proto.check_message(1, bad, 1, None)


RULES_USER = """
rules:
  - name: per-user
    key: user
    limit: { requests: 3, per: 60s }
"""


def test_header_helpers_send_the_headers_bytes(make_daemon):
    """A header value reaches the daemon as the client sent its bytes, as through every
    other gateway: X-User: café through a real WSGI server (wsgiref) and wsgi_header, and
    through asgi_header, is the key of {"user": "café"}. environ.get("HTTP_X_USER") sends
    other bytes ("cafÃ©": latin-1 read back as UTF-8), another key (found by a client
    audit)."""
    import http.client

    d = make_daemon(RULES_USER)
    with rlsidecar.Client(d.socket, timeout=2) as client:
        app = rlsidecar.WSGIMiddleware(hello_app, client,
                                       attrs=lambda env: {"user": rlsidecar.wsgi_header(env, "X-User")})
        with wsgi_server(app) as port:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.putrequest("GET", "/x")
            conn.putheader("X-User", "café".encode("utf-8"))  # raw UTF-8 bytes on the wire
            conn.endheaders()
            resp = conn.getresponse()
            resp.read()
            assert resp.status == 200
        assert client.check({"user": "café"}, cost=0).remaining == 2, "the header's bytes are not the key of café"
        assert rlsidecar.wsgi_header({}, "X-User") is None
        assert rlsidecar.wsgi_header({"HTTP_X_API_KEY": "\xff"}, "x-api-key") == b"\xff"
        # PEP 3333 keeps these two without HTTP_ (before, they were never found).
        assert rlsidecar.wsgi_header({"CONTENT_TYPE": "application/json"}, "Content-Type") == "application/json"
        assert rlsidecar.wsgi_header({"CONTENT_LENGTH": "12"}, "content-length") == "12"

    scope = {"headers": [(b"x-user", "café".encode("utf-8")), (b"host", b"h")]}
    assert rlsidecar.asgi_header(scope, "X-User") == "café"
    assert rlsidecar.asgi_header(scope, "x-other") is None
