"""The README's examples run against the real daemon, and print what they say they print."""

import contextlib
import io
import os
import re

from conftest import ROOT

README = os.path.join(ROOT, "clients", "python", "README.md")


def test_readme_examples(daemon, monkeypatch):
    with open(README) as f:
        blocks = re.findall(r"```python\n(.*?)```", f.read(), re.S)
    assert len(blocks) == 2
    monkeypatch.setenv("RLSIDECAR_SOCKET", daemon.socket)
    out = io.StringIO()
    env = {}
    # The example's 50 ms timeout, 5 s here: the test machine may be loaded, and a timeout
    # would (rightly) print the unreachable decision instead.
    assert all("timeout=0.05" in b for b in blocks)
    blocks = [b.replace("timeout=0.05", "timeout=5") for b in blocks]
    with contextlib.redirect_stdout(out):
        for b in blocks:
            exec(compile(b, README, "exec"), env)
    printed = out.getvalue().splitlines()
    # Each print's "# ..." comment is what it prints.
    promised = [m.group(1).strip() for b in blocks for m in re.finditer(r"^\s*print\(.*?\)\s*#(.*)$", b, re.M)]
    assert printed == promised
    # The WSGI app of the example works (its socket is the production path: unreachable here).
    got = []
    body = env["wsgi_app"]({"REQUEST_METHOD": "GET", "PATH_INFO": "/", "REMOTE_ADDR": "192.0.2.1"},
                           lambda status, headers, exc_info=None: got.append(status))
    assert got == ["200 OK"] and b"".join(body) == b"hello"
