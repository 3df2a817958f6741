"""Fixtures: the real rlsidecar daemon, built once per session (or taken from
$RLSIDECAR_BIN), started per test on a temp socket with a temp rules file."""

import contextlib
import os
import shutil
import signal
import socketserver
import subprocess
import sys
import tempfile
import threading
import time

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "clients", "python"))

RULES = """
rules:
  - name: per-user
    key: user
    limit: { requests: 5, per: 60s }
  - name: login-per-ip
    match: { method: POST, path: /login }
    key: ip
    limit: { requests: 3, per: 60s }
"""


@pytest.fixture(scope="session")
def binary():
    path = os.environ.get("RLSIDECAR_BIN")
    if path:
        yield path
        return
    d = tempfile.mkdtemp(prefix="rls-py-bin")
    path = os.path.join(d, "rlsidecar")
    subprocess.run(["go", "build", "-o", path, "./cmd/rlsidecar"], cwd=ROOT, check=True)
    yield path
    shutil.rmtree(d, ignore_errors=True)


class Daemon:
    """A running `rlsidecar serve` on a temp socket; args are more flags for serve."""

    def __init__(self, binary, rules, tmp, args=()):
        self.dir = tmp
        self.socket = os.path.join(tmp, "s.sock")
        self.rules = os.path.join(tmp, "rules.yaml")
        with open(self.rules, "w") as f:
            f.write(rules)
        self.binary = binary
        self.args = list(args)
        self.proc = None
        self.start()

    def start(self):
        self.proc = subprocess.Popen([self.binary, "serve", "--socket", self.socket, "--admin=", "--config", self.rules]
                                     + self.args,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = []
        t = threading.Thread(target=lambda: line.append(self.proc.stdout.readline()))
        t.start()
        t.join(10)
        if not line or "listening on" not in line[0]:
            self.proc.kill()
            raise RuntimeError("daemon did not start: %r %s" % (line, self.proc.stderr.read()))
        # Drain the pipes so the daemon never blocks on them; its log is kept for admin().
        self.log = []
        threading.Thread(target=self.proc.stdout.read, daemon=True).start()
        threading.Thread(target=lambda: self.log.extend(iter(self.proc.stderr.readline, "")), daemon=True).start()

    def admin(self):
        """The admin endpoint's base URL, from the log of a daemon started with --admin."""
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            for line in list(self.log):
                if 'msg="admin endpoint"' in line:
                    return "http://" + line.split(" addr=", 1)[1].split()[0]
            time.sleep(0.01)
        raise RuntimeError("no admin endpoint in the log: %s" % "".join(self.log))

    def metric(self, sample):
        """The value of one sample of the admin endpoint's /metrics, 0 when absent."""
        import urllib.request
        with urllib.request.urlopen(self.admin() + "/metrics", timeout=5) as r:
            for line in r.read().decode().splitlines():
                if line.startswith(sample + " "):
                    return float(line.split()[-1])
        return 0.0

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait()

    def pause(self):
        """Stop the daemon (SIGSTOP) and wait until it is stopped: a stalled sidecar."""
        self.proc.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            with open("/proc/%d/stat" % self.proc.pid) as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "T":
                    return
            time.sleep(0.001)
        raise RuntimeError("the daemon did not stop")

    def resume(self):
        self.proc.send_signal(signal.SIGCONT)


@pytest.fixture
def short_tmp():
    d = tempfile.mkdtemp(prefix="rls")  # short: a Unix socket path is at most 107 bytes
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def daemon(binary, short_tmp):
    d = Daemon(binary, RULES, short_tmp)
    yield d
    d.stop()


@pytest.fixture
def make_daemon(binary):
    made = []

    def make(rules, args=()):
        tmp = tempfile.mkdtemp(prefix="rls")
        d = Daemon(binary, rules, tmp, args)
        made.append((d, tmp))
        return d

    yield make
    for d, tmp in made:
        d.stop()
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def wsgi_server(app, threaded=False):
    """Serves the WSGI app with wsgiref on a free loopback port, a thread per request when
    threaded, without request logs; yields the port, and stops the server on exit."""
    from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

    class Quiet(WSGIRequestHandler):
        def log_message(self, *args):
            pass

    server_class = WSGIServer
    if threaded:
        class Threaded(socketserver.ThreadingMixIn, WSGIServer):
            daemon_threads = True
        server_class = Threaded
    srv = make_server("127.0.0.1", 0, app, server_class=server_class, handler_class=Quiet)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield srv.server_port
    finally:
        srv.shutdown()
        srv.server_close()
        t.join(10)
