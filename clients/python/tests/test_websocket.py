"""ASGIMiddleware and WebSocket handshakes, under real servers (Uvicorn, Hypercorn) and the
real daemon: a rule on a path applies to a WebSocket handshake to that path (a GET), as
it does in the Go middleware and nginx. Before, websocket scopes passed through
unchecked: four handshakes to /login under a limit of 2 all got 101."""

import base64
import os
import socket
import subprocess
import sys
import time

import pytest

from conftest import ROOT

HERE = os.path.dirname(os.path.abspath(__file__))

with open(os.path.join(ROOT, "clients", "testdata", "websocket_rules.yaml")) as f:
    RULES = f.read()

SERVERS = {
    "uvicorn": ["-m", "uvicorn", "ws_app:app", "--ws", "wsproto", "--host", "127.0.0.1", "--port"],
    "hypercorn": ["-m", "hypercorn", "ws_app:app", "--bind"],
}


def _has(module):
    try:
        __import__(module)
        return True
    except ImportError:
        return False


def _free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _serve(name, sidecar_socket):
    port = _free_port()
    args = SERVERS[name] + [("127.0.0.1:%d" % port) if name == "hypercorn" else str(port)]
    env = dict(os.environ, RLS_SOCKET=sidecar_socket,
               PYTHONPATH=os.pathsep.join([HERE, os.path.join(HERE, "..")]))
    proc = subprocess.Popen([sys.executable] + args, cwd=HERE, env=env,
                            stdout=subprocess.DEVNULL, stderr=None if os.environ.get("WS_DEBUG") else subprocess.DEVNULL)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, port
        except OSError:
            if proc.poll() is not None:
                break
            time.sleep(0.05)
    proc.kill()
    proc.wait()
    raise RuntimeError("%s did not start" % name)


def handshake(port, path):
    """Opens a WebSocket handshake to path; returns (status, headers, socket): the socket
    stays open (a session, when the status is 101)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    key = base64.b64encode(os.urandom(16)).decode()
    s.sendall(("GET %s HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
               "Sec-WebSocket-Key: %s\r\nSec-WebSocket-Version: 13\r\n\r\n" % (path, port, key)).encode())
    buf = b""
    while b"\r\n\r\n" not in buf:
        got = s.recv(4096)
        if not got:
            break
        buf += got
    head = buf.split(b"\r\n\r\n", 1)[0].decode("latin-1").split("\r\n")
    status = int(head[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in head[1:] if ":" in line)}
    return status, headers, s


def close_session(s):
    """Ends a WebSocket session as a browser does: a close frame (code 1000, masked), then
    the connection. (Uvicorn 0.17 tells the app nothing of a connection closed without
    one: the app, and so its lease, would go on.)"""
    mask = os.urandom(4)
    payload = (1000).to_bytes(2, "big")
    s.sendall(bytes([0x88, 0x80 | len(payload)]) + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload)))
    s.settimeout(5)
    try:
        while s.recv(4096):
            pass
    except OSError:
        pass
    s.close()


@pytest.mark.parametrize("server", sorted(SERVERS))
def test_websocket_handshakes_are_checked(server, make_daemon):
    if not _has(server) or not _has("wsproto"):  # uvicorn --ws wsproto; hypercorn's own
        pytest.skip("%s (with wsproto) is not installed" % server)
    d = make_daemon(RULES)
    proc, port = _serve(server, d.socket)
    socks = []
    try:
        got = []
        for _ in range(4):
            status, headers, s = handshake(port, "/login")
            socks.append(s)
            got.append((status, headers))
        assert [st for st, _ in got[:2]] == [101, 101]
        assert all("ratelimit" in h or "ratelimit-remaining" in h for _, h in got[:2]), got[:2]
        if server == "hypercorn":
            # The server offers websocket.http.response: a real 429, as for HTTP.
            assert [st for st, _ in got[2:]] == [429, 429]
            assert all("retry-after" in h for _, h in got[2:])
        else:
            # No such extension (uvicorn 0.17): a websocket.close, which the server answers 403.
            assert [st for st, _ in got[2:]] == [403, 403]

        # A concurrency rule: the lease is held (renewed) for the session's life, and
        # released when it ends.
        status, _, chat = handshake(port, "/chat")
        assert status == 101
        time.sleep(5)  # more than twice the 2 s lease: held by renewals, not by its expiry
        status, _, other = handshake(port, "/chat")
        other.close()
        assert status in (403, 429), "a second session while the first lasts is refused"
        close_session(chat)
        deadline = time.monotonic() + 10
        while True:
            status, _, again = handshake(port, "/chat")
            socks.append(again)
            if status == 101 or time.monotonic() > deadline:
                break
            again.close()
            time.sleep(0.05)
        assert status == 101, "the slot is free once the session ended"
    finally:
        for s in socks:
            s.close()
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
