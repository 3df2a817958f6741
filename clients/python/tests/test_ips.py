"""The ip attribute (clients/testdata/ips.json): peer_ip, and the WSGI and ASGI default
attributes, on every case; then, end to end, an IPv4 client of a WSGI server bound to
"::" (dual-stack, where REMOTE_ADDR is "::ffff:127.0.0.1") limited by the real daemon
under its IPv4 address, as the Go client and nginx count it."""

import json
import os
import socket
import threading
import urllib.error
import urllib.request
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import pytest

import rlsidecar

from conftest import ROOT
from test_middleware import hello_app

with open(os.path.join(ROOT, "clients", "testdata", "ips.json")) as f:
    CASES = [(c["peer"], c["ip"]) for c in json.load(f)["cases"]]


def test_the_table_is_there():
    assert len(CASES) >= 10


@pytest.mark.parametrize("peer, want", CASES, ids=[c[0] or "(empty)" for c in CASES])
def test_peer_ip(peer, want):
    assert rlsidecar.peer_ip(peer) == want
    wsgi = rlsidecar.wsgi_attrs({"REMOTE_ADDR": peer, "REQUEST_METHOD": "GET", "PATH_INFO": "/"})
    asgi = rlsidecar.asgi_attrs({"client": (peer, 5555), "method": "GET", "path": "/"})
    if peer == "":  # no peer address: ip left out, not sent as ""
        assert "ip" not in wsgi and "ip" not in asgi
        return
    assert wsgi["ip"] == want and asgi["ip"] == want


class _DualStack(WSGIServer):
    address_family = socket.AF_INET6

    def server_bind(self):
        self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        super().server_bind()


class _Quiet(WSGIRequestHandler):
    def log_message(self, *args):
        pass


def test_ipv4_client_of_a_dual_stack_server(make_daemon):
    if not socket.has_ipv6:
        pytest.skip("no IPv6 here")
    d = make_daemon("""
rules:
  - name: loopback-v4
    match: { ip: 127.0.0.1 }
    key: ip
    limit: { requests: 1, per: 60s }
""")
    client = rlsidecar.Client(d.socket, timeout=2)
    try:
        srv = make_server("::", 0, rlsidecar.WSGIMiddleware(hello_app, client), server_class=_DualStack,
                          handler_class=_Quiet)
    except OSError as e:
        client.close()
        pytest.skip("cannot bind a dual-stack socket: %s" % e)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        url = "http://127.0.0.1:%d/" % srv.server_port
        with urllib.request.urlopen(url, timeout=10) as r:
            assert r.status == 200
            assert r.headers["RateLimit"] == '"loopback-v4";r=0;t=60'
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(url, timeout=10)
        assert e.value.code == 429
    finally:
        srv.shutdown()
        srv.server_close()
        t.join(10)
        client.close()
