"""Wire-protocol conformance of the real daemon, written from shared/PROTOCOL.md (and the
README's rules format) alone: a raw Unix-socket client and python3-msgpack, none of the
project's clients or its proto package, so that their assumptions cannot hide a mismatch.

Every answer's fields are checked against the contract: framing edge cases, every field
with every wrong msgpack type, the id in every integer encoding, each op, the deciding
rule, all-or-nothing, cost 0 / above capacity / huge, inline limits, leases, and
pipelining. Run by scripts/test-clients (Debian's /usr/bin/python3 and python3-pytest):

    /usr/bin/python3 -m pytest -q -p no:cacheprovider proto/conformance

The daemon is $RLSIDECAR_BIN, or built from this checkout, in local mode (no Redis).
$RLSIDECAR_CONFORMANCE_ARGS adds flags to `serve`, to hold another configuration to the
same contract, e.g. a running redis-server (or `--redis-cluster HOST:PORT,...`):

    RLSIDECAR_CONFORMANCE_ARGS="--redis redis://127.0.0.1:6379" \
        RLSIDECAR_CONFORMANCE_MODE=global \
        /usr/bin/python3 -m pytest -q -p no:cacheprovider proto/conformance

$RLSIDECAR_CONFORMANCE_MODE (local, hybrid or global) names the mode every rule is decided
in: each rule of RULES gets `mode:` it, and in global mode each inline limit that names no
mode gets `"mode": "global"` on the wire (see Conn.send). Unset, rules and inline limits
name no mode and take the daemon's default: local without Redis, hybrid with it (so
`RLSIDECAR_CONFORMANCE_MODE=hybrid` makes the rules say so and leaves the inline limits to
that default). scripts/test-clients runs the suite in local mode, and in global and hybrid
mode against a standalone redis-server and a 3-master Redis Cluster.
"""

import os
import shlex
import shutil
import signal
import socket
import string
import struct
import subprocess
import tempfile
import threading
import time
import uuid

import msgpack
import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
MAX_FRAME = 65536
EXTRA_ARGS = shlex.split(os.environ.get("RLSIDECAR_CONFORMANCE_ARGS", ""))
WITH_REDIS = any(a.lstrip("-").split("=")[0] in ("redis", "redis-cluster") for a in EXTRA_ARGS)
MODE = os.environ.get("RLSIDECAR_CONFORMANCE_MODE", "")
assert MODE in ("", "local", "hybrid", "global"), "RLSIDECAR_CONFORMANCE_MODE: local, hybrid or global, not %r" % MODE
assert WITH_REDIS or MODE in ("", "local"), "RLSIDECAR_CONFORMANCE_MODE=%s needs --redis or --redis-cluster" % MODE

RULES = """
rules:
  - name: per-user
    match: { path: "/api/**" }
    key: user
    limit: { requests: 10, per: 60s }
  - name: per-ip
    match: { path: "/api/**" }
    key: ip
    limit: { requests: 5, per: 60s }
  - name: shadowy
    match: { path: "/api/**" }
    key: user
    limit: { requests: 2, per: 60s }
    shadow: true
  - name: slow
    match: { path: "/slow" }
    key: user
    limit: { requests: 1, per: 1h }
  - name: fast
    match: { path: "/slow" }
    key: ip
    limit: { requests: 1, per: 1m }
  - name: exports
    match: { path: "/exports/**" }
    key: user
    concurrency: { max: 2, lease: 1s }
"""
if MODE:
    RULES = RULES.replace("\n  - name: ", "\n  - mode: %s\n    name: " % MODE)

CHECK_FIELDS = {"id": int, "allowed": bool, "rule": str, "limit": int, "remaining": int,
                "reset_ms": int, "retry_after_ms": int, "degraded": bool, "rules": list}
RULE_FIELDS = {"name": str, "limit": int, "window_ms": int, "remaining": int, "reset_ms": int,
               "retry_after_ms": int, "allowed": bool, "shadow": bool}
ERROR_CODES = {"bad_request", "unknown_op", "invalid_limit", "frame_too_large", "internal"}


@pytest.fixture(scope="module")
def binary():
    path = os.environ.get("RLSIDECAR_BIN")
    if path:
        yield path
        return
    d = tempfile.mkdtemp(prefix="rls-conf-bin")
    path = os.path.join(d, "rlsidecar")
    subprocess.run(["go", "build", "-o", path, "./cmd/rlsidecar"], cwd=ROOT, check=True)
    yield path
    shutil.rmtree(d, ignore_errors=True)


class Daemon:
    """`rlsidecar serve` on a temp socket with RULES."""

    def __init__(self, binary):
        self.dir = tempfile.mkdtemp(prefix="rls-conf")
        self.socket = os.path.join(self.dir, "s.sock")
        rules = os.path.join(self.dir, "rules.yaml")
        with open(rules, "w") as f:
            f.write(RULES)
        self.proc = subprocess.Popen([binary, "serve", "--socket", self.socket, "--admin=", "--config", rules] + EXTRA_ARGS,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = []
        t = threading.Thread(target=lambda: line.append(self.proc.stdout.readline()))
        t.start()
        t.join(10)
        if not line or "listening on" not in line[0]:
            self.proc.kill()
            raise RuntimeError("daemon did not start: %r %s" % (line, self.proc.stderr.read()))
        for stream in (self.proc.stdout, self.proc.stderr):
            threading.Thread(target=stream.read, daemon=True).start()

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="module")
def daemon(binary):
    d = Daemon(binary)
    yield d
    d.stop()


class Conn:
    """One connection speaking frames: a 4-byte big-endian length, then one msgpack value."""

    def __init__(self, path):
        self.s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.s.settimeout(10)
        self.s.connect(path)

    def close(self):
        self.s.close()

    def send_body(self, body):
        self.s.sendall(struct.pack(">I", len(body)) + body)

    def send(self, obj):
        if MODE == "global":
            obj = with_mode(obj)
        self.send_body(msgpack.packb(obj, use_bin_type=True))

    def _read(self, n):
        b = b""
        while len(b) < n:
            c = self.s.recv(n - len(b))
            if not c:
                raise EOFError("connection closed after %d of %d bytes" % (len(b), n))
            b += c
        return b

    def recv(self):
        n = struct.unpack(">I", self._read(4))[0]
        v = msgpack.unpackb(self._read(n), raw=False)
        assert isinstance(v, dict) and all(isinstance(k, str) for k in v), v
        return v

    def rt(self, obj):
        self.send(obj)
        return self.recv()

    def rt_body(self, body):
        self.send_body(body)
        return self.recv()

    def closed(self, timeout=5):
        """True when the server closed the connection (EOF or reset) within timeout."""
        self.s.settimeout(timeout)
        try:
            while True:
                if self.s.recv(4096) == b"":
                    return True
        except socket.timeout:
            return False
        except ConnectionResetError:
            return True
        finally:
            self.s.settimeout(10)


@pytest.fixture
def conn(daemon):
    c = Conn(daemon.socket)
    yield c
    c.close()


def with_mode(req):
    """req with "mode": MODE in each inline limit (a map) that has no "mode" field: global mode
    is no daemon's default, so an inline limit is decided in it only when it says so. Limits
    that name a mode, and anything that is not a well-formed list of maps, are sent as they
    are (the wrong-type and invalid-limit cases stay what they were written as)."""
    if not isinstance(req, dict) or not isinstance(req.get("limits"), list):
        return req
    lims = [dict(lim, mode=MODE) if isinstance(lim, dict) and "mode" not in lim else lim for lim in req["limits"]]
    return dict(req, limits=lims)


def uniq(prefix="k"):
    return "%s-%s" % (prefix, uuid.uuid4().hex[:12])


def in_one_window(window_ms, run, attempts=3):
    """run() until it ran within one fixed window of window_ms (at most attempts times);
    returns what its last run returned. A fixed window is aligned to a multiple of its
    length on the wall clock (the daemon's, which is this one): counts taken across a
    boundary start again, so a sequence that a boundary fell within is run again (run
    takes fresh keys each time); the test asserts on what it returns, after it."""
    for _ in range(attempts):
        w = int((time.time() * 1000 - 2) // window_ms)
        got = run()
        if int((time.time() * 1000 + 2) // window_ms) == w:
            break
    return got


def api(**attrs):
    return dict({"path": "/api/x"}, **attrs)


def assert_check(r, rid):
    """Every field PROTOCOL.md gives a check answer, with its type."""
    assert "error" not in r, r
    for f, t in CHECK_FIELDS.items():
        assert f in r, (f, r)
        assert isinstance(r[f], t) and not (t is int and isinstance(r[f], bool)), (f, r)
    assert r["id"] == rid
    assert not r["degraded"], r  # a healthy store (or none needed): never a failure policy
    for e in r["rules"]:
        for f, t in RULE_FIELDS.items():
            assert f in e and isinstance(e[f], t), (f, e)
    if r["allowed"]:
        assert r["retry_after_ms"] == 0, r
    deciding = [e for e in r["rules"] if not e["shadow"]]
    if not deciding:
        assert r["rule"] == "", r
    else:
        d = next(e for e in r["rules"] if e["name"] == r["rule"] and not e["shadow"])
        assert (r["limit"], r["remaining"], r["reset_ms"], r["retry_after_ms"]) == \
            (d["limit"], d["remaining"], d["reset_ms"], d["retry_after_ms"]), r
        if r["allowed"]:
            assert d["remaining"] == min(e["remaining"] for e in deciding), r
        else:
            refusing = [e for e in deciding if not e["allowed"]]
            assert not d["allowed"] and d["retry_after_ms"] == max(e["retry_after_ms"] for e in refusing) \
                or d.get("reason") == "cost_exceeds_capacity", r
    return r


def assert_error(r, code, rid=0):
    assert set(r) == {"id", "error"}, r
    assert r["id"] == rid, r
    assert r["error"]["code"] == code, r
    assert code in ERROR_CODES
    assert isinstance(r["error"]["message"], str) and len(r["error"]["message"]) > 10, r


def remaining(conn, attrs):
    """Each matched rule's remaining, asked with cost 0 (nothing consumed)."""
    r = assert_check(conn.rt({"op": "check", "id": 1, "attrs": attrs, "cost": 0}), 1)
    return {e["name"]: e["remaining"] for e in r["rules"]}


# -- framing ---------------------------------------------------------------------------

def raw_map(pairs):
    """A msgpack map with the pairs in this order (repeats allowed)."""
    b = bytes([0x80 | len(pairs)]) if len(pairs) < 16 else b"\xde" + struct.pack(">H", len(pairs))
    for k, v in pairs:
        b += msgpack.packb(k) + msgpack.packb(v, use_bin_type=True)
    return b


@pytest.mark.parametrize("name,body,rid", [
    ("empty frame", b"", 0),
    ("nil", b"\xc0", 0),
    ("array", msgpack.packb([1, 2]), 0),
    ("int", msgpack.packb(7), 0),
    ("string", msgpack.packb("ping"), 0),
    ("reserved byte", b"\xc1", 0),
    ("integer map key", b"\x81\x01\xa4ping", 0),
    ("empty map: no op", b"\x80", 0),
    ("truncated map", b"\x82\xa2id\x09", 9),
    ("trailing bytes", msgpack.packb({"op": "ping", "id": 8}) + b"\xc0", 8),
    ("array claiming 4G items", b"\x83\xa2id\x0c\xa2op\xa4ping\xa1z\xdd\xff\xff\xff\xff", 12),
    ("str claiming 4 GB", b"\x83\xa2id\x0d\xa2op\xa4ping\xa1z\xdb\xff\xff\xff\xff", 13),
    ("array nested 5,000 deep", b"\x83\xa2id\x0a\xa2op\xa4ping\xa1z" + b"\x91" * 5000 + b"\xc0", 10),
    ("map nested 5,000 deep", b"\x83\xa2id\x0b\xa2op\xa4ping\xa1z" + b"\x81\xa1a" * 5000 + b"\xc0", 11),
    ("id twice", raw_map([("id", 1), ("id", 2), ("op", "ping")]), 1),
    ("op twice", raw_map([("id", 3), ("op", "frob"), ("op", "ping")]), 3),
    ("attrs twice", raw_map([("id", 4), ("op", "check"), ("attrs", {"user": "a"}), ("attrs", {"ip": "b"})]), 4),
])
def test_malformed_body_is_bad_request_and_connection_stays(conn, name, body, rid):
    assert_error(conn.rt_body(body), "bad_request", rid)
    assert conn.rt({"op": "ping", "id": 77})["id"] == 77


def test_max_frame_exactly_is_served(conn):
    pad = "x" * (MAX_FRAME - 40)
    body = msgpack.packb({"op": "ping", "id": 5, "pad": pad})
    body = msgpack.packb({"op": "ping", "id": 5, "pad": pad + "x" * (MAX_FRAME - len(body))})
    assert len(body) == MAX_FRAME
    r = conn.rt_body(body)
    assert r == {"id": 5, "version": r["version"], "protocol": 1}


@pytest.mark.parametrize("length", [MAX_FRAME + 1, 0xFFFFFFFF])
def test_frame_too_large_answers_then_closes(conn, length):
    conn.rt({"op": "ping", "id": 1})
    conn.s.sendall(struct.pack(">I", length) + b"\x80" * 100)
    assert_error(conn.recv(), "frame_too_large", 0)
    assert conn.closed()


def test_answers_before_a_too_large_frame_are_delivered(conn):
    conn.s.sendall(b"".join(struct.pack(">I", len(b)) + b for b in
                            (msgpack.packb({"op": "ping", "id": i}) for i in range(1, 6)))
                   + struct.pack(">I", MAX_FRAME + 1) + b"x" * 100)
    assert [conn.recv()["id"] for _ in range(5)] == [1, 2, 3, 4, 5]
    assert_error(conn.recv(), "frame_too_large", 0)
    assert conn.closed()


def test_frame_split_into_single_bytes(conn):
    body = msgpack.packb({"op": "ping", "id": 101})
    for b in struct.pack(">I", len(body)) + body:
        conn.s.send(bytes([b]))
        time.sleep(0.001)
    assert conn.recv()["id"] == 101


def test_frames_in_one_write_then_garbage(conn):
    frames = b"".join(struct.pack(">I", len(b)) + b for b in
                      (msgpack.packb({"op": "ping", "id": i}) for i in range(200, 210)))
    conn.s.sendall(frames + b"\x00\x00\x00\x03abc")
    assert [conn.recv()["id"] for _ in range(10)] == list(range(200, 210))
    assert_error(conn.recv(), "bad_request", 0)
    assert conn.rt({"op": "ping", "id": 3})["id"] == 3


# -- requests: ids, ops, types ---------------------------------------------------------

@pytest.mark.parametrize("enc", ["05", "cc05", "cd0005", "ce00000005", "cf0000000000000005",
                                 "d005", "d10005", "d200000005", "d30000000000000005"])
def test_id_in_every_integer_encoding(conn, enc):
    r = conn.rt_body(b"\x82\xa2id" + bytes.fromhex(enc) + b"\xa2op\xa4ping")
    assert r["id"] == 5 and r["protocol"] == 1


@pytest.mark.parametrize("single", [False, True], ids=["float64", "float32"])
def test_whole_floats_are_integers(conn, single):
    """A whole number written as a float is that number: msgpack-lite (JavaScript) writes
    every number outside the int32 range as a float64 (a window of 30 days, an id past
    2^31). A fraction, a negative or a NaN stays a wrong type (WRONG["float"] above)."""
    def rt(obj):
        conn.send_body(msgpack.packb(with_mode(obj) if MODE == "global" else obj, use_single_float=single))
        return conn.recv()
    rid = 5.0 if single else 3e9  # a float32 holds every whole number up to 2^24 exactly
    assert rt({"op": "ping", "id": rid})["id"] == rid
    lim = {"key": uniq(), "limit": 5.0, "window_ms": 2592e6 if not single else 60000.0, "burst": 5.0}
    r = assert_check(rt({"op": "check", "id": rid, "limits": [lim], "cost": 2.0}), rid)
    assert r["allowed"] and r["limit"] == 5 and r["remaining"] == 3
    assert r["rules"][0]["window_ms"] == lim["window_ms"]
    assert rt({"op": "renew", "id": rid, "lease": "x", "lease_ms": 1000.0}) == {"id": rid, "renewed": False, "expires_ms": 0}
    for v in (2.5, -1.0, float("nan"), float("inf"), 2.0**64):
        assert_error(rt({"op": "check", "id": 6, "limits": [dict(lim, limit=v)]}), "bad_request", 6)
        assert_error(rt({"op": "check", "id": 7, "cost": v}), "bad_request", 7)


def test_nil_optional_limit_fields_left_out(conn):
    """An inline limit's burst, algorithm, mode and name given as nil are left out, as a
    JavaScript encoder writes a property set to undefined; a required field as nil is a
    wrong type."""
    def rt(obj):
        conn.send_body(msgpack.packb(obj))
        return conn.recv()
    key = uniq()
    lim = {"key": key, "limit": 3, "window_ms": 60000, "burst": None, "algorithm": None, "mode": None, "name": None}
    r = assert_check(rt({"op": "check", "id": 4, "limits": [lim]}), 4)
    assert r["allowed"] and r["limit"] == 3 and r["remaining"] == 2 and r["rules"][0]["name"] == key
    for field in ("key", "limit", "window_ms"):
        assert_error(rt({"op": "check", "id": 5, "limits": [dict(lim, **{field: None})]}), "bad_request", 5)


@pytest.mark.parametrize("rid", [0, 1, 127, 128, 2**16, 2**32, 2**63, 2**64 - 1])
def test_ids_echoed(conn, rid):
    assert conn.rt({"op": "ping", "id": rid})["id"] == rid
    assert_check(conn.rt({"op": "check", "id": rid, "attrs": api(user=uniq())}), rid)


def test_ping_and_default_id(conn):
    r = conn.rt({"op": "ping"})
    assert set(r) == {"id", "version", "protocol"} and r["id"] == 0 and r["protocol"] == 1
    assert isinstance(r["version"], str) and r["version"]


def test_op_as_bin_and_unknown_fields(conn):
    assert conn.rt({"op": b"ping", "id": 7, "zzz": {"a": [1, 2, None]}})["id"] == 7


# Unknown fields are ignored whatever their value: msgpack extension values (the Timestamp
# extension, -1, among them) too, nested or not; and whatever their name's length.
UNKNOWN_VALUES = {
    "ext": msgpack.ExtType(1, b"\x02"),
    "ext-empty": msgpack.ExtType(127, b""),
    "ext-looks-like-a-map": msgpack.ExtType(1, b"\x80"),
    "ext-large": msgpack.ExtType(0, b"\xc1" * 300),
    "timestamp": msgpack.Timestamp(1),
    "timestamp96": msgpack.Timestamp(1 << 40, 5),
    "ext-in-array": [1, msgpack.ExtType(5, b"abcd")],
    "ext-in-map": {"t": msgpack.Timestamp(7), "u": [msgpack.ExtType(2, b"")]},
}


@pytest.mark.parametrize("kind", sorted(UNKNOWN_VALUES))
def test_unknown_field_holding_any_value(conn, kind):
    v = UNKNOWN_VALUES[kind]
    assert conn.rt({"id": 7, "op": "ping", "zzz": v})["id"] == 7
    key = uniq()
    lim = {"key": key, "limit": 3, "window_ms": 60000, "zzz": v}
    r = assert_check(conn.rt({"id": 8, "op": "check", "limits": [lim]}), 8)
    assert r["remaining"] == 2


@pytest.mark.parametrize("n", [256, 257, 1000, 40000])
def test_unknown_field_with_a_long_name(conn, n):
    assert conn.rt({"id": 7, "op": "ping", "z" * n: 1})["id"] == 7
    lim = {"key": uniq(), "limit": 3, "window_ms": 60000, "z" * n: 1}
    r = assert_check(conn.rt({"id": 8, "op": "check", "limits": [lim]}), 8)
    assert r["remaining"] == 2


@pytest.mark.parametrize("op", ["frob", "", "CHECK", "Ping", "x" * 64, "x" * 65, "check" * 1000],
                         ids=lambda op: op if len(op) <= 8 else "%d-bytes" % len(op))
def test_unknown_op(conn, op):
    assert_error(conn.rt({"op": op, "id": 4}), "unknown_op", 4)


WRONG = {"nil": None, "bool": True, "float": 1.5, "negative": -3, "str": "x", "bin": b"x",
         "array": [1], "map": {"a": "b"},
         # an extension value is no field's type, whatever its data looks like
         "ext": msgpack.ExtType(1, b"\x80"), "timestamp": msgpack.Timestamp(1)}
EXPECTED_TYPE = {"id": "uint", "op": "str", "attrs": "map", "limits": "array", "cost": "uint"}


def wrong_values(field):
    t = EXPECTED_TYPE[field]
    for name, v in WRONG.items():
        if t == "str" and name in ("str", "bin"):
            continue
        if t == "map" and name in ("map", "nil"):  # nil: the empty map
            continue
        if t == "array" and name in ("nil",):  # nil: no inline limits
            continue
        if t == "array" and name == "array":
            v = [1]  # an array, but not of maps
        yield name, v


@pytest.mark.parametrize("field,kind,value", [(f, n, v) for f in EXPECTED_TYPE for n, v in wrong_values(f)])
def test_wrong_type_is_bad_request_and_consumes_nothing(conn, field, kind, value):
    attrs = api(user=uniq(), ip=uniq("ip"))
    before = remaining(conn, attrs)
    req = {"id": 9, "op": "check", "attrs": attrs}
    req[field] = value
    # the id of the answer: the request's when it could be read
    assert_error(conn.rt(req), "bad_request", 0 if field == "id" else 9)
    assert remaining(conn, attrs) == before
    assert conn.rt({"op": "ping", "id": 10})["id"] == 10


@pytest.mark.parametrize("field", ["key", "limit", "window_ms", "burst", "algorithm", "mode", "name"])
@pytest.mark.parametrize("kind", ["nil", "bool", "float", "negative", "array", "map", "ext", "timestamp"])
def test_inline_limit_wrong_type(conn, field, kind):
    key = uniq()
    lim = {"key": key, "limit": 3, "window_ms": 60000}
    lim[field] = WRONG[kind]
    if kind == "nil" and field in ("burst", "algorithm", "mode", "name"):
        # nil leaves an optional field out (test_nil_optional_limit_fields_left_out): a
        # check, and the same again (in the same mode: a nil mode is the daemon's default)
        assert_check(conn.rt({"id": 12, "op": "check", "limits": [lim]}), 12)
        assert assert_check(conn.rt({"id": 13, "op": "check", "limits": [lim]}), 13)["remaining"] == 1
        return
    assert conn.rt({"id": 12, "op": "check", "limits": [lim]})["error"]["code"] in ("bad_request", "invalid_limit")
    r = assert_check(conn.rt({"id": 13, "op": "check", "limits": [{"key": key, "limit": 3, "window_ms": 60000}]}), 13)
    assert r["remaining"] == 2  # the refused request took nothing


@pytest.mark.parametrize("lim", [
    {"limit": 3, "window_ms": 1000},
    {"key": "", "limit": 3, "window_ms": 1000},
    {"key": "k", "window_ms": 1000},
    {"key": "k", "limit": 0, "window_ms": 1000},
    {"key": "k", "limit": 3},
    {"key": "k", "limit": 3, "window_ms": 0},
    {"key": "k", "limit": 3, "window_ms": 1000, "algorithm": "leaky"},
    {"key": "k", "limit": 3, "window_ms": 1000, "mode": "everywhere"},
    {"key": "k", "limit": 3, "window_ms": 1000, "algorithm": "a" * 65},
    {"key": "k", "limit": 3, "window_ms": 1000, "algorithm": "token_bucket" * 500},
    {"key": "k", "limit": 3, "window_ms": 1000, "mode": "m" * 65},
])
def test_invalid_inline_limit_consumes_nothing(conn, lim):
    attrs = api(user=uniq(), ip=uniq("ip"))
    before = remaining(conn, attrs)
    assert_error(conn.rt({"id": 14, "op": "check", "attrs": attrs, "limits": [lim]}), "invalid_limit", 14)
    assert remaining(conn, attrs) == before


# -- check -----------------------------------------------------------------------------

def test_check_fields_and_deciding_rule_when_allowed(conn):
    r = assert_check(conn.rt({"op": "check", "id": 2, "attrs": api(user=uniq(), ip=uniq("ip"))}), 2)
    assert r["allowed"] and r["rule"] == "per-ip" and r["limit"] == 5 and r["remaining"] == 4
    assert [e["name"] for e in r["rules"]] == ["per-user", "per-ip", "shadowy"]
    assert [e["shadow"] for e in r["rules"]] == [False, False, True]
    assert r["rules"][0]["window_ms"] == 60000 and r["rules"][0]["remaining"] == 9
    assert 0 < r["reset_ms"] <= 60000


def test_nothing_matched(conn):
    r = assert_check(conn.rt({"op": "check", "id": 3, "attrs": {"path": "/elsewhere", "user": "u"}}), 3)
    assert r["allowed"] and r["rule"] == "" and r["rules"] == [] and r["limit"] == 0


def test_refusal_consumes_nothing_from_the_others(conn):
    ip = uniq("ip")
    for _ in range(5):
        assert conn.rt({"op": "check", "id": 1, "attrs": api(user=uniq(), ip=ip)})["allowed"]
    user = uniq()
    r = assert_check(conn.rt({"op": "check", "id": 2, "attrs": api(user=user, ip=ip)}), 2)
    assert not r["allowed"] and r["rule"] == "per-ip" and r["retry_after_ms"] > 0
    assert r["remaining"] == 0 and r["reset_ms"] >= r["retry_after_ms"]
    per_user = next(e for e in r["rules"] if e["name"] == "per-user")
    assert per_user["allowed"] and per_user["remaining"] == 10
    assert remaining(conn, api(user=user, ip=uniq("ip")))["per-user"] == 10


def test_deciding_rule_when_refused_is_the_longest_retry(conn):
    user, ip = uniq(), uniq("ip")
    assert conn.rt({"op": "check", "id": 1, "attrs": {"path": "/slow", "user": user, "ip": ip}})["allowed"]
    r = assert_check(conn.rt({"op": "check", "id": 2, "attrs": {"path": "/slow", "user": user, "ip": ip}}), 2)
    assert not r["allowed"] and r["rule"] == "slow"  # 1 per hour beats 1 per minute
    assert r["retry_after_ms"] > 60000


def test_shadow_never_rejects_nor_decides(conn):
    user = uniq()
    for i in range(3):
        r = assert_check(conn.rt({"op": "check", "id": i, "attrs": api(user=user, ip=uniq("ip"))}), i)
        assert r["allowed"] and r["rule"] == "per-ip"
    sh = next(e for e in r["rules"] if e["name"] == "shadowy")
    assert sh["shadow"] and not sh["allowed"] and sh["retry_after_ms"] > 0


def test_cost_zero_asks_without_consuming(conn):
    attrs = api(user=uniq(), ip=uniq("ip"))
    for _ in range(3):
        r = assert_check(conn.rt({"op": "check", "id": 1, "attrs": attrs, "cost": 0}), 1)
        assert r["allowed"] and r["remaining"] == 5
    ip = uniq("ip")
    for _ in range(5):
        conn.rt({"op": "check", "id": 1, "attrs": api(user=uniq(), ip=ip)})
    r = assert_check(conn.rt({"op": "check", "id": 2, "attrs": api(user=uniq(), ip=ip), "cost": 0}), 2)
    assert not r["allowed"] and r["retry_after_ms"] > 0


@pytest.mark.parametrize("cost", [6, 2**32, 2**64 - 1])
def test_cost_above_capacity_never_passes_and_takes_nothing(conn, cost):
    attrs = api(user=uniq(), ip=uniq("ip"))
    r = assert_check(conn.rt({"op": "check", "id": 1, "attrs": attrs, "cost": cost}), 1)
    assert not r["allowed"] and r["retry_after_ms"] == 0 and r.get("reason") == "cost_exceeds_capacity"
    assert remaining(conn, attrs) == {"per-user": 10, "per-ip": 5, "shadowy": 2}
    r = assert_check(conn.rt({"op": "check", "id": 2, "attrs": attrs, "cost": 5}), 2)
    assert r["allowed"] and r["remaining"] == 0


def test_refused_for_cost_above_what_is_left(conn):
    """A request refused because its cost is above what is left (not above the capacity):
    `remaining` is what is left, unchanged, and a retry after `retry_after_ms` passes (the
    earliest time a retry can pass: a limit of 5 per 1.5 s, 4 taken, a cost of 2 waits for
    units to come back by the limit's own algorithm). The three algorithms side by side,
    each retried 250 ms after its own retry_after_ms: the margin covers a busy machine and
    hybrid mode's sync interval (100 ms), and is short of the time the sliding window takes,
    so a retry_after_ms taken from another algorithm's arithmetic fails here."""
    lims, wrong, waits = [], [], []
    for algorithm in ("token_bucket", "sliding_window", "fixed_window"):
        for attempt in range(5):  # a fresh key when units came back between the two checks
            lim = {"key": uniq(), "limit": 5, "window_ms": 1500, "algorithm": algorithm}
            r = assert_check(conn.rt({"op": "check", "id": 1, "limits": [lim], "cost": 4}), 1)
            assert r["allowed"] and r["remaining"] == 1, (lim, r)
            r = assert_check(conn.rt({"op": "check", "id": 2, "limits": [lim], "cost": 2}), 2)
            if not r["allowed"]:
                break
        assert not r["allowed"] and 0 < r["retry_after_ms"] <= 1500 and "reason" not in r, (lim, r)
        if r["remaining"] != 1 or r["rules"][0]["remaining"] != 1:
            wrong.append(("remaining is not what is left (1)", algorithm, r))
        lims.append(lim)
        waits.append(time.time() + r["retry_after_ms"] / 1000)
    for at, lim in sorted(zip(waits, lims), key=lambda p: p[0]):  # each retried at its own time
        time.sleep(max(0, at + 0.25 - time.time()))
        r = assert_check(conn.rt({"op": "check", "id": 3, "limits": [lim], "cost": 2}), 3)
        if not r["allowed"]:
            wrong.append(("refused %.0f ms after its retry_after_ms" % ((time.time() - at) * 1000), lim["algorithm"], r))
    assert not wrong, wrong


def test_refused_request_reports_each_limit_for_its_cost(conn):
    """A request one limit refuses reports each other limit for the request's cost, not for a
    cost of 1: a bucket of 5 an hour, emptied, asked for 3 beside a spent local limit says
    refused with a retry_after_ms of three tokens (36 minutes), never one (12); asked for 6, it
    says cost_exceeds_capacity and decides the answer (no retry can pass). A limit whose figures
    were not read (`unasked`, a Redis-backed one the refusal skipped) says so instead. With
    Redis, a roomy global limit rides along: a request that waits on Redis is the one whose
    spent local limit refuses it before the others are asked."""
    spent = {"key": uniq("spent"), "limit": 10, "window_ms": 60000, "algorithm": "fixed_window",
             "mode": "local"}
    bucket = {"key": uniq("bucket"), "limit": 5, "window_ms": 3600000}
    roomy = [{"key": uniq("roomy"), "limit": 100, "window_ms": 60000, "mode": "global"}] if WITH_REDIS else []
    assert assert_check(conn.rt({"op": "check", "id": 1, "limits": [spent], "cost": 10}), 1)["allowed"]
    assert assert_check(conn.rt({"op": "check", "id": 2, "limits": [bucket], "cost": 5}), 2)["allowed"]
    r = assert_check(conn.rt({"op": "check", "id": 3, "limits": [spent, bucket] + roomy, "cost": 3}), 3)
    e = r["rules"][1]
    assert not r["allowed"] and r["rules"][0]["retry_after_ms"] <= 60000, r
    if not e.get("unasked"):
        assert not e["allowed"] and e["retry_after_ms"] > 35 * 60000 and "reason" not in e, r
        assert r["rule"] == bucket["key"] and r["retry_after_ms"] == e["retry_after_ms"], r
    r = assert_check(conn.rt({"op": "check", "id": 4, "limits": [spent, bucket] + roomy, "cost": 6}), 4)
    e = r["rules"][1]
    assert not e["allowed"] and e["retry_after_ms"] == 0 and e.get("reason") == "cost_exceeds_capacity", r
    assert r["rule"] == bucket["key"] and r["retry_after_ms"] == 0 and r.get("reason") == "cost_exceeds_capacity", r


def test_inline_limits_with_rules_all_or_nothing(conn):
    attrs = api(user=uniq(), ip=uniq("ip"))
    key = uniq()
    one = {"key": key, "limit": 1, "window_ms": 60000, "name": "one"}
    r = assert_check(conn.rt({"op": "check", "id": 1, "attrs": attrs, "limits": [one], "cost": 2}), 1)
    assert not r["allowed"] and r["rule"] == "one" and r["rules"][-1]["name"] == "one"
    r = assert_check(conn.rt({"op": "check", "id": 2, "attrs": attrs, "limits": [one]}), 2)
    assert r["allowed"] and r["rule"] == "one" and r["remaining"] == 0
    assert [e["name"] for e in r["rules"]] == ["per-user", "per-ip", "shadowy", "one"]
    assert r["rules"][0]["remaining"] == 9  # the refused request took nothing
    r = assert_check(conn.rt({"op": "check", "id": 3, "limits": [{"key": uniq(), "limit": 2, "window_ms": 1000}]}), 3)
    assert r["rule"] and r["limit"] == 2 and r["rules"][0]["window_ms"] == 1000  # name: the key


@pytest.mark.parametrize("mode", ["local", "hybrid", "global"])
def test_inline_modes(conn, mode):
    """Every mode the contract lists is a valid inline limit, whatever the daemon: one
    without Redis decides hybrid and global ones from a local bucket, marked degraded."""
    lim = {"key": uniq(), "limit": 2, "window_ms": 60000, "mode": mode}
    got = [conn.rt({"op": "check", "id": i, "limits": [lim]}) for i in range(3)]
    assert ["error" not in r and r["id"] == i for i, r in enumerate(got)] == [True] * 3, got
    assert [r["allowed"] for r in got] == [True, True, False], got
    assert [r["rules"][0]["limit"] for r in got] == [2] * 3, got
    if not WITH_REDIS:
        assert [r["degraded"] for r in got] == [mode != "local"] * 3, got


@pytest.mark.parametrize("algorithm", ["token_bucket", "sliding_window", "fixed_window"])
def test_inline_algorithms(conn, algorithm):
    def three():
        lim = {"key": uniq(), "limit": 2, "window_ms": 60000, "algorithm": algorithm}
        return [assert_check(conn.rt({"op": "check", "id": i, "limits": [lim]}), i)["allowed"] for i in range(3)]
    assert in_one_window(60000, three) == [True, True, False]


@pytest.mark.parametrize("algorithm", ["token_bucket", "sliding_window", "fixed_window"])
def test_inline_limit_listed_twice_is_one_limit(conn, algorithm):
    """The same inline limit twice in one request: decided and charged once, reported twice."""
    def twice():
        ten = {"key": uniq(), "limit": 10, "window_ms": 60000, "algorithm": algorithm}
        return [assert_check(conn.rt({"op": "check", "id": i, "limits": [ten, ten]}), i) for i in range(2)]
    for r, left in zip(in_one_window(60000, twice), [9, 8]):
        assert r["allowed"] and r["remaining"] == left, r
        assert r["rules"][0] == r["rules"][1] and r["rules"][0]["remaining"] == left, r

    def once_then_full():
        one = {"key": uniq(), "limit": 1, "window_ms": 60000, "algorithm": algorithm}
        return one, [assert_check(conn.rt({"op": "check", "id": 3, "limits": [one, dict(one, name="again")]}), 3),
                     assert_check(conn.rt({"op": "check", "id": 4, "limits": [one, one]}), 4)]
    one, (r, full) = in_one_window(60000, once_then_full)
    assert r["allowed"] and r["rule"] == one["key"] and [e["name"] for e in r["rules"]] == [one["key"], "again"], r
    assert not full["allowed"] and full["rules"][0] == full["rules"][1], full


# -- leases ----------------------------------------------------------------------------

def test_leases(conn, daemon):
    attrs = {"path": "/exports/1", "user": uniq()}
    a = assert_check(conn.rt({"op": "check", "id": 1, "attrs": attrs}), 1)
    b = assert_check(conn.rt({"op": "check", "id": 2, "attrs": attrs}), 2)
    assert isinstance(a["lease"], str) and a["lease"] and a["lease"] != b["lease"]
    assert a["remaining"] == 1 and b["remaining"] == 0 and a["rules"][0]["window_ms"] == 1000
    full = assert_check(conn.rt({"op": "check", "id": 3, "attrs": attrs}), 3)
    assert not full["allowed"] and "lease" not in full and 0 < full["retry_after_ms"] <= 1000
    assert conn.rt({"op": "release", "id": 4, "lease": a["lease"]}) == {"id": 4, "released": True}
    assert conn.rt({"op": "release", "id": 5, "lease": a["lease"]}) == {"id": 5, "released": False}
    assert conn.rt({"op": "release", "id": 6, "lease": "no-such-lease"}) == {"id": 6, "released": False}
    r = conn.rt({"op": "renew", "id": 7, "lease": b["lease"], "lease_ms": 500})
    assert r == {"id": 7, "renewed": True, "expires_ms": 500}
    assert conn.rt({"op": "renew", "id": 8, "lease": "no-such-lease"}) == {"id": 8, "renewed": False, "expires_ms": 0}
    deadline = time.time() + 10  # b expires 500 ms after its renewal: both slots free
    while remaining(conn, attrs)["exports"] != 2:
        assert time.time() < deadline, "a lease renewed for 500 ms never expired"
        time.sleep(0.05)
    assert conn.rt({"op": "renew", "id": 9, "lease": b["lease"]}) == {"id": 9, "renewed": False, "expires_ms": 0}
    assert conn.rt({"op": "release", "id": 10, "lease": b["lease"]}) == {"id": 10, "released": False}
    # leases of a connection that closes are freed
    other = Conn(daemon.socket)
    for i in range(2):
        assert other.rt({"op": "check", "id": i, "attrs": attrs})["allowed"]
    assert not conn.rt({"op": "check", "id": 11, "attrs": attrs, "cost": 0})["allowed"]
    other.close()
    deadline = time.time() + 10
    while not conn.rt({"op": "check", "id": 12, "attrs": attrs, "cost": 0})["allowed"]:
        assert time.time() < deadline, "leases of a closed connection were not freed"
        time.sleep(0.02)


# Release and renew as a hostile or sloppy client sends them. What PROTOCOL.md says: release
# answers {id, released}, false for a lease unknown, expired or already released, never an
# error for those; renew answers {id, renewed, expires_ms}; a field of the wrong type is
# bad_request. The rest follows this suite's reading of it: a refused renew says
# expires_ms 0 and expires_ms is the lease_ms asked (test_leases), a whole float is an
# integer and a fraction or a negative is a wrong type (test_whole_floats_are_integers),
# nil leaves an optional field out (test_nil_optional_limit_fields_left_out), a field
# given twice is bad_request (test_malformed_body_is_bad_request_and_connection_stays).
# Where PROTOCOL.md is silent the cases assert only a well-formed answer that agrees with
# what the daemon then holds, and that the connection keeps serving.

def take_lease(conn):
    """A fresh user's lease of `exports` (max 2): (attrs, token)."""
    attrs = {"path": "/exports/1", "user": uniq()}
    r = assert_check(conn.rt({"op": "check", "id": 1, "attrs": attrs}), 1)
    assert r["allowed"] and isinstance(r.get("lease"), str) and r["lease"], r
    return attrs, r["lease"]


def held(conn, attrs):
    """How many of `exports`' two slots attrs' user holds, asked with cost 0."""
    return 2 - remaining(conn, attrs)["exports"]


def assert_released(r, rid, released):
    assert set(r) == {"id", "released"}, r
    assert type(r["id"]) is int and r["id"] == rid, r
    assert type(r["released"]) is bool and r["released"] is released, r


def assert_renewed(r, rid, renewed, expires_ms=None):
    assert set(r) == {"id", "renewed", "expires_ms"}, r
    assert type(r["id"]) is int and r["id"] == rid, r
    assert type(r["renewed"]) is bool and r["renewed"] is renewed, r
    assert type(r["expires_ms"]) is int, r
    if not renewed:
        assert r["expires_ms"] == 0, r
    elif expires_ms is not None:
        assert r["expires_ms"] == expires_ms, r
    else:
        assert r["expires_ms"] > 0, r


def assert_release_or_renew_answer(r, rid, op):
    """A well-formed answer to op, or an error naming a code: (known, changed) where known
    says the lease was found (released/renewed true)."""
    if "error" in r:
        assert set(r) == {"id", "error"} and r["id"] == rid, r
        assert isinstance(r["error"].get("code"), str) and r["error"]["code"], r
        assert isinstance(r["error"].get("message"), str) and r["error"]["message"], r
        return False
    if op == "release":
        assert_released(r, rid, r.get("released"))
        return r["released"]
    assert_renewed(r, rid, r.get("renewed"))
    return r["renewed"]


def wait_freed(conn, attrs, what):
    deadline = time.time() + 10
    while held(conn, attrs):
        assert time.time() < deadline, what
        time.sleep(0.02)


def expiries_unmoved(conn, cases, renew_ms=300):
    """Each case on a lease of its own, renewed for renew_ms first (None: not renewed):
    case(tok) sends its request and asserts the answer. Then every lease is still held, and
    every one is freed within the wait, together: none had its expiry moved to the 60 s the
    cases ask. cases maps a name (in the failure) to its function."""
    leases = {name: take_lease(conn) for name in cases}
    for name, (attrs, tok) in leases.items():
        if renew_ms:
            assert_renewed(conn.rt({"op": "renew", "id": 48, "lease": tok, "lease_ms": renew_ms}), 48, True, renew_ms)
    for name, case in cases.items():
        case(leases[name][1])
    assert [n for n, (attrs, _) in leases.items() if held(conn, attrs) != 1] == []
    deadline = time.time() + 10
    while True:
        left = [n for n, (attrs, _) in leases.items() if held(conn, attrs)]
        if not left:
            return
        assert time.time() < deadline, "leases not freed in 10 s (their expiry moved): %s" % left
        time.sleep(0.02)


def frames(*reqs):
    """The requests as frames, for one write."""
    return b"".join(struct.pack(">I", len(b)) + b for b in (msgpack.packb(r) for r in reqs))


MANGLED = {
    "first char changed": lambda t: ("0" if t[0] != "0" else "1") + t[1:],
    "middle char changed": lambda t: t[:len(t) // 2] + ("0" if t[len(t) // 2] != "0" else "1") + t[len(t) // 2 + 1:],
    "last char changed": lambda t: t[:-1] + ("0" if t[-1] != "0" else "1"),
    "upper-cased": lambda t: t.upper(),
    "leading space": lambda t: " " + t,
    "leading junk": lambda t: "x" + t,
    "trailing space": lambda t: t + " ",
    "trailing newline": lambda t: t + "\n",
    "trailing CR": lambda t: t + "\r",
    "trailing CRLF": lambda t: t + "\r\n",
    "newline inside": lambda t: t[:len(t) // 2] + "\n" + t[len(t) // 2:],
    "CRLF inside": lambda t: t[:len(t) // 2] + "\r\n" + t[len(t) // 2:],
    "trailing NUL": lambda t: t + "\x00",
    "trailing junk": lambda t: t + "x",
    "trailing non-ASCII": lambda t: t + "\u00e9",
    "first char dropped": lambda t: t[1:],
    "last char dropped": lambda t: t[:-1],
    "half": lambda t: t[:len(t) // 2],
    "one char": lambda t: t[:1],
    "empty": lambda t: "",
    "twice": lambda t: t + t,
    "1,000 bytes after it": lambda t: t + "x" * 1000,
    "1,000 bytes before it": lambda t: "x" * 1000 + t,
}


@pytest.mark.parametrize("how", sorted(MANGLED))
def test_mangled_lease_is_unknown_and_frees_nothing(conn, how):
    """A lease with a character changed, cased otherwise, padded, cut or empty is another
    string, so a lease the daemon did not issue: released false and renewed false (never an
    error), and the real lease still holds its slot and is released once, afterwards."""
    attrs, tok = take_lease(conn)
    bad = MANGLED[how](tok)
    assert bad != tok
    assert_released(conn.rt({"op": "release", "id": 31, "lease": bad}), 31, False)
    assert_renewed(conn.rt({"op": "renew", "id": 32, "lease": bad, "lease_ms": 60000}), 32, False)
    assert_renewed(conn.rt({"op": "renew", "id": 33, "lease": bad}), 33, False)
    assert held(conn, attrs) == 1
    assert_released(conn.rt({"op": "release", "id": 34, "lease": tok}), 34, True)
    assert held(conn, attrs) == 0


def long_lease(tok, n):
    """tok padded with x's to n bytes."""
    return tok + "x" * (n - len(tok))


def lease_body(op, rid, tok, size):
    """The body of {op, id: rid, lease: tok padded with x's}, size bytes long (a lease of
    256 bytes or more: its str header's length does not change)."""
    body = msgpack.packb({"op": op, "id": rid, "lease": long_lease(tok, 300)})
    body = msgpack.packb({"op": op, "id": rid, "lease": long_lease(tok, 300 + size - len(body))})
    assert len(body) == size
    return body


@pytest.mark.parametrize("n", [100, 4096, 32768, 32769, 40000, pytest.param(0, id="a-frame-of-MAX_FRAME")])
@pytest.mark.parametrize("op", ["release", "renew"])
def test_long_lease_within_a_frame_is_unknown(conn, op, n):
    """A lease tens of KB long in a frame the daemon accepts is a lease it did not issue:
    false, never an error. n 0: the lease that makes the frame MAX_FRAME bytes."""
    attrs, tok = take_lease(conn)
    if n:
        r = conn.rt({"op": op, "id": 41, "lease": long_lease(tok, n)})
    else:
        r = conn.rt_body(lease_body(op, 41, tok, MAX_FRAME))
    if op == "release":
        assert_released(r, 41, False)
    else:
        assert_renewed(r, 41, False)
    assert held(conn, attrs) == 1


@pytest.mark.parametrize("n", [32768, 32769, 40000, 0], ids=["32768", "32769", "40000", "a-frame-of-MAX_FRAME"])
@pytest.mark.parametrize("op", ["release", "renew"])
def test_long_lease_within_a_frame_frees_nothing(conn, op, n):
    """Whatever a lease tens of KB long gets, the lease it starts with keeps its slot, the
    frame is answered with its id and the connection serves on. n 0: a frame of MAX_FRAME
    bytes."""
    attrs, tok = take_lease(conn)
    r = conn.rt_body(msgpack.packb({"op": op, "id": 42, "lease": long_lease(tok, n)}) if n
                     else lease_body(op, 42, tok, MAX_FRAME))
    assert not assert_release_or_renew_answer(r, 42, op), r
    assert held(conn, attrs) == 1
    assert_released(conn.rt({"op": "release", "id": 43, "lease": tok}), 43, True)


@pytest.mark.parametrize("op", ["release", "renew"])
def test_lease_over_the_frame_bound_closes_only_its_connection(conn, daemon, op):
    """A release one byte over the largest frame: frame_too_large, that connection closed;
    a lease held on another connection keeps its slot."""
    attrs, tok = take_lease(conn)
    other = Conn(daemon.socket)
    try:
        other.send_body(lease_body(op, 44, tok, MAX_FRAME + 1))
        assert_error(other.recv(), "frame_too_large", 0)
        assert other.closed()
    finally:
        other.close()
    assert held(conn, attrs) == 1
    assert_released(conn.rt({"op": "release", "id": 45, "lease": tok}), 45, True)


def test_every_one_character_change_is_unknown(conn):
    """Each position of a lease changed to each other letter, digit or -_+/=. in turn: never
    the lease (a renew of each, pipelined a position at a time, is renewed false), and the
    lease is still held afterwards."""
    attrs, tok = take_lease(conn)
    alphabet = string.ascii_letters + string.digits + "-_+/=."
    taken = []
    for pos in range(len(tok)):
        bads = [tok[:pos] + ch + tok[pos + 1:] for ch in alphabet if ch != tok[pos]]
        conn.s.sendall(frames(*({"op": "renew", "id": 100 + i, "lease": b, "lease_ms": 60000} for i, b in enumerate(bads))))
        for i, b in enumerate(bads):
            r = conn.recv()
            if r != {"id": 100 + i, "renewed": False, "expires_ms": 0}:
                taken.append((b, r))
    assert not taken, (tok, taken[:5])
    assert held(conn, attrs) == 1
    assert_released(conn.rt({"op": "release", "id": 99, "lease": tok}), 99, True)


@pytest.mark.parametrize("kind", ["bool", "float", "negative", "int", "array", "map", "ext", "timestamp"])
@pytest.mark.parametrize("op", ["release", "renew"])
def test_lease_of_the_wrong_type_is_bad_request_and_frees_nothing(conn, op, kind):
    """The lease is a string (the check answer's `lease`): a number, an array holding it, a
    map or an extension value is a wrong type, bad_request with the id echoed, and the
    lease keeps its slot."""
    attrs, tok = take_lease(conn)
    value = {"int": 7, "array": [tok], "map": {"lease": tok}}.get(kind, WRONG.get(kind))
    assert_error(conn.rt({"op": op, "id": 35, "lease": value}), "bad_request", 35)
    assert held(conn, attrs) == 1
    assert_released(conn.rt({"op": "release", "id": 36, "lease": tok}), 36, True)


@pytest.mark.parametrize("how", ["missing", "nil"])
@pytest.mark.parametrize("op", ["release", "renew"])
def test_lease_missing_or_nil_frees_nothing(conn, op, how):
    """PROTOCOL.md gives release and renew a lease and does not say what a request without
    one gets: bad_request (a required field left out) or released/renewed false (no lease
    the daemon knows) both read it. Either way the lease held stays held."""
    attrs, tok = take_lease(conn)
    req = {"op": op, "id": 37}
    if how == "nil":
        req["lease"] = None
    r = conn.rt(req)
    if "error" in r:
        assert_error(r, "bad_request", 37)
    elif op == "release":
        assert_released(r, 37, False)
    else:
        assert_renewed(r, 37, False)
    assert held(conn, attrs) == 1
    assert_released(conn.rt({"op": "release", "id": 38, "lease": tok}), 38, True)


@pytest.mark.parametrize("op", ["release", "renew"])
def test_lease_as_bin(conn, op):
    """The lease's bytes as a msgpack bin, not a str. PROTOCOL.md says string; this suite
    takes bin for a str elsewhere (the op), and does not hold the daemon to either here:
    the answer must agree with the slot, freed exactly when released is true."""
    attrs, tok = take_lease(conn)
    r = conn.rt({"op": op, "id": 39, "lease": tok.encode()})
    known = assert_release_or_renew_answer(r, 39, op)
    if "error" in r:
        assert_error(r, "bad_request", 39)
    assert held(conn, attrs) == (0 if known and op == "release" else 1), r
    assert_released(conn.rt({"op": "release", "id": 40, "lease": tok}), 40, not (known and op == "release"))


@pytest.mark.parametrize("single", [False, True], ids=["float64", "float32"])
def test_renew_lease_ms_as_a_whole_float(conn, single):
    """A whole lease_ms written as a float is that number (test_whole_floats_are_integers)."""
    attrs, tok = take_lease(conn)
    conn.send_body(msgpack.packb({"op": "renew", "id": 46, "lease": tok, "lease_ms": 1500.0}, use_single_float=single))
    assert_renewed(conn.recv(), 46, True, 1500)
    assert_released(conn.rt({"op": "release", "id": 47, "lease": tok}), 47, True)


LEASE_MS_WRONG = {
    "fraction": 60000.5, "negative": -1, "negative float": -60000.0, "nan": float("nan"), "inf": float("inf"),
    "float past 2^64": 2.0**64, "str": "60000", "bool": True, "nil": None, "array": [60000],
    "map": {"lease_ms": 60000}, "ext": msgpack.ExtType(1, b"\x80"), "timestamp": msgpack.Timestamp(60),
}


def test_renew_lease_ms_of_the_wrong_type_changes_nothing(conn):
    """lease_ms is a count of milliseconds: a fraction, a negative, a NaN, a string or a
    bool is a wrong type, bad_request with the id echoed; nil too, as for cost (wrong_values:
    an optional uint given as nil is no uint). The lease keeps the expiry it had: renewed
    for 300 ms first, it is freed soon after, not 60 s later."""
    def case(kind):
        def send(tok):
            r = conn.rt({"op": "renew", "id": 49, "lease": tok, "lease_ms": LEASE_MS_WRONG[kind]})
            assert "error" in r, (kind, r)
            assert_error(r, "bad_request", 49)
        return send
    expiries_unmoved(conn, {kind: case(kind) for kind in LEASE_MS_WRONG})


@pytest.mark.parametrize("lease_ms", [0, 2**31, 2**32, 2**63, 2**64 - 1])
def test_renew_lease_ms_zero_or_huge(conn, lease_ms):
    """PROTOCOL.md gives lease_ms no bound and no meaning for 0. The answer is well-formed
    (renewed with an expires_ms, or an error with the id echoed) and agrees with the lease:
    renewed, the lease is still held; refused with an error, its expiry did not move (it
    was renewed for 300 ms first)."""
    attrs, tok = take_lease(conn)
    assert_renewed(conn.rt({"op": "renew", "id": 51, "lease": tok, "lease_ms": 300}), 51, True, 300)
    r = conn.rt({"op": "renew", "id": 52, "lease": tok, "lease_ms": lease_ms})
    if assert_release_or_renew_answer(r, 52, "renew"):
        if r["expires_ms"] > 200:
            assert_released(conn.rt({"op": "release", "id": 53, "lease": tok}), 53, True)
        return
    if "error" in r:
        assert r["error"]["code"] in ERROR_CODES, r
    wait_freed(conn, attrs, "a refused renew (lease_ms %d) moved the lease's expiry" % lease_ms)


@pytest.mark.parametrize("lease_ms", [1, 127, 128, 255, 256, 65535, 65536, 2**20])
def test_renew_expires_ms_in_every_integer_width(conn, lease_ms):
    """expires_ms is the lease_ms asked (test_leases), written in whatever width it needs."""
    attrs, tok = take_lease(conn)
    assert_renewed(conn.rt({"op": "renew", "id": 54, "lease": tok, "lease_ms": lease_ms}), 54, True, lease_ms)
    if lease_ms > 200:
        assert held(conn, attrs) == 1
        assert_released(conn.rt({"op": "release", "id": 55, "lease": tok}), 55, True)


@pytest.mark.parametrize("enc", ["cc05", "cd0005", "ce00000005", "cf0000000000000005",
                                 "d005", "d10005", "d200000005", "d30000000000000005"])
def test_renew_lease_ms_in_every_integer_encoding(conn, enc):
    """lease_ms 5, in each msgpack integer encoding (fixint is test_leases'): 5 ms."""
    attrs, tok = take_lease(conn)
    body = b"\x84\xa2op\xa5renew\xa2id\x38\xa5lease" + msgpack.packb(tok) + b"\xa8lease_ms" + bytes.fromhex(enc)
    assert_renewed(conn.rt_body(body), 0x38, True, 5)


@pytest.mark.parametrize("rid", [None, 0, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**63, 2**64 - 1])
def test_release_and_renew_echo_every_id(conn, rid):
    """The id in each width the answer may need, and none (0)."""
    attrs, tok = take_lease(conn)
    want = rid or 0
    idf = {} if rid is None else {"id": rid}
    assert_renewed(conn.rt(dict(idf, op="renew", lease=tok, lease_ms=5000)), want, True, 5000)
    assert_released(conn.rt(dict(idf, op="release", lease=tok)), want, True)
    assert_renewed(conn.rt(dict(idf, op="renew", lease=tok, lease_ms=5000)), want, False)
    assert_released(conn.rt(dict(idf, op="release", lease=tok)), want, False)


@pytest.mark.parametrize("enc", ["05", "cc05", "cd0005", "ce00000005", "cf0000000000000005",
                                 "d005", "d10005", "d200000005", "d30000000000000005", "cb4014000000000000"])
def test_release_id_in_every_encoding(conn, enc):
    attrs, tok = take_lease(conn)
    body = b"\x83\xa2id" + bytes.fromhex(enc) + b"\xa2op\xa7release\xa5lease" + msgpack.packb(tok)
    assert_released(conn.rt_body(body), 5, True)


@pytest.mark.parametrize("kind", ["negative", "fraction", "str", "nil", "bool", "array"])
@pytest.mark.parametrize("op", ["release", "renew"])
def test_release_or_renew_with_a_wrong_id_frees_nothing(conn, op, kind):
    """An id of the wrong type: bad_request, id 0 (the request could not be read), and the
    lease named beside it is neither released nor renewed."""
    attrs, tok = take_lease(conn)
    value = {"negative": -1, "fraction": 5.5, "str": "5", "nil": None, "bool": True, "array": [5]}[kind]
    assert_error(conn.rt({"op": op, "id": value, "lease": tok, "lease_ms": 60000}), "bad_request", 0)
    assert held(conn, attrs) == 1
    assert_released(conn.rt({"op": "release", "id": 56, "lease": tok}), 56, True)


def str_as(v, width):
    """v (under 256 bytes) as a msgpack str with the header of that width; "shortest" is
    the one msgpack writers pick."""
    b = v.encode()
    assert len(b) < 256
    if width == "shortest":
        return msgpack.packb(v)
    return {"str8": bytes([0xd9, len(b)]), "str16": b"\xda" + struct.pack(">H", len(b)),
            "str32": b"\xdb" + struct.pack(">I", len(b))}[width] + b


@pytest.mark.parametrize("width", ["shortest", "str8", "str16", "str32"])
def test_lease_and_keys_in_every_str_width(conn, width):
    """One string is one string whatever the msgpack str header it comes in: the lease, and
    the keys "op", "lease" and "lease_ms", each written in the same width (the keys fit a
    fixstr; a lease may not)."""
    attrs, tok = take_lease(conn)

    def s(v):
        return str_as(v, width)
    body = b"\x84" + s("op") + s("renew") + s("id") + b"\x39" + s("lease") + s(tok) + s("lease_ms") + b"\xcd\x07\xd0"
    assert_renewed(conn.rt_body(body), 0x39, True, 2000)
    body = b"\x83" + s("op") + s("release") + s("id") + b"\x3a" + s("lease") + s(tok)
    assert_released(conn.rt_body(body), 0x3a, True)


@pytest.mark.parametrize("header", ["map16", "map32"])
def test_release_in_a_map16_and_map32(conn, header):
    """A request map with a map 16 or map 32 header (20 entries: the lease among unknown
    fields) is a map like another."""
    attrs, tok = take_lease(conn)
    pairs = [("z%02d" % i, i) for i in range(10)] + [("op", "release"), ("lease", tok), ("id", 57)] + \
        [("y%02d" % i, "v") for i in range(7)]
    body = raw_map(pairs)[3:]  # the pairs, after raw_map's map 16 header
    body = (b"\xde" + struct.pack(">H", len(pairs)) if header == "map16" else b"\xdf" + struct.pack(">I", len(pairs))) + body
    assert_released(conn.rt_body(body), 57, True)
    assert held(conn, attrs) == 0


@pytest.mark.parametrize("order", [
    ["lease", "op", "id"], ["id", "lease", "op"], ["lease_ms", "lease", "id", "op"],
    ["op", "lease_ms", "id", "lease"], ["lease", "lease_ms", "op", "id"],
])
def test_release_and_renew_fields_in_any_order(conn, order):
    attrs, tok = take_lease(conn)
    vals = {"op": "renew", "id": 58, "lease": tok, "lease_ms": 2500}
    keys = order if "lease_ms" in order else order + ["lease_ms"]
    assert_renewed(conn.rt_body(raw_map([(k, vals[k]) for k in keys])), 58, True, 2500)
    vals = {"op": "release", "id": 59, "lease": tok}
    assert_released(conn.rt_body(raw_map([(k, vals[k]) for k in order if k != "lease_ms"])), 59, True)


# Unknown fields, some named nearly like `lease` and `lease_ms` and holding the real lease or
# a lease_ms: none of them is the field, wherever it stands.
NEAR_LEASE = ["leas", "lease_", "leasee", "Lease", "LEASE", " lease", "lease\x00"]
NEAR_LEASE_MS = ["lease_m", "lease_mss", "Lease_ms", "leaseMs", "lease-ms", "lease ms"]


@pytest.mark.parametrize("before", [True, False], ids=["before", "after"])
def test_fields_named_nearly_like_lease_are_unknown(conn, before):
    attrs, tok = take_lease(conn)
    decoys = [(k, tok) for k in NEAR_LEASE] + [(k, 60000) for k in NEAR_LEASE_MS]
    real = [("op", "renew"), ("id", 60), ("lease", tok), ("lease_ms", 400)]
    assert_renewed(conn.rt_body(raw_map(decoys + real if before else real + decoys)), 60, True, 400)
    # none of them is the lease: a release naming another lease releases nothing
    real = [("op", "release"), ("id", 61), ("lease", "no-such-lease")]
    assert_released(conn.rt_body(raw_map(decoys + real if before else real + decoys)), 61, False)
    assert held(conn, attrs) == 1
    # nor the lease_ms: the renewal for 400 ms above stands, the decoys' 60 s do not
    wait_freed(conn, attrs, "a field named nearly like lease_ms renewed the lease")


def test_renew_with_only_a_field_named_nearly_like_lease_ms(conn):
    """A renew whose only lease_ms-like field is a decoy asking 60 s is a renew without
    lease_ms: whatever its default (PROTOCOL.md gives none; the rule's lease is 1 s), not
    60 s, and the lease is freed within the wait."""
    def case(name):
        def send(tok):
            r = conn.rt_body(raw_map([("op", "renew"), ("id", 66), ("lease", tok), (name, 60000)]))
            assert_renewed(r, 66, True)
            assert r["expires_ms"] != 60000, (name, r)
        return send
    expiries_unmoved(conn, {name: case(name) for name in NEAR_LEASE_MS}, renew_ms=None)


def test_release_or_renew_with_only_a_field_named_nearly_like_lease(conn):
    """A release or renew whose only lease-like field is a decoy holding the real lease has
    no lease (test_lease_missing_or_nil_frees_nothing): the lease stays held, unrenewed."""
    def case(op, name):
        def send(tok):
            r = conn.rt_body(raw_map([("op", op), ("id", 68), (name, tok), ("lease_ms", 60000)] if op == "renew"
                                     else [("op", op), ("id", 68), (name, tok)]))
            if "error" in r:
                assert_error(r, "bad_request", 68)
            elif op == "release":
                assert_released(r, 68, False)
            else:
                assert_renewed(r, 68, False)
        return send
    expiries_unmoved(conn, {(op, name): case(op, name) for op in ("release", "renew") for name in NEAR_LEASE})


@pytest.mark.parametrize("where", ["unknown field", "attrs", "an inline limit", "an array"])
def test_lease_nested_in_another_field_is_not_the_lease(conn, where):
    """The real lease as the value of a `lease` key inside another field: not the request's
    lease. The request's own lease names another, so nothing is released."""
    attrs, tok = take_lease(conn)
    nested = {"unknown field": {"zzz": {"lease": tok, "lease_ms": 60000}},
              "attrs": {"attrs": {"lease": tok}},
              "an inline limit": {"limits": [{"key": "k", "limit": 1, "window_ms": 1000, "lease": tok}]},
              "an array": {"zzz": [{"lease": tok}, "lease", tok]}}[where]
    for pairs in ([("op", "release"), ("id", 62)] + list(nested.items()) + [("lease", "no-such-lease")],
                  [("op", "release"), ("id", 62), ("lease", "no-such-lease")] + list(nested.items())):
        r = conn.rt_body(raw_map(pairs))
        if "error" in r:  # attrs or limits on a release: PROTOCOL.md does not say they are read there
            assert_error(r, "bad_request", 62)
        else:
            assert_released(r, 62, False)
        assert held(conn, attrs) == 1
    assert_released(conn.rt({"op": "release", "id": 63, "lease": tok}), 63, True)


def test_lease_or_lease_ms_twice_is_bad_request(conn):
    """A field given twice is bad_request, as id, op and attrs are (the framing cases above),
    and neither value takes effect: the lease (None below) keeps its slot and its expiry."""
    def case(op, field, first, second):
        def send(tok):
            if field == "lease":
                pairs = [("op", op), ("id", 65), ("lease", first or tok), ("lease", second or tok)]
            else:
                pairs = [("op", op), ("id", 65), ("lease", tok), ("lease_ms", first), ("lease_ms", second)]
            r = conn.rt_body(raw_map(pairs))
            assert "error" in r, (op, field, first, second, r)
            assert_error(r, "bad_request", 65)
        return send
    twice = [("lease", "no-such-lease", None), ("lease", None, "no-such-lease"), ("lease", None, None),
             ("lease_ms", 300, 60000), ("lease_ms", 60000, 300)]
    expiries_unmoved(conn, {(op,) + t: case(op, *t) for op in ("release", "renew") for t in twice})


def test_release_of_a_renewed_lease_then_renew_again(conn):
    """Renewed, then released: released true once and the slot is free; a renew after it is
    renewed false (the lease is gone, not brought back) and the slot stays free."""
    attrs, tok = take_lease(conn)
    assert_renewed(conn.rt({"op": "renew", "id": 70, "lease": tok, "lease_ms": 5000}), 70, True, 5000)
    assert_renewed(conn.rt({"op": "renew", "id": 71, "lease": tok, "lease_ms": 4000}), 71, True, 4000)
    assert held(conn, attrs) == 1
    assert_released(conn.rt({"op": "release", "id": 72, "lease": tok}), 72, True)
    assert held(conn, attrs) == 0
    assert_renewed(conn.rt({"op": "renew", "id": 73, "lease": tok, "lease_ms": 5000}), 73, False)
    assert_renewed(conn.rt({"op": "renew", "id": 74, "lease": tok}), 74, False)
    assert held(conn, attrs) == 0
    assert_released(conn.rt({"op": "release", "id": 75, "lease": tok}), 75, False)
    # the freed slot is taken again by a new lease, which the old one does not name
    attrs2 = dict(attrs)
    r = assert_check(conn.rt({"op": "check", "id": 76, "attrs": attrs2}), 76)
    assert r["allowed"] and r["lease"] != tok
    assert_released(conn.rt({"op": "release", "id": 77, "lease": tok}), 77, False)
    assert held(conn, attrs) == 1
    assert_released(conn.rt({"op": "release", "id": 78, "lease": r["lease"]}), 78, True)


def test_pipelined_renew_release_check_of_one_lease(conn):
    """One write: renew, check, release, renew, release, check, a renew of the wrong type, a
    malformed frame, a release. Each answered once, in order, with its id, and each as if
    sent alone."""
    attrs, tok = take_lease(conn)
    ask = {"op": "check", "attrs": attrs, "cost": 0}
    conn.s.sendall(frames({"op": "renew", "id": 80, "lease": tok, "lease_ms": 4000}, dict(ask, id=81),
                          {"op": "release", "id": 82, "lease": tok}, {"op": "renew", "id": 83, "lease": tok},
                          {"op": "release", "id": 84, "lease": tok}, dict(ask, id=85),
                          {"op": "renew", "id": 86, "lease": tok, "lease_ms": -5})
                   + struct.pack(">I", 3) + b"abc" + frames({"op": "release", "id": 87, "lease": tok}))
    assert_renewed(conn.recv(), 80, True, 4000)
    assert assert_check(conn.recv(), 81)["rules"][0]["remaining"] == 1
    assert_released(conn.recv(), 82, True)
    assert_renewed(conn.recv(), 83, False)
    assert_released(conn.recv(), 84, False)
    assert assert_check(conn.recv(), 85)["rules"][0]["remaining"] == 2
    assert_error(conn.recv(), "bad_request", 86)
    assert_error(conn.recv(), "bad_request", 0)
    assert_released(conn.recv(), 87, False)


def test_pipelined_leases_taken_renewed_and_released_in_one_write_each(conn):
    """Fifty users' two leases taken in one write, renewed in the next (the second of each
    with a wrong lease_ms), released in a third in reverse order, each answered in order
    with its id."""
    users = [uniq() for _ in range(50)]
    conn.s.sendall(frames(*({"op": "check", "id": 1000 + i, "attrs": {"path": "/exports/1", "user": users[i // 2]}}
                            for i in range(100))))
    toks = []
    for i in range(100):
        r = assert_check(conn.recv(), 1000 + i)
        assert r["allowed"] and r["lease"] not in toks, r
        toks.append(r["lease"])
    conn.s.sendall(frames(*({"op": "renew", "id": 2000 + i, "lease": t, "lease_ms": 3000 if i % 2 == 0 else 1.5}
                            for i, t in enumerate(toks))))
    for i in range(100):
        r = conn.recv()
        if i % 2 == 0:
            assert_renewed(r, 2000 + i, True, 3000)
        else:
            assert_error(r, "bad_request", 2000 + i)
    conn.s.sendall(frames(*({"op": "release", "id": 3000 + i, "lease": toks[i]} for i in reversed(range(100)))))
    for i in reversed(range(100)):
        assert_released(conn.recv(), 3000 + i, True)
    assert all(held(conn, {"path": "/exports/1", "user": u}) == 0 for u in users[:5])


def test_lease_from_another_connection(conn, daemon):
    """PROTOCOL.md does not say whether only the connection that took a lease may release or
    renew it. Whatever the answer, it agrees with the slot. What it does say: the lease holds
    until released, expired or its connection closed, so the other connection closing
    frees nothing, and the lease's own closing frees it, renewed or not."""
    owner = Conn(daemon.socket)
    other = Conn(daemon.socket)
    try:
        attrs, tok = take_lease(owner)
        r = other.rt({"op": "renew", "id": 90, "lease": tok, "lease_ms": 5000})
        renewed = assert_release_or_renew_answer(r, 90, "renew")
        assert held(conn, attrs) == 1
        other.close()
        time.sleep(0.2)  # the daemon's reading of the close, were it to free the lease
        assert held(conn, attrs) == 1, "a connection that did not take the lease closed, and it was freed (renewed: %s)" % renewed
        owner.close()
        wait_freed(conn, attrs, "a lease renewed from another connection outlived its own connection's close")

        owner = Conn(daemon.socket)
        attrs, tok = take_lease(owner)
        other = Conn(daemon.socket)
        released = assert_release_or_renew_answer(other.rt({"op": "release", "id": 91, "lease": tok}), 91, "release")
        assert held(conn, attrs) == (0 if released else 1)
        assert_released(owner.rt({"op": "release", "id": 92, "lease": tok}), 92, not released)
    finally:
        owner.close()
        other.close()


def test_lease_from_another_daemon_is_unknown(conn, daemon, binary):
    """A lease another daemon issued (a second sidecar, or this one before a restart) is not
    one this daemon issued: released and renewed false, and neither daemon's lease moves.
    With a Redis store the two daemons share it, and PROTOCOL.md does not say whether a
    lease is known to every daemon on one store: there the answer must only agree with the
    slot."""
    attrs, tok = take_lease(conn)
    other = Daemon(binary)
    try:
        oc = Conn(other.socket)
        oattrs, otok = take_lease(oc)
        if otok == tok:
            pytest.fail("two daemons issued the same lease %r" % tok)
        r = conn.rt({"op": "release", "id": 93, "lease": otok})
        rr = conn.rt({"op": "renew", "id": 94, "lease": otok, "lease_ms": 60000})
        if WITH_REDIS:
            assert_release_or_renew_answer(r, 93, "release")
            assert_release_or_renew_answer(rr, 94, "renew")
        else:
            assert_released(r, 93, False)
            assert_renewed(rr, 94, False)
            assert held(oc, oattrs) == 1
            assert_released(oc.rt({"op": "release", "id": 95, "lease": otok}), 95, True)
            # and the other way: this daemon's lease on the other
            assert_released(oc.rt({"op": "release", "id": 96, "lease": tok}), 96, False)
        assert held(conn, attrs) == 1
        assert_released(conn.rt({"op": "release", "id": 97, "lease": tok}), 97, True)
        oc.close()
    finally:
        other.stop()


# -- pipelining ------------------------------------------------------------------------

def test_pipelining_1000_deep_in_order(conn):
    frames, want = [], []
    for i in range(1, 1001):
        k = i % 5
        if k == 0:
            frames.append({"op": "ping", "id": i}); want.append((i, "version"))
        elif k == 1:
            frames.append({"op": "check", "id": i, "attrs": api(user=uniq(), ip=uniq("ip"))}); want.append((i, "allowed"))
        elif k == 2:
            frames.append({"op": "frob", "id": i}); want.append((i, "error"))
        elif k == 3:
            frames.append([i]); want.append((0, "error"))
        else:
            frames.append({"op": "release", "id": i, "lease": "x"}); want.append((i, "released"))
    conn.s.sendall(b"".join(struct.pack(">I", len(b)) + b for b in (msgpack.packb(f) for f in frames)))
    for rid, field in want:
        r = conn.recv()
        assert r["id"] == rid and field in r, (rid, field, r)


def test_many_connections_each_in_order(daemon):
    errors = []

    def client(n):
        c = Conn(daemon.socket)
        try:
            c.s.sendall(b"".join(struct.pack(">I", len(b)) + b for b in
                                 (msgpack.packb({"op": "check", "id": i, "attrs": api(user="m%d" % n)}) for i in range(100))))
            ids = [c.recv()["id"] for _ in range(100)]
            if ids != list(range(100)):
                errors.append((n, ids[:5]))
        except Exception as e:  # reported below
            errors.append((n, repr(e)))
        finally:
            c.close()
    ts = [threading.Thread(target=client, args=(n,)) for n in range(32)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert not errors


def test_nil_attrs_and_limits_are_none(conn):
    r = assert_check(conn.rt({"op": "check", "id": 21, "attrs": None, "limits": None}), 21)
    assert r["allowed"] and r["rule"] == "" and r["rules"] == []
