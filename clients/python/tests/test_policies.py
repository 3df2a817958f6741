"""The policy fields (warning, delay_ms, banned): decoded into the Decision, and the
middleware holding a delayed request — against the real daemon."""

import asyncio
import time

import rlsidecar
from test_middleware import asgi_get, hello_app, hello_asgi, wsgi_get

RULES = """
rules:
  - name: quota
    match: { path: /quota }
    key: ip
    algorithm: fixed_window
    limit: { requests: 10, per: 1h }
    warn_at: 0.8
  - name: queue
    match: { path: /queue }
    key: ip
    limit: { requests: 1, per: 300ms }
    delay: 1s
  - name: login
    match: { path: /login }
    key: ip
    limit: { requests: 1, per: 1m }
    penalty: { after: 2, within: 1m, ban: 10m }
"""


def test_policy_fields(make_daemon):
    d = make_daemon(RULES)
    with rlsidecar.Client(d.socket, timeout=2) as c:
        got = [c.check({"path": "/quota", "ip": "a"}) for _ in range(10)]
        assert [x.warning for x in got] == [False] * 7 + [True] * 3
        assert got[-1].rules[0].warning
        first, second = c.check({"path": "/queue", "ip": "a"}), c.check({"path": "/queue", "ip": "a"})
        assert first.allowed and first.delay_ms == 0
        assert second.allowed and 250 <= second.delay_ms <= 300 and second.rules[0].delay_ms == second.delay_ms
        res = [c.check({"path": "/login", "ip": "a"}) for _ in range(4)]
        assert [x.allowed for x in res] == [True, False, False, False]
        assert [x.banned for x in res] == [False, False, True, True]
        assert 599_000 <= res[3].retry_after_ms <= 600_000 and res[3].rules[0].banned


def test_middleware_waits_the_delay(make_daemon):
    d = make_daemon(RULES)
    with rlsidecar.Client(d.socket, timeout=2) as c:
        app = rlsidecar.WSGIMiddleware(hello_app, c)
        assert wsgi_get(app, "/queue", ip="w")[0] == 200
        start = time.monotonic()
        status, _, body = wsgi_get(app, "/queue", ip="w")
        assert status == 200 and body == b"hello" and time.monotonic() - start >= 0.25

    async def run():
        async with rlsidecar.AsyncClient(d.socket, timeout=2) as ac:
            app = rlsidecar.ASGIMiddleware(hello_asgi, ac)
            assert (await asgi_get(app, "/queue", ip="x"))[0] == 200
            start = time.monotonic()
            status, _, body = await asgi_get(app, "/queue", ip="x")
            assert status == 200 and body == b"hello" and time.monotonic() - start >= 0.25

    asyncio.run(run())
