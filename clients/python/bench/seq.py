"""Sequential checks through the Python client, driven by bench/clients_test.go.

    seq.py SOCKET KEYFILE

KEYFILE holds one user per line (the benchmark's Zipf sequence). For each line "N" read
on stdin, it makes N checks one after another (attrs ip, method, path, user, cycling
through the keys) and prints the elapsed nanoseconds and the CPU nanoseconds (user +
system) this process spent on them. A check that is not a real answer
from the sidecar (unreachable, degraded, rejected) aborts with exit status 1.
"""

import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import rlsidecar  # noqa: E402


def main():
    socket_path, keyfile = sys.argv[1], sys.argv[2]
    with open(keyfile) as f:
        attrs = [{"ip": "10.1.%d.%d" % (i // 250 % 250, i % 250), "method": "POST",
                  "path": "/v1/events/%s/holds" % u, "user": "user-" + u}
                 for i, u in enumerate(f.read().split())]
    client = rlsidecar.Client(socket_path, timeout=5)
    i = 0
    for line in sys.stdin:
        n = int(line)
        check = client.check
        start, cpu = time.perf_counter_ns(), time.process_time_ns()
        for _ in range(n):
            d = check(attrs[i])
            if not d.allowed or d.degraded:
                print("bad decision: %r" % (d,), file=sys.stderr)
                sys.exit(1)
            i += 1
            if i == len(attrs):
                i = 0
        print(time.perf_counter_ns() - start, time.process_time_ns() - cpu, flush=True)
    client.close()


main()
