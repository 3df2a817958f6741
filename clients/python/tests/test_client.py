"""The blocking Client against the real daemon: decisions, the pool, pipelined batches,
and a sidecar that is missing, stalled or restarted."""

import ctypes
import os
import resource
import socket
import struct
import threading
import time

import pytest

import rlsidecar

from conftest import RULES
from fixedwindow import in_one_window


def test_allows_then_rejects(daemon):
    with rlsidecar.Client(daemon.socket, timeout=2) as c:
        sent = time.monotonic()
        for i in range(5):
            d = c.check({"user": "alice"})
            assert (d.allowed, d.rule, d.limit, d.remaining, d.degraded, d.unreachable) == (
                True, "per-user", 5, 4 - i, False, False)
            if i == 0:
                time.sleep(0.01)  # so the retry is not whole seconds: rounding down would show
        d = c.check({"user": "alice"})
        gap_ms = (time.monotonic() - sent) * 1000
        assert not d.allowed and d.rule == "per-user" and d.remaining == 0
        # The next token comes 12 s after the first check, less the time between the first
        # decision and this one, at most gap_ms (1 ms for rounding). It was
        # 11000 < retry_after_ms and Retry-After 12: checks spread over more than 1 s on a
        # loaded machine failed the test.
        assert 12000 - gap_ms - 1 <= d.retry_after_ms <= 12000, (d.retry_after_ms, gap_ms)
        s = -(-d.retry_after_ms // 1000)  # whole seconds, rounded up: 12 unless the checks took over 1 s
        status, headers, body = d.rejection()
        assert status == 429
        assert headers["RateLimit-Policy"] == '"per-user";q=5;w=60'
        assert headers["RateLimit"] == '"per-user";r=0;t=%d' % s
        assert headers["Retry-After"] == str(s)
        assert b'"rule":"per-user","retry_after":%d}' % s in body
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
        for cost in (2**32, 2**64 - 1, 2**64, 2**80):  # past uint64: as 2^64 - 1 (it raised OverflowError)
            d = c.check({"user": "carol"}, cost=cost)
            assert not d.allowed and d.reason == rlsidecar.COST_EXCEEDS_CAPACITY, cost


def test_inline_limits(daemon):
    with rlsidecar.Client(daemon.socket, timeout=2) as c:
        def three(n):
            lim = [{"key": "tenant:acme%d" % n, "limit": 2, "window_ms": 60000, "algorithm": "fixed_window",
                    "name": "acme"}]
            return [c.check({}, limits=lim).allowed for _ in range(3)]
        assert in_one_window(60000, three) == [True, True, False]
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


def test_none_attribute_value_is_left_out(daemon):
    from rlsidecar import _proto
    frame = lambda attrs: _proto.encode(_proto.check_message(1, attrs, 1, None))  # noqa: E731
    assert frame({"ip": "::1", "user": None, "path": "/a"}) == frame({"ip": "::1", "path": "/a"})
    assert frame({"user": None}) == frame({})
    with pytest.raises(TypeError):
        frame({None: "x"})
    with rlsidecar.Client(daemon.socket, timeout=2) as c:
        for _ in range(5):
            assert c.check({"user": "ann", "ip": None}).allowed
        assert not c.check({"user": "ann", "ip": None}).allowed
        d = c.check({"user": None})
        assert d.allowed and d.rule == "" and not d.degraded


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
        ds = in_one_window(3600000, lambda n: c.check_many(
            [({"pad": "x" * 2048}, 1, [{"key": "big%d" % n, "limit": 3000, "window_ms": 3600000,
                                         "algorithm": "fixed_window"}])] * 4000))
        assert sum(d.allowed for d in ds) == 3000 and not any(d.degraded for d in ds)


def test_threads_share_the_pool_and_nothing_is_lost(daemon):
    """8 threads × 100 checks against one inline limit of 10,000: each is counted once."""
    with rlsidecar.Client(daemon.socket, timeout=2, pool_size=8) as c:
        def burst(n):
            lim = [{"key": "shared%d" % n, "limit": 10000, "window_ms": 3600000, "algorithm": "fixed_window"}]
            errors = []

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
            return errors, c.check({}, cost=0, limits=lim).remaining
        errors, left = in_one_window(3600000, burst)
        assert not errors
        assert left == 10000 - 800
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
    with rlsidecar.Client(daemon.socket, timeout=2, on_unavailable="closed") as c:
        assert c.check({"user": "frank"}).remaining == 4
        c.timeout = 0.1  # for the stalled check only: the answer after it is awaited 2 s
        daemon.pause()
        try:
            t = time.monotonic()
            d = c.check({"user": "frank"})
            took = time.monotonic() - t
        finally:
            daemon.resume()
        c.timeout = 2
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
    """A request over the daemon's frame limit (sent: this client's max_frame is larger);
    the daemon closes that connection, so the client does not pool it, and the next check
    is answered. (test_too_large.py: what the error means, and the default max_frame.)"""
    with rlsidecar.Client(daemon.socket, timeout=2, pool_size=1, max_frame=1 << 20) as c:
        assert c.check({"user": "ivy"}).allowed
        with pytest.raises(rlsidecar.ProtocolError) as e:
            c.check({"user": "ivy", "blob": "x" * 70000})
        assert e.value.code == "frame_too_large"
        d = c.check({"user": "ivy"})
        assert d.allowed and not d.degraded and d.remaining == 3


def _pool_of(c, n):
    """Fill c's pool with n open connections (as n concurrent checks would)."""
    import socket as s

    from rlsidecar.client import _Conn

    for _ in range(n):
        sock = s.socket(s.AF_UNIX, s.SOCK_STREAM)
        sock.connect(c.socket_path)
        conn = _Conn(sock)
        conn.served = True
        c._put(conn)
    assert len(c._idle) == n


def test_restart_every_pooled_connection_recovers(daemon):
    """After a daemon restart every idle pooled connection is closed; each check that takes
    one sends on a fresh connection instead (the daemon read nothing), and none is counted
    twice. Fail-closed: an unreachable answer would be a 503 on a login route."""
    with rlsidecar.Client(daemon.socket, timeout=2, pool_size=4, on_unavailable="closed") as c:
        _pool_of(c, 4)
        assert c.check({"user": "hank"}).remaining == 4
        daemon.stop()
        daemon.start()
        ds = [c.check({"user": "hank"}) for _ in range(6)]
        assert [(d.unreachable, d.cause) for d in ds] == [(False, None)] * 6
        assert [d.remaining for d in ds] == [4, 3, 2, 1, 0, 0] and not ds[-1].allowed  # a new daemon, fresh state
    # A batch on a stale connection, and a ping on another, recover the same way.
    with rlsidecar.Client(daemon.socket, timeout=2, pool_size=4, on_unavailable="closed") as c:
        _pool_of(c, 2)
        daemon.stop()
        daemon.start()
        assert [d.remaining for d in c.check_many([({"user": "ida"}, 1, None)] * 3)] == [4, 3, 2]
        c._idle.reverse()  # the last stale one on top
        assert c.ping()
        # Each stale one was closed and dropped; the two fresh ones are pooled.
        assert len(c._idle) == 2 and all(conn.sock.fileno() >= 0 for conn in c._idle)


class CutWhenFull:
    """A pooled socket standing in for the client's: at the first write the socket does
    not take whole it counts the frames taken whole (held) and calls cut(), once."""

    def __init__(self, sock, cut):
        self.sock, self.on_cut, self.cut, self.held = sock, cut, False, 0

    def send(self, data):
        n = self.sock.send(data)
        if n < len(data) and not self.cut:
            self.cut = True
            at = 0  # the frames the socket took whole
            while at + 4 <= n and at + 4 + struct.unpack(">I", data[at:at + 4])[0] <= n:
                at += 4 + struct.unpack(">I", data[at:at + 4])[0]
                self.held += 1
            self.on_cut()
        return n

    def __getattr__(self, name):
        return getattr(self.sock, name)


def test_batch_cut_by_a_kill_sends_again_what_the_socket_never_took(daemon):
    """A check_many batch larger than the socket takes, written to a frozen sidecar that is
    killed, and a successor started, just as the socket stops taking it: the rest of the
    write fails. The requests the socket held whole may have been read (the killed sidecar
    may have counted them): those answer by the policy. The ones it never took whole were
    not read: they are sent again, once, on a new connection to the successor, each
    counted once. Before, a failure after the batch's first write gave every request the
    policy (256 of 256 here, about 150 never written). The kill is timed by the socket's
    own short write, not by a sleep."""
    with rlsidecar.Client(daemon.socket, timeout=10, pool_size=1, on_unavailable="closed") as c:
        c.ping()
        (conn,) = c._idle
        daemon.pause()

        def kill_and_restart():  # the frozen daemon, its successor on the socket's path
            daemon.proc.kill()
            daemon.proc.wait()
            daemon.start()

        conn.sock = CutWhenFull(conn.sock, kill_and_restart)
        ds = c.check_many([({"user": "u%03d" % i, "path": "/" + "x" * 2000}, 1, None) for i in range(256)])
        if not conn.sock.cut:
            pytest.skip("the socket took the whole batch: nothing to cut")
        policy = [i for i, d in enumerate(ds) if d.unreachable]
        assert policy == list(range(conn.sock.held)), "%d of 256 answered by the policy (%s); the socket held %d" % (
            len(policy), ds[0].cause, conn.sock.held)
        for d in ds[len(policy):]:
            # Sent again once: the successor's first count of each user (5 a minute).
            assert d.allowed and d.rule == "per-user" and d.remaining == 4, (d.remaining, d.cause)
        assert c.check({"user": "u255"}).remaining == 3  # the client goes on


def _fill_fds_below_1024():
    """Open pipes until every descriptor below 1024 is taken (raising the soft
    RLIMIT_NOFILE if need be), so the next socket gets one >= 1024, as in a server process
    with many open; returns them, to close, and the limits to restore (the rest of the
    session runs under the limit it had)."""
    limits = resource.getrlimit(resource.RLIMIT_NOFILE)
    soft, hard = limits
    if soft < 2048:
        if hard != resource.RLIM_INFINITY and hard < 2048:
            pytest.skip("RLIMIT_NOFILE hard limit %d: no descriptor >= 1024" % hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (2048, hard))
    held = []
    try:
        while not held or held[-1] < 1023:
            held.extend(os.pipe())
    except BaseException:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, limits)
        raise
    return held, limits


def _daemon_end(pid, before):
    """A duplicate of the daemon's end of the one connection it accepted since before
    (its socket descriptors then, _socket_fds), taken with pidfd_getfd(2)."""
    (fd,) = [fd for ino, fd in _socket_fds(pid).items() if ino not in before]
    libc = ctypes.CDLL(None, use_errno=True)
    pidfd = os.pidfd_open(pid)
    try:
        got = libc.syscall(438, pidfd, fd, 0)  # SYS_pidfd_getfd (x86-64, arm64)
        if got < 0:
            pytest.skip("pidfd_getfd: %s" % os.strerror(ctypes.get_errno()))
        return socket.socket(fileno=got)
    finally:
        os.close(pidfd)


def _socket_fds(pid):
    """The daemon's socket descriptors: {"socket:[inode]": fd}."""
    out = {}
    for fd in os.listdir("/proc/%d/fd" % pid):
        try:
            target = os.readlink("/proc/%d/fd/%s" % (pid, fd))
        except OSError:
            continue
        if target.startswith("socket:"):
            out[target] = int(fd)
    return out


def test_batch_cut_on_a_connection_kept_open_is_sent_again_at_once_from_a_high_fd(make_daemon):
    """The client's socket is descriptor >= 1024 (a server process with many open). A
    check_many batch larger than the socket takes, written to a frozen sidecar whose read
    side is then shut, the connection kept open: what shutIdle does at --idle-timeout
    when a batch is written as it fires, awaitLeases then keeping the connection open
    while the checks it answered hold leases. The test shuts it itself, on a duplicate of
    the daemon's end (pidfd_getfd), which it keeps open, then lets the daemon run: the
    rest of the write fails (EPIPE), the daemon answers the requests the socket held
    whole, and sends nothing more. Those answers are read; the requests the socket never
    took are sent again at once on a new connection. Before, select() refused the
    descriptor (ValueError) and the socket was taken for readable: the client waited for
    an answer that never came until its timeout, and the 149 requests the daemon never
    read answered by the policy ("no connection within the timeout")."""
    d = make_daemon(RULES)
    held, limits = _fill_fds_below_1024()
    kept = []
    try:
        with rlsidecar.Client(d.socket, timeout=5, pool_size=1, on_unavailable="closed") as c:
            before = _socket_fds(d.proc.pid)
            c.ping()
            (conn,) = c._idle
            assert conn.sock.fileno() >= 1024
            theirs = _daemon_end(d.proc.pid, before)
            kept.append(theirs)
            d.pause()

            def shut_and_resume():  # the frozen daemon's read side, and it runs again
                theirs.shutdown(socket.SHUT_RD)
                d.resume()

            conn.sock = CutWhenFull(conn.sock, shut_and_resume)
            ds = c.check_many([({"user": "u%03d" % i, "path": "/" + "x" * 2000}, 1, None) for i in range(256)])
            if not conn.sock.cut:
                pytest.skip("the socket took the whole batch: nothing to cut")
            assert 0 < conn.sock.held < 256
            policy = [i for i, x in enumerate(ds) if x.unreachable]
            assert not policy, "%d of 256 answered by the policy (%s); the socket held %d" % (
                len(policy), ds[policy[0]].cause, conn.sock.held)
            for x in ds:  # each counted once: the first of each user's 5 a minute
                assert x.allowed and x.rule == "per-user" and x.remaining == 4, (x.remaining, x.cause)
    finally:
        for s in kept:
            s.close()
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, limits)


def test_idle_timeout_closes_pooled_connections(make_daemon):
    """serve --idle-timeout 300ms and a check every 500 ms: the daemon has closed the
    pooled connection before each check; every check still gets the daemon's answer."""
    d = make_daemon(RULES, ["--idle-timeout", "300ms"])
    with rlsidecar.Client(d.socket, timeout=2, on_unavailable="closed") as c:
        ds = []
        for _ in range(4):
            ds.append(c.check({"user": "jack"}))
            time.sleep(0.5)
        assert [(d.unreachable, d.remaining) for d in ds] == [(False, 4), (False, 3), (False, 2), (False, 1)]


class _FakeDaemon:
    """A sidecar on a temp socket answering checks with allowed, until `then` says what to
    do, once, with the request number `at` (counted over all connections): "close-unread"
    closes its connection once the request is waiting, unread; "close-read" reads it,
    then closes without answering (a daemon that died deciding)."""

    def __init__(self, path, at, then):
        import socket as s

        self.srv = s.socket(s.AF_UNIX, s.SOCK_STREAM)
        self.srv.bind(path)
        self.srv.listen(16)
        self.at, self.then = at, then
        self.read = []  # ids of the requests read, in order
        self.conns = 0
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        import select

        while True:
            try:
                c, _ = self.srv.accept()
            except OSError:
                return
            self.conns += 1
            threading.Thread(target=self._conn, args=(c, select), daemon=True).start()

    def _conn(self, c, select):
        from rlsidecar import _proto

        with c:
            while True:
                select.select([c], [], [])
                if len(self.read) + 1 == self.at and self.then == "close-unread":
                    self.then = None
                    time.sleep(0.05)  # the whole frame is in the socket's queue: closed unread
                    return
                head = c.recv(4, 0x100)  # MSG_WAITALL
                if len(head) < 4:
                    return
                req = _proto.decode(c.recv(_proto.frame_length(head), 0x100))
                self.read.append(req["id"])
                if len(self.read) == self.at and self.then == "close-read":
                    return
                if req.get("op") == "release":
                    c.sendall(_proto.encode({"id": req["id"], "released": True}))
                    continue
                c.sendall(_proto.encode({"id": req["id"], "allowed": True, "rule": "r", "limit": 9,
                                         "remaining": 9 - len(self.read)}))

    def close(self):
        self.srv.close()


def test_closed_unread_after_the_send_is_retried_once(short_tmp):
    """The daemon closes a pooled connection just as a check is sent (its idle timeout
    racing the request): the request arrived but was never read (the client's read gets
    ECONNRESET), so it is sent again on a fresh connection, and counted once."""
    fake = _FakeDaemon(os.path.join(short_tmp, "f.sock"), at=2, then="close-unread")
    try:
        with rlsidecar.Client(os.path.join(short_tmp, "f.sock"), timeout=2, on_unavailable="closed") as c:
            assert c.check({"user": "x"}).remaining == 8
            d = c.check({"user": "x"})
            assert d.allowed and not d.unreachable and d.remaining == 7
            assert fake.read == [1, 1] and fake.conns == 2  # id 1 on each connection; read once each
    finally:
        fake.close()


def test_closed_after_reading_is_not_retried(short_tmp):
    """A pooled connection closed after the daemon read the request, with no answer (it
    died deciding): the request may have counted, so it is not sent again; the check
    answers by the policy."""
    fake = _FakeDaemon(os.path.join(short_tmp, "f.sock"), at=2, then="close-read")
    try:
        with rlsidecar.Client(os.path.join(short_tmp, "f.sock"), timeout=2, on_unavailable="closed") as c:
            assert c.check({"user": "x"}).remaining == 8
            d = c.check({"user": "x"})
            assert not d.allowed and d.unreachable and "connection lost" in d.cause
            assert fake.read == [1, 2] and fake.conns == 1
            # Not a failed attempt: the connection had served; the next check dials at once.
            assert c.check({"user": "x"}).remaining == 6 and fake.conns == 2
    finally:
        fake.close()


def test_release_read_then_closed_is_sent_again(short_tmp):
    """A release the daemon read and then closed on without answering (it died, SIGKILL):
    a release is idempotent, so it is sent again, once, on a fresh connection, to whoever
    serves the socket (the successor frees a global lease the dead daemon may not have).
    Before, release() returned False and the slot stayed held until the lease expired;
    the Go, Node and asyncio clients already sent it again."""
    fake = _FakeDaemon(os.path.join(short_tmp, "f.sock"), at=2, then="close-read")
    try:
        with rlsidecar.Client(os.path.join(short_tmp, "f.sock"), timeout=2, on_unavailable="closed") as c:
            assert c.check({"user": "x"}).remaining == 8
            assert c.release("lease-token") is True
            assert fake.read == [1, 2, 1] and fake.conns == 2
    finally:
        fake.close()


def test_too_many_connections_backs_off(make_daemon, monkeypatch):
    """A connection the daemon refuses as it accepts it (too_many_connections, at
    --max-conns) is a failed dial: the client backs off, and the checks meanwhile are
    decided by the policy at once, without dialing, as the asyncio, Go and Node clients
    do. Before, every check dialed the daemon at its cap again."""
    import socket
    # The first backoff is 5 to 10 ms: a loaded machine may pause this test that long
    # between the two checks below. Half a second at least here.
    monkeypatch.setattr(rlsidecar.client, "BACKOFF_MIN", 1.0)
    d = make_daemon(RULES, args=["--max-conns", "1"])
    holder = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    holder.connect(d.socket)
    try:
        import time
        deadline = time.monotonic() + 5
        with rlsidecar.Client(d.socket, timeout=2) as c:
            while True:  # the daemon counts the holder once it has accepted it
                first = c.check({"user": "ann"})
                if first.unreachable and "too_many_connections" in first.cause:
                    break
                assert time.monotonic() < deadline, first
                time.sleep(0.01)
            second = c.check({"user": "ann"})
            assert second.unreachable and second.cause.startswith("backing off"), second.cause
    finally:
        holder.close()


def test_refused_at_max_conns_goes_on_the_pools_live_connection(make_daemon):
    """The daemon refuses a connection past its --max-conns as it accepts it
    (too_many_connections), reading none of it: a check refused so was not decided. While
    another thread's connection of the pool is served, the check goes on that one once it
    is put back (after a pause, at most pool_size times), not to the policy. Before, each
    refused check answered by the policy at once: here, with the daemon's second place
    taken, two threads checking in step got about one policy answer a round."""
    import socket
    d = make_daemon(RULES, args=["--max-conns", "2"])
    holder = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    holder.connect(d.socket)
    try:
        with rlsidecar.Client(d.socket, timeout=5, pool_size=2, on_unavailable="closed") as c:
            c.check({"user": "warm"})  # once this is answered, the daemon has counted the holder too
            rounds = 20
            barrier = threading.Barrier(2)
            causes, remaining, errors = [], [], []

            def run(t):
                try:
                    for i in range(rounds):
                        barrier.wait(10)
                        dec = c.check({"user": "t%d-%d" % (t, i)})
                        if dec.unreachable:
                            causes.append(dec.cause)
                        else:
                            remaining.append(dec.remaining)
                except BaseException as e:
                    errors.append(e)

            ts = [threading.Thread(target=run, args=(t,)) for t in range(2)]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            assert not errors, errors
            assert causes == [], "%d of %d checks answered by the policy: %s" % (len(causes), 2 * rounds, causes[:1])
            assert remaining == [4] * (2 * rounds)  # each counted once
    finally:
        holder.close()
