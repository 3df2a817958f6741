"""Concurrency leases through the blocking client, against the real daemon."""

import threading

import rlsidecar

RULES = """
rules:
  - name: exports
    key: user
    concurrency: { max: 2, lease: 30s }
"""


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
