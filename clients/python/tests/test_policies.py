"""The policy fields (warning, delay_ms, banned): decoded into the Decision, and the
middleware holding a delayed request — against the real daemon."""

import asyncio
import time

import rlsidecar
from fixedwindow import in_one_window
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
        got = in_one_window(3600000, lambda n: [c.check({"path": "/quota", "ip": "q%d" % n}) for _ in range(10)])
        assert [x.warning for x in got] == [False] * 7 + [True] * 3
        assert got[-1].rules[0].warning
        sent = time.monotonic()
        first, second = c.check({"path": "/queue", "ip": "a"}), c.check({"path": "/queue", "ip": "a"})
        gap_ms = (time.monotonic() - sent) * 1000
        assert first.allowed and first.delay_ms == 0
        # The second waits for the unit the first took (1 per 300 ms): 300 ms less the time
        # between the two decisions, which is at most gap_ms (1 ms for rounding). It was
        # 250 <= delay_ms: a gap over 50 ms on a loaded machine failed the test.
        assert second.allowed and max(0, 300 - gap_ms) - 1 <= second.delay_ms <= 300, (second.delay_ms, gap_ms)
        assert second.rules[0].delay_ms == second.delay_ms
        sent = time.monotonic()
        res = [c.check({"path": "/login", "ip": "a"}) for _ in range(4)]
        gap_ms = (time.monotonic() - sent) * 1000
        assert [x.allowed for x in res] == [True, False, False, False]
        assert [x.banned for x in res] == [False, False, True, True]
        # The ban (10 min) began at the third decision: what is left of it at the fourth.
        assert 600_000 - gap_ms - 1 <= res[3].retry_after_ms <= 600_000 and res[3].rules[0].banned, gap_ms


def test_middleware_waits_the_delay(make_daemon):
    d = make_daemon(RULES)
    with rlsidecar.Client(d.socket, timeout=2) as c:
        app = rlsidecar.WSGIMiddleware(hello_app, c)
        # Timed from before the first request: the second is held until 300 ms after the
        # first was decided. Timed from the second alone (>= 0.25), the first request's
        # own time after its check, over 50 ms on a loaded machine, shortened the hold.
        start = time.monotonic()
        assert wsgi_get(app, "/queue", ip="w")[0] == 200
        status, _, body = wsgi_get(app, "/queue", ip="w")
        assert status == 200 and body == b"hello" and time.monotonic() - start >= 0.29

    async def run():
        async with rlsidecar.AsyncClient(d.socket, timeout=2) as ac:
            app = rlsidecar.ASGIMiddleware(hello_asgi, ac)
            start = time.monotonic()
            assert (await asgi_get(app, "/queue", ip="x"))[0] == 200
            status, _, body = await asgi_get(app, "/queue", ip="x")
            assert status == 200 and body == b"hello" and time.monotonic() - start >= 0.29

    asyncio.run(run())
