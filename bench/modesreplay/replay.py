#!/usr/bin/python3
"""Differential replay of the three modes: one daemon each (local, hybrid, global), the
same rules but for the mode, the same randomized checks sent to all three a few ms apart,
answers compared field by field with the local mode's (the exact answer on one daemon).

    scripts/modes-replay [SEED [STEPS]]

The wrapper builds the daemon and starts a redis-server on a free loopback port; this
script takes the binary, the port and a work directory from the environment
(RLSIDECAR_BIN, REDIS_PORT, WORKDIR). It prints how many steps differ per mode, how
many of them in the decision itself, then each differing step. Times (reset_ms,
retry_after_ms) are compared within the checks' spread plus 40 ms.
"""
import json, os, random, socket, struct, subprocess, sys, time

import msgpack

BIN = os.environ["RLSIDECAR_BIN"]
PORT = os.environ["REDIS_PORT"]
WORK = os.environ["WORKDIR"]
MODES = ["local", "hybrid", "global"]

RULES = """rules:
  - name: tb-user
    key: user
    algorithm: token_bucket
    limit: { requests: 5, per: 2s, burst: 8 }
    mode: {MODE}
  - name: sw-user
    match: { path: "/api/**" }
    key: user
    algorithm: sliding_window
    limit: { requests: 6, per: 3s }
    mode: {MODE}
  - name: fw-key
    key: api_key
    algorithm: fixed_window
    limit: { requests: 7, per: 2s }
    mode: {MODE}
  - name: shadow-ip
    key: ip
    algorithm: token_bucket
    limit: { requests: 3, per: 5s }
    shadow: true
    mode: {MODE}
  - name: post-ip
    match: { method: POST }
    key: ip
    algorithm: sliding_window
    limit: { requests: 4, per: 1s }
    mode: {MODE}
"""


class Conn:
    def __init__(self, path):
        self.s = socket.socket(socket.AF_UNIX)
        self.s.connect(path)
        self.id = 0

    def check(self, attrs, cost, limits):
        self.id += 1
        m = {"id": self.id, "op": "check", "attrs": attrs, "cost": cost}
        if limits:
            m["limits"] = limits
        b = msgpack.packb(m, use_bin_type=True)
        self.s.sendall(struct.pack(">I", len(b)) + b)
        n = struct.unpack(">I", self._read(4))[0]
        return msgpack.unpackb(self._read(n), raw=False)

    def _read(self, n):
        b = b""
        while len(b) < n:
            c = self.s.recv(n - len(b))
            if not c:
                raise EOFError("the daemon closed the connection")
            b += c
        return b


def start(mode, tag):
    rules = os.path.join(WORK, f"{mode}.yaml")
    with open(rules, "w") as f:
        f.write(RULES.replace("{MODE}", mode))
    sock = os.path.join(WORK, f"{mode}.sock")
    args = [BIN, "serve", "--config", rules, "--socket", sock, "--admin", ""]
    if mode != "local":
        db = {"hybrid": 1, "global": 2}[mode]
        # Generous timeouts: a busy machine must not turn answers into policy decisions.
        args += ["--redis", f"redis://127.0.0.1:{PORT}/{db}", "--redis-prefix", f"r{tag}{mode}:",
                 "--global-timeout", "500ms", "--redis-timeout", "500ms"]
    p = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=open(os.path.join(WORK, f"{mode}.log"), "w"))
    for _ in range(200):
        try:
            return p, Conn(sock)
        except OSError:
            time.sleep(0.05)
    raise SystemExit(f"the {mode} daemon did not start (see {WORK}/{mode}.log)")


def compare(a, b, spread):
    diffs = []
    tol = 40 + spread
    for k in ("allowed", "rule", "limit", "remaining", "degraded", "reason", "banned", "warning", "delay_ms"):
        if a.get(k) != b.get(k):
            diffs.append((k, a.get(k), b.get(k)))
    for k in ("reset_ms", "retry_after_ms"):
        if abs(a.get(k, 0) - b.get(k, 0)) > tol:
            diffs.append((k, a.get(k), b.get(k)))
    ra, rb = a.get("rules", []), b.get("rules", [])
    if len(ra) != len(rb):
        return diffs + [("rules", len(ra), len(rb))]
    for x, y in zip(ra, rb):
        for k in ("name", "limit", "window_ms", "remaining", "allowed", "shadow", "reason", "unasked"):
            if x.get(k) != y.get(k):
                diffs.append((f"{x.get('name')}.{k}", x.get(k), y.get(k)))
        for k in ("reset_ms", "retry_after_ms"):
            if abs(x.get(k, 0) - y.get(k, 0)) > tol:
                diffs.append((f"{x.get('name')}.{k}", x.get(k), y.get(k)))
    return diffs


def main():
    seed = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 220
    tag = str(int(time.time()))
    daemons = {m: start(m, tag) for m in MODES}
    rnd = random.Random(seed)
    users = ["u1", "u2", "u3"]
    log = []
    try:
        for step in range(steps):
            user = rnd.choice(users)
            api, ip = rnd.choice(["k1", "k2"]), rnd.choice(["10.0.0.1", "10.0.0.2"])
            attrs = {"user": user, "api_key": api, "ip": ip, "method": rnd.choice(["GET", "POST"]),
                     "path": rnd.choice(["/api/a", "/api/b/c", "/other"])}
            if rnd.random() < 0.1:
                del attrs["user"]
            cost = rnd.choices([0, 1, 3], [0.15, 0.65, 0.2])[0]
            idx = rnd.sample(range(3), rnd.choices([0, 1, 2], [0.5, 0.3, 0.2])[0])
            order = MODES[:]
            rnd.shuffle(order)  # no mode always first
            who = attrs.get("user", "nouser")
            inline = [dict(key="i-" + who, limit=4, window_ms=2500, algorithm="token_bucket", burst=6, name="inl-tb"),
                      dict(key="i-" + who, limit=5, window_ms=2000, algorithm="fixed_window", name="inl-fw"),
                      dict(key="i-" + api, limit=5, window_ms=1500, algorithm="sliding_window", name="inl-sw")]
            ans, at = {}, {}
            for m in order:
                limits = [dict(inline[i], mode=m) for i in idx]
                at[m] = time.time()
                ans[m] = daemons[m][1].check(attrs, cost, limits)
            spread = int((max(at.values()) - min(at.values())) * 1000) + 1
            rec = {"step": step, "attrs": attrs, "cost": cost, "inline": idx, "spread_ms": spread, "answers": ans}
            for m in ("hybrid", "global"):
                d = compare(ans["local"], ans[m], spread)
                if d:
                    rec.setdefault("diffs", {})[m] = d
            log.append(rec)
            time.sleep(rnd.choice([0, 0, 0, 0.01, 0.03, 0.08, 0.15, 0.3]))
    finally:
        for p, _ in daemons.values():
            p.terminate()
            p.wait()
    with open(os.path.join(WORK, f"replay-{seed}.json"), "w") as f:
        json.dump(log, f, indent=1)
    for m in ("hybrid", "global"):
        steps_diff = sum(1 for r in log if m in r.get("diffs", {}))
        decisions = sum(1 for r in log if any(k == "allowed" for k, _, _ in r.get("diffs", {}).get(m, [])))
        print(f"{m}: {steps_diff} of {len(log)} steps answer other than the local mode; the decision in {decisions}")
    for r in log:
        for m, d in r.get("diffs", {}).items():
            print(r["step"], r["cost"], r["attrs"].get("user"), r["attrs"]["method"], r["attrs"]["path"],
                  "inline", r["inline"], m, d)


if __name__ == "__main__":
    main()
