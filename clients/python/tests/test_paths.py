"""The path attribute (clients/testdata/paths.json): normalize_path on every case's raw
target, clean_path on the path a server has decoded, and the WSGI and ASGI default
attributes, which take the raw target when the server gives it and the decoded path
otherwise. Then, against the real daemon, one rule on /fast limits every spelling."""

import asyncio
import json
import os
import urllib.parse

import pytest

import rlsidecar

from conftest import ROOT
from test_middleware import asgi_get, hello_app, hello_asgi, wsgi_get

with open(os.path.join(ROOT, "clients", "testdata", "paths.json")) as f:
    TABLE = json.load(f)

# raw target (bytes), the path attribute's bytes; JSON strings stand for bytes: U+0000 to
# U+00FF are the bytes 0x00 to 0xFF.
CASES = [(c["raw"].encode("ascii"), c["path"].encode("latin-1")) for c in TABLE["cases"]]
IDS = [c["raw"] or "(empty)" for c in TABLE["cases"]]


def decoded(raw):
    """The path a server hands the app: the target up to "?" or "#", %XX decoded once."""
    return urllib.parse.unquote_to_bytes(raw.split(b"?")[0].split(b"#")[0])


def as_attr(path):
    return rlsidecar.path_attr(path)


def test_the_table_is_there():
    assert len(CASES) > 30


@pytest.mark.parametrize("raw, want", CASES, ids=IDS)
def test_normalize_path(raw, want):
    assert rlsidecar.normalize_path(raw) == want
    # Its bytes percent-encoded where they would mean something else, it is a fixed point.
    again = b"".join(b"%%%02X" % c if c in b"%?#" else bytes([c]) for c in want)
    assert rlsidecar.normalize_path(again) == want


@pytest.mark.parametrize("raw, want", CASES, ids=IDS)
def test_clean_path_of_the_decoded_path(raw, want):
    """What a server decoded already is not decoded again: only slashes are merged and
    dot segments removed, which gives the same path."""
    assert rlsidecar.clean_path(decoded(raw)) == want


def test_absolute_form_and_bad_types():
    for raw, want in [(b"http://example.com/f%61st?x", b"/fast"), (b"HTTPS://example.com", b"/"),
                      (b"http://example.com//a/../b", b"/b"), (b"/http://x/a", b"/http:/x/a")]:
        assert rlsidecar.normalize_path(raw) == want, raw
    assert rlsidecar.clean_path(b"//a/%2e%2e/./b/../c?d") == b"/a/%2e%2e/c?d"
    # A WSGI server without RAW_URI / REQUEST_URI (wsgiref) puts an absolute-form target
    # in PATH_INFO as it came: counted from its path (it was "/http:/h/abs/p").
    env = {"REQUEST_METHOD": "GET", "SCRIPT_NAME": "", "PATH_INFO": "http://h/abs/p"}
    assert rlsidecar.wsgi_attrs(env)["path"] == "/abs/p"
    assert rlsidecar.wsgi_attrs(dict(env, PATH_INFO="/http://h/abs/p"))["path"] == "/http:/h/abs/p"
    with pytest.raises(TypeError):
        rlsidecar.normalize_path("/fast")
    with pytest.raises(TypeError):
        rlsidecar.clean_path("/fast")


@pytest.mark.parametrize("raw, want", CASES, ids=IDS)
def test_wsgi_attrs(raw, want):
    # PATH_INFO as PEP 3333 has it: the decoded bytes as latin-1; deliberately not the
    # same path, so that the raw target is seen to win when the server gives it.
    env = {"REQUEST_METHOD": "GET", "REMOTE_ADDR": "192.0.2.1", "SCRIPT_NAME": "", "PATH_INFO": "/other"}
    for key in ("RAW_URI", "REQUEST_URI") if raw else ():  # an empty one counts as none
        assert rlsidecar.wsgi_attrs(dict(env, **{key: raw.decode("latin-1")}))["path"] == as_attr(want), key
    # Without the raw target: SCRIPT_NAME + PATH_INFO, normalized without decoding again.
    path = decoded(raw).decode("latin-1")
    for split in (0, min(2, len(path))):
        env = dict(env, SCRIPT_NAME=path[:split], PATH_INFO=path[split:])
        assert rlsidecar.wsgi_attrs(env)["path"] == as_attr(want)


@pytest.mark.parametrize("raw, want", CASES, ids=IDS)
def test_asgi_attrs(raw, want):
    scope = {"type": "http", "method": "GET", "client": ("192.0.2.1", 1), "path": "/other"}
    if raw:  # an empty one counts as none
        assert rlsidecar.asgi_attrs(dict(scope, raw_path=raw))["path"] == as_attr(want)
    # raw_path is optional in ASGI: then the decoded path (UTF-8), not decoded again.
    try:
        path = decoded(raw).decode("utf-8")
    except UnicodeDecodeError:
        return  # no str stands for these bytes
    assert rlsidecar.asgi_attrs(dict(scope, path=path))["path"] == as_attr(want)
    assert rlsidecar.asgi_attrs(dict(scope, path=path, raw_path=None))["path"] == as_attr(want)


RULES_FAST = """
rules:
  - name: fast
    match: { path: /fast }
    key: ip
    limit: { requests: 6, per: 60s }
"""


def test_one_rule_limits_every_spelling(make_daemon):
    """WSGI (raw target or PATH_INFO) and ASGI (raw_path or path) count /fast, /f%61st,
    //fast, /./fast ... against the one rule on /fast."""
    d = make_daemon(RULES_FAST)
    remaining = []
    with rlsidecar.Client(d.socket, timeout=2) as client:
        app = rlsidecar.WSGIMiddleware(hello_app, client)
        for env in ({"RAW_URI": "/f%61st?x=1"}, {"REQUEST_URI": "//fast"}, {"PATH_INFO": "/./fast"}):
            status, headers, _ = wsgi_get(app, env.pop("PATH_INFO", "/not-this"), **env)
            remaining.append((status, headers.get("ratelimit")))

    async def main():
        async with rlsidecar.AsyncClient(d.socket, timeout=2) as client:
            app = rlsidecar.ASGIMiddleware(hello_asgi, client)
            for path, scope in (("/not-this", {"raw_path": b"/a/%2e%2E/fast"}), ("/a/../fast", {}),
                                ("/fast/../fast", {}), ("/not-this", {"raw_path": b"/%66ast"})):
                status, headers, _ = await asgi_get(app, path, **scope)
                remaining.append((status, headers.get("ratelimit")))
    asyncio.run(main())
    assert [s for s, _ in remaining] == [200] * 6 + [429]
    assert [h.split(";t=")[0] for _, h in remaining] == ['"fast";r=%d' % n for n in (5, 4, 3, 2, 1, 0, 0)]
