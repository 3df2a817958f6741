"""A sidecar killed (SIGKILL) while AsyncClient's releases of global leases were written to
it and not yet answered: they go to its successor, which frees the slots in Redis."""

import asyncio
import os
import shutil
import subprocess
import time

import pytest

import rlsidecar
from rlsidecar import _proto

RULES = """
rules:
  - name: exports
    key: user
    concurrency: { max: 3, lease: 1h }
    mode: global
"""


def unread_on(sock):
    """The bytes the connections accepted on the Unix socket path hold unread (ss's Recv-Q)."""
    out = subprocess.run(["ss", "-xHn", "state", "established"], capture_output=True, text=True, check=True).stdout
    total = 0
    for line in out.splitlines():
        f = line.split()
        if len(f) >= 4 and f[3] == sock:
            total += int(f[1])
    return total


@pytest.mark.skipif(shutil.which("redis-server") is None or shutil.which("ss") is None,
                    reason="needs redis-server and ss")
def test_releases_pending_on_a_killed_sidecar_go_to_its_successor(make_daemon, short_tmp):
    redis_sock = os.path.join(short_tmp, "r.sock")
    redis = subprocess.Popen(["redis-server", "--port", "0", "--unixsocket", redis_sock, "--save", "",
                              "--appendonly", "no"], stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while not os.path.exists(redis_sock):
            assert time.monotonic() < deadline, "redis-server did not start in 10 s"
            time.sleep(0.01)
        args = ["--redis", "unix://" + redis_sock, "--global-timeout", "2s", "--redis-timeout", "1s"]
        blue = make_daemon(RULES, args)

        async def run():
            c = rlsidecar.AsyncClient(blue.socket, timeout=60)
            try:
                leases = []
                for i in range(3):
                    d = await c.check({"user": "ann"})
                    assert d.allowed and not d.degraded and d.lease, (i, d)
                    leases.append(d.lease)
                # Blue/green: green takes the socket's path; blue, frozen, is then killed
                # with the releases of the gateway's ended requests unread in its socket.
                green = make_daemon(RULES, args)
                os.rename(green.socket, blue.socket)
                blue.pause()
                size = sum(len(_proto.frame(_proto.body(_proto.lease_message(0, "release", l, None)), 1))
                           for l in leases)
                tasks = [asyncio.ensure_future(c.release(l)) for l in leases]
                deadline = time.monotonic() + 30
                while unread_on(blue.socket) < size:
                    assert time.monotonic() < deadline, "the releases did not reach the frozen daemon's socket"
                    await asyncio.sleep(0.01)
                blue.proc.kill()
                blue.proc.wait()
                assert await asyncio.gather(*tasks) == [True, True, True]
                for i in range(3):
                    d = await c.check({"user": "ann"})
                    assert d.allowed and not d.degraded, ("slots held with no request", i, d)
            finally:
                await c.close()

        asyncio.run(run())
    finally:
        redis.kill()
        redis.wait()
