"""A client used before fork() (gunicorn --preload, uWSGI, multiprocessing), then by the
forked workers: each process must get its own answers. Before, the children inherited
the pooled connection and its request ids, and read each other's answers (1 to 4
mismatches in 3,000 checks a worker, in 7 of 13 runs of an audit's script)."""

import asyncio
import os

import pytest

import rlsidecar

WORKERS = 4
CHECKS = 400


def _worker(check, w, out):
    """Each check names its own inline limit: its answer must name it back."""
    bad = unreachable = 0
    for i in range(CHECKS):
        n = "f%d_%d" % (w, i)
        d = check({"tenant": n}, [{"key": n, "limit": 100, "window_ms": 60000, "name": n}])
        if d.unreachable:
            unreachable += 1
        elif d.rule != n:
            bad += 1
        if bad or unreachable:
            break  # failed: no need to wait out more timeouts
    os.write(out, b"%d %d\n" % (bad, unreachable))


def _run_workers(target):
    r, w = os.pipe()
    kids = []
    for i in range(WORKERS):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.close(r)
                target(i, w)
                code = 0
            finally:
                os._exit(code)
        kids.append(pid)
    os.close(w)
    for pid in kids:
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    with os.fdopen(r) as f:
        rows = [tuple(map(int, line.split())) for line in f]
    assert len(rows) == WORKERS
    return rows


@pytest.mark.skipif(not hasattr(os, "register_at_fork"), reason="no fork hooks")
def test_forked_workers_get_their_own_answers(daemon):
    c = rlsidecar.Client(daemon.socket, timeout=1)
    assert c.check({"user": "warm"}).allowed  # the parent's connection is pooled now
    rows = _run_workers(lambda w, out: _worker(lambda a, lim: c.check(a, limits=lim), w, out))
    assert rows == [(0, 0)] * WORKERS, "(mismatched, unreachable) per worker"
    # The parent's own connection still answers it.
    assert c.check({"user": "warm"}).allowed
    c.close()


@pytest.mark.skipif(not hasattr(os, "register_at_fork"), reason="no fork hooks")
def test_forked_workers_async(daemon):
    c = rlsidecar.AsyncClient(daemon.socket, timeout=1)

    async def warm():
        return (await c.check({"user": "warm"})).allowed

    loop = asyncio.new_event_loop()
    assert loop.run_until_complete(warm())

    def work(w, out):
        async def run():
            bad = unreachable = 0
            for i in range(CHECKS):
                n = "a%d_%d" % (w, i)
                d = await c.check({"tenant": n}, limits=[{"key": n, "limit": 100, "window_ms": 60000, "name": n}])
                if d.unreachable:
                    unreachable += 1
                elif d.rule != n:
                    bad += 1
                if bad or unreachable:
                    break
            os.write(out, b"%d %d\n" % (bad, unreachable))
        asyncio.new_event_loop().run_until_complete(run())

    rows = _run_workers(work)
    assert rows == [(0, 0)] * WORKERS, "(mismatched, unreachable) per worker"
    assert loop.run_until_complete(warm())
    loop.run_until_complete(c.close())
    loop.close()
