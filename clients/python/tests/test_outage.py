"""The outage log: a sidecar that gives no answer (a wrong socket path, a socket the app
may not open, a stopped daemon) is logged, rate limited, not silently failed open."""

import asyncio
import logging
import os
import time

import pytest

import rlsidecar
from rlsidecar._outage import OUTAGE_LOG_INTERVAL


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def messages(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "rlsidecar"]


def wait_until_answered(check):
    deadline = time.monotonic() + 5
    while check().unreachable:
        assert time.monotonic() < deadline, "the restarted daemon never answered"
        time.sleep(0.005)


@pytest.mark.parametrize("policy", ["open", "closed"])
def test_unreachable_sidecar_is_logged(daemon, caplog, policy):
    caplog.set_level(logging.WARNING, logger="rlsidecar")
    daemon.stop()
    # 2 s: the 20 checks after the restart must be answered, not timed out on a loaded
    # machine (the default, 50 ms); with the daemon stopped, they fail at once either way.
    c = rlsidecar.Client(daemon.socket, timeout=2, on_unavailable=policy)
    clock = c._outage.now = Clock()
    try:
        for _ in range(5):
            assert c.check({"user": "a"}).unreachable
        got = messages(caplog)
        assert len(got) == 1, got
        want = "requests pass without rate limiting" if policy == "open" else "requests are refused"
        assert "sidecar at %s unreachable" % daemon.socket in got[0] and want in got[0], got[0]
        assert "on_unavailable=%r" % policy in got[0] and "(1 check decided by the policy" in got[0], got[0]
        assert all(r.levelno == logging.WARNING for r in caplog.records if r.name == "rlsidecar")

        clock.t += OUTAGE_LOG_INTERVAL - 0.001
        c.check({"user": "a"})
        assert len(messages(caplog)) == 1
        clock.t += 0.001
        c.check_many([({"user": "a"}, 1, None), ({"user": "b"}, 1, None)])
        got = messages(caplog)
        assert len(got) == 2 and "still unreachable" in got[1], got
        assert "(7 checks decided by the policy since the last line)" in got[1], got[1]

        daemon.start()
        wait_until_answered(lambda: c.check({"user": "a"}))
        got = messages(caplog)
        assert len(got) == 3 and "sidecar at %s answers again" % daemon.socket in got[2], got
        for i in range(20):
            assert not c.check({"user": "u%d" % i}).unreachable
        assert len(messages(caplog)) == 3
    finally:
        c.close()


def test_flapping_sidecar_does_not_flood_the_log(daemon, caplog):
    caplog.set_level(logging.WARNING, logger="rlsidecar")
    c = rlsidecar.Client(daemon.socket, timeout=2)
    clock = c._outage.now = Clock()
    try:
        for i in range(100):
            clock.t += 0.01
            c._unreachable("no answer within the timeout", 1)  # as a check that timed out
            clock.t += 0.01
            assert not c.check({"user": "u%d" % i}).unreachable
        got = messages(caplog)
        assert len(got) == 2, got  # 2 s: one failure line, one recovery line
        clock.t += OUTAGE_LOG_INTERVAL
        c._unreachable("no answer within the timeout", 1)
        got = messages(caplog)
        assert len(got) == 3 and "(100 checks decided by the policy since the last line)" in got[2], got
    finally:
        c.close()


def test_async_client_and_wsgi_middleware_log_an_unreachable_sidecar(daemon, short_tmp, caplog):
    caplog.set_level(logging.WARNING, logger="rlsidecar")
    typo = os.path.join(short_tmp, "typo.sockk")

    def app(environ, start_response):
        start_response("200 OK", [])
        return [b"ok"]

    c = rlsidecar.Client(typo)
    mw = rlsidecar.WSGIMiddleware(app, c)
    for _ in range(3):
        out = []
        env = {"REQUEST_METHOD": "GET", "PATH_INFO": "/", "REMOTE_ADDR": "127.0.0.1"}
        assert b"".join(mw(env, lambda s, h, exc=None: out.append(s))) == b"ok" and out == ["200 OK"]
    c.close()
    got = messages(caplog)
    assert len(got) == 1 and "sidecar at %s unreachable; requests pass" % typo in got[0], got

    caplog.clear()
    daemon.stop()

    async def run():
        async with rlsidecar.AsyncClient(daemon.socket) as ac:
            clock = ac._outage.now = Clock()
            for _ in range(3):
                assert (await ac.check({"user": "a"})).unreachable
            assert len(messages(caplog)) == 1
            daemon.start()
            deadline = time.monotonic() + 5
            while (await ac.check({"user": "a"})).unreachable:
                assert time.monotonic() < deadline
                clock.t += 0.001
                await asyncio.sleep(0.005)

    asyncio.run(run())
    got = messages(caplog)
    assert len(got) == 2 and "unreachable" in got[0] and "answers again" in got[1], got
