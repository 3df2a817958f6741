"""The blocking Client against the real daemon: decisions, the pool, pipelined batches,
and a sidecar that is missing, stalled or restarted."""

import os
import threading
import time

import pytest

import rlsidecar


def test_allows_then_rejects(daemon):
    with rlsidecar.Client(daemon.socket, timeout=2) as c:
        for i in range(5):
            d = c.check({"user": "alice"})
            assert (d.allowed, d.rule, d.limit, d.remaining, d.degraded, d.unreachable) == (
                True, "per-user", 5, 4 - i, False, False)
        d = c.check({"user": "alice"})
        assert not d.allowed and d.rule == "per-user" and d.remaining == 0
        assert 11000 < d.retry_after_ms <= 12000
        status, headers, body = d.rejection()
        assert status == 429
        assert headers["RateLimit-Policy"] == '"per-user";q=5;w=60'
        assert headers["RateLimit"] == '"per-user";r=0;t=60'
        assert headers["Retry-After"] == "12"
        assert b'"rule":"per-user","retry_after":12}' in body
        # Another user is not affected; cost 0 peeks without consuming.
        assert c.check({"user": "bob"}, cost=0).remaining == 5
        assert c.check({"user": "bob"}).remaining == 4


def test_two_rules_and_cost(daemon):
    with rlsidecar.Client(daemon.socket, timeout=2) as c:
        d = c.check({"method": "POST", "path": "/login", "ip": "198.51.100.1", "user": "carol"}, cost=2)
        assert d.allowed and d.rule == "login-per-ip" and d.remaining == 1
        assert [r.name for r in d.rules] == ["per-user", "login-per-ip"]
        assert d.headers()["RateLimit"] == '"login-per-ip";r=1;t=40, "per-user";r=3;t=24'
        d = c.check({"user": "carol"}, cost=6)
        assert not d.allowed and d.reason == rlsidecar.COST_EXCEEDS_CAPACITY and "Retry-After" not in d.headers()


def test_inline_limits(daemon):
    with rlsidecar.Client(daemon.socket, timeout=2) as c:
        lim = [{"key": "tenant:acme", "limit": 2, "window_ms": 60000, "algorithm": "fixed_window", "name": "acme"}]
        assert [c.check({}, limits=lim).allowed for _ in range(3)] == [True, True, False]
        with pytest.raises(rlsidecar.ProtocolError) as e:
            c.check({}, limits=[{"key": "k", "limit": 0, "window_ms": 1000}])
        assert e.value.code == "invalid_limit" and "limit" in e.value.message
        assert e.value.decision.allowed and e.value.decision.degraded and not e.value.decision.unreachable
        # Still usable after the error answer.
        assert c.check({"user": "dave"}).allowed


@pytest.mark.parametrize("bad, exc", [
    (({"user": 1},), TypeError),
    (({"user": "x"}, -1), ValueError),
    (({"user": "x"}, 1.5), ValueError),
    (({}, 1, [{"key": "k", "limit": 1}]), ValueError),
    (({}, 1, [{"key": "k", "limit": 1, "window_ms": 1, "colour": "red"}]), ValueError),
    (({}, 1, ["k"]), TypeError),
    ((["user", "x"],), TypeError),
    (({}, 1, {"key": "k"}), TypeError),
])
def test_bad_input_is_refused_before_sending(daemon, bad, exc):
    with rlsidecar.Client(daemon.socket, timeout=2) as c:
        with pytest.raises(exc):
            c.check(*bad)
        # Nothing was consumed and the connection is still in step.
        assert c.check({"user": "x"}).remaining == 4


def test_bad_options():
    for kw in ({"timeout": 0}, {"timeout": "1"}, {"on_unavailable": "maybe"}, {"pool_size": 0}):
        with pytest.raises(ValueError):
            rlsidecar.Client("/tmp/x.sock", **kw)
    with pytest.raises(ValueError):
        rlsidecar.Client("")


def test_check_many_pipelines_on_one_connection(daemon):
    with rlsidecar.Client(daemon.socket, timeout=10) as c:
        ds = c.check_many([({"user": "erin"}, 1, None)] * 7)
        assert [d.allowed for d in ds] == [True] * 5 + [False] * 2
        assert [d.remaining for d in ds[:5]] == [4, 3, 2, 1, 0]
        assert len(c._idle) == 1
        assert c.check_many([]) == []
        # A batch larger than the socket buffers both ways (4,000 checks with 2 KB attributes).
        lim = [{"key": "big", "limit": 3000, "window_ms": 3600000, "algorithm": "fixed_window"}]
        ds = c.check_many([({"pad": "x" * 2048}, 1, lim)] * 4000)
        assert sum(d.allowed for d in ds) == 3000 and not any(d.degraded for d in ds)


def test_threads_share_the_pool_and_nothing_is_lost(daemon):
    """8 threads × 100 checks against one inline limit of 10,000: each is counted once."""
    lim = [{"key": "shared", "limit": 10000, "window_ms": 3600000, "algorithm": "fixed_window"}]
    errors = []
    with rlsidecar.Client(daemon.socket, timeout=2, pool_size=8) as c:
        def run():
            try:
                for _ in range(100):
                    d = c.check({}, limits=lim)
                    assert d.allowed and not d.degraded
            except BaseException as e:
                errors.append(e)

        ts = [threading.Thread(target=run) for _ in range(8)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        assert not errors
        assert c.check({}, cost=0, limits=lim).remaining == 10000 - 800
        assert 1 <= len(c._idle) <= 8


@pytest.mark.parametrize("policy", ["open", "closed"])
def test_missing_socket(short_tmp, policy):
    c = rlsidecar.Client(os.path.join(short_tmp, "none.sock"), on_unavailable=policy)
    d = c.check({"user": "x"})
    assert d.allowed == (policy == "open")
    assert d.degraded and d.unreachable and "none.sock" in d.cause
    assert d.status == (200 if policy == "open" else 503)
    # Backing off (10 ms doubling, with jitter): of 20 checks in a row, some answer at once
    # without dialing, however slow the machine.
    causes = [c.check({"user": "x"}).cause for _ in range(20)]
    assert any("backing off" in cause for cause in causes), causes
    assert 1 <= c._failures < 20
    with pytest.raises(ConnectionError):
        c.ping()


def test_stalled_sidecar_times_out_then_recovers(daemon):
    with rlsidecar.Client(daemon.socket, timeout=0.1, on_unavailable="closed") as c:
        assert c.check({"user": "frank"}).remaining == 4
        daemon.pause()
        try:
            t = time.monotonic()
            d = c.check({"user": "frank"})
            took = time.monotonic() - t
        finally:
            daemon.resume()
        assert not d.allowed and d.unreachable and d.degraded and "timeout" in d.cause
        assert 0.09 <= took < 3.0  # bounded by the timeout, not the daemon: it never answers while stopped
        # The stalled request did reach the daemon (it consumed one when the daemon woke);
        # the timed-out connection was closed, so its late answer cannot be read as this one's.
        d = c.check({"user": "frank"})
        assert d.allowed and not d.degraded and d.remaining in (2, 3)


def test_restarted_sidecar(daemon):
    with rlsidecar.Client(daemon.socket, timeout=0.5) as c:
        assert c.check({"user": "gina"}).allowed
        daemon.stop()
        d = c.check({"user": "gina"})
        assert d.allowed and d.unreachable
        daemon.start()
        deadline = time.monotonic() + 5
        while True:
            d = c.check({"user": "gina"})
            if not d.unreachable or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        assert not d.unreachable and d.remaining == 4  # a new daemon, fresh state


def test_ping_and_close(daemon):
    c = rlsidecar.Client(daemon.socket, timeout=2)
    assert c.ping()
    c.close()
    with pytest.raises(rlsidecar.ClosedError):
        c.check({"user": "x"})


def test_a_sidecar_that_accepts_and_drops_is_backed_off(short_tmp):
    """A listener that closes every connection at once: the first check fails, the next
    ones back off instead of redialling."""
    import socket as s

    path = os.path.join(short_tmp, "drop.sock")
    srv = s.socket(s.AF_UNIX, s.SOCK_STREAM)
    srv.bind(path)
    srv.listen(16)
    accepted = []

    def drop():
        while True:
            try:
                c, _ = srv.accept()
            except OSError:
                return
            accepted.append(1)
            c.close()

    t = threading.Thread(target=drop)
    t.start()
    try:
        with rlsidecar.Client(path, timeout=1) as c:
            d = c.check({"user": "x"})
            assert d.unreachable and "connection lost" in d.cause
            causes = [c.check({"user": "x"}).cause for _ in range(20)]
            assert any("backing off" in cause for cause in causes), causes
        assert len(accepted) < 20
    finally:
        srv.shutdown(s.SHUT_RDWR)
        srv.close()
        t.join()


def test_frame_too_large_then_the_next_check_is_answered(daemon):
    """A request over the daemon's frame limit is the caller's error; the daemon closes
    that connection, so the client does not pool it, and the next check is answered."""
    with rlsidecar.Client(daemon.socket, timeout=2, pool_size=1) as c:
        assert c.check({"user": "ivy"}).allowed
        with pytest.raises(rlsidecar.ProtocolError) as e:
            c.check({"user": "ivy", "blob": "x" * 70000})
        assert e.value.code == "frame_too_large"
        d = c.check({"user": "ivy"})
        assert d.allowed and not d.degraded and d.remaining == 3
