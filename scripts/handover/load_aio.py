"""The Python clients' share of scripts/handover's load: SOCKET, CLIENT (its key), MAX (the
concurrency rule's max); KIND=aio (AsyncClient) or blocking (Client, in threads). Stops
when its stdin ends, then prints one line of JSON."""

import asyncio
import json
import os
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "clients", "python"))
import rlsidecar  # noqa: E402

SOCK, NAME, MAX = os.environ["SOCKET"], os.environ["CLIENT"], int(os.environ["MAX"])
TIMEOUT = float(os.environ.get("TIMEOUT", "1"))
n = dict(checks=0, policy=0, errors=0, hyb=0, hybDegraded=0, glob=0, globDegraded=0, leases=0, lost=0,
         relFails=0, maxInflight=0)
inflight = [0]
lock = threading.Lock()
stopped = threading.Event()


def count(k, v=1):
    with lock:
        n[k] += v


def seen(d):
    count("checks")
    if d is None:
        count("errors")
        return None
    if d.unreachable:
        count("policy")
        return None
    return d


def took(d):
    count("leases")
    with lock:
        inflight[0] += 1
        if inflight[0] > MAX:
            n["lost"] += 1
        n["maxInflight"] = max(n["maxInflight"], inflight[0])


def ended():
    with lock:
        inflight[0] -= 1


def blocking():
    c = rlsidecar.Client(SOCK, timeout=TIMEOUT, pool_size=2 * MAX + 4)

    def safe(attrs):
        try:
            return seen(c.check(attrs))
        except Exception:
            return seen(None)

    def loop(pause, f):
        i = 0
        while not stopped.is_set():
            f(i)
            i += 1
            time.sleep(pause)

    def kind(k):
        def f(_):
            d = safe({"client": NAME, "kind": k})
            if d and d.allowed:
                count(k + "Degraded" if d.degraded else k)
        return f

    def lease(_):
        d = safe({"client": NAME, "kind": "lease"})
        if not d or not d.allowed or not d.lease:
            return
        took(d)
        time.sleep(0.02)
        ended()
        try:
            ok = c.release(d.lease)
        except Exception:
            ok = False
        if not ok:
            count("relFails")

    fs = [lambda i: safe({"client": NAME, "kind": "rate", "u": str(i % 1000)}), kind("hyb"), kind("glob")]
    ts = [threading.Thread(target=loop, args=(0.002, f)) for f in fs]
    ts += [threading.Thread(target=loop, args=(0.005, lease)) for _ in range(2 * MAX)]
    for t in ts:
        t.start()
    sys.stdin.read()
    stopped.set()
    for t in ts:
        t.join()
    probe = []
    for _ in range(MAX + 1):
        d = c.check({"client": NAME, "kind": "lease"})
        if d.allowed and not d.degraded and not d.unreachable:
            probe.append(d.lease)
    for l in probe:
        c.release(l)
    c.close()
    n["free"] = len(probe)


async def aio():
    c = rlsidecar.AsyncClient(SOCK, timeout=TIMEOUT)
    loop_ = asyncio.get_running_loop()
    stop = asyncio.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), loop_.call_soon_threadsafe(stop.set)), daemon=True).start()

    async def safe(attrs):
        try:
            return seen(await c.check(attrs))
        except Exception:
            return seen(None)

    async def loop(pause, f):
        i = 0
        while not stop.is_set():
            await f(i)
            i += 1
            await asyncio.sleep(pause)

    def kind(k):
        async def f(_):
            d = await safe({"client": NAME, "kind": k})
            if d and d.allowed:
                count(k + "Degraded" if d.degraded else k)
        return f

    async def lease(_):
        d = await safe({"client": NAME, "kind": "lease"})
        if not d or not d.allowed or not d.lease:
            return
        took(d)
        await asyncio.sleep(0.02)
        ended()
        try:
            ok = await c.release(d.lease)
        except Exception:
            ok = False
        if not ok:
            count("relFails")

    async def rate(i):
        await safe({"client": NAME, "kind": "rate", "u": str(i % 1000)})

    await asyncio.gather(loop(0.001, rate), loop(0.002, kind("hyb")), loop(0.002, kind("glob")),
                         *[loop(0.005, lease) for _ in range(2 * MAX)])
    probe = []
    for _ in range(MAX + 1):
        d = await c.check({"client": NAME, "kind": "lease"})
        if d.allowed and not d.degraded and not d.unreachable:
            probe.append(d.lease)
    for l in probe:
        await c.release(l)
    await c.close()
    n["free"] = len(probe)


if os.environ.get("KIND") == "blocking":
    blocking()
else:
    asyncio.run(aio())
print(json.dumps(n))
