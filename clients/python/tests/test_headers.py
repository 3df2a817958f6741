"""The shared HTTP table (clients/testdata/http_headers.json): headers, status and the
problem+json body of every case, as the Go client makes them."""

import json
import os

import pytest

from rlsidecar import Decision, RuleDecision

from conftest import ROOT

with open(os.path.join(ROOT, "clients", "testdata", "http_headers.json")) as f:
    CASES = json.load(f)


def decision_of(c):
    d = c["decision"]
    rules = [RuleDecision(r["name"], r["limit"], r["window_ms"], r["remaining"], r["reset_ms"], r["retry_after_ms"],
                          r["allowed"], r["shadow"], warning=r.get("warning", False)) for r in d["rules"]]
    return Decision(d["allowed"], d["rule"], d["limit"], d["remaining"], d["reset_ms"], d["retry_after_ms"], False,
                    rules, d["reason"], warning=d.get("warning", False))


def lower(h):
    return {k.lower(): v for k, v in h.items()}


def test_table_is_there():
    assert len(CASES) >= 7


@pytest.mark.parametrize("c", CASES, ids=lambda c: c["name"])
def test_headers(c):
    d = decision_of(c)
    assert lower(d.headers()) == lower(c["headers"]), c["meaning"]
    assert d.status == c["status"]


@pytest.mark.parametrize("c", CASES, ids=lambda c: c["name"])
def test_rejection(c):
    d = decision_of(c)
    if c["status"] == 200:
        assert d.rejection() is None and d.problem() is None
        return
    status, headers, body = d.rejection()
    assert status == 429
    h = lower(headers)
    assert h.pop("content-type") == "application/problem+json"
    assert h.pop("content-length") == str(len(body))
    assert h == lower(c["headers"])
    p = json.loads(body)
    assert list(p) == ["type", "title", "status", "detail"] + (["rule"] if d.rule else []) + (
        ["retry_after"] if "Retry-After" in c["headers"] else [])
    assert (p["type"], p["title"], p["status"]) == ("about:blank", "Too Many Requests", 429)
    assert p.get("rule") == (d.rule or None)
    if "Retry-After" in c["headers"]:
        assert str(p["retry_after"]) == c["headers"]["Retry-After"]
        n = p["retry_after"]
        assert p["detail"].endswith("; retry in %d second%s." % (n, "" if n == 1 else "s"))
    else:
        assert p["detail"].endswith("can never pass under this limit.")


def test_body_bytes_as_go_writes_them():
    """Byte for byte the Go client's body (clients/go/README.md, HTTP mapping)."""
    d = Decision(False, "per-user", 5, 0, 60000, 11200, rules=[RuleDecision("per-user", 5, 60000, 0, 60000, 11200,
                                                                            False, False)])
    assert d.rejection()[2] == (b'{"type":"about:blank","title":"Too Many Requests","status":429,'
                                b'"detail":"This request exceeds rate limit \\"per-user\\"; retry in 12 seconds.",'
                                b'"rule":"per-user","retry_after":12}')
    # Go's strconv.Quote and encoding/json: a tab as \t, <>& escaped, Unicode kept.
    d = Decision(False, "a\t<b>&\u043a", 1, 0, 1000, 1000)
    assert d.rejection()[2] == ('{"type":"about:blank","title":"Too Many Requests","status":429,'
                                '"detail":"This request exceeds rate limit \\"a\\\\t\\u003cb\\u003e\\u0026\u043a\\"; '
                                'retry in 1 second.","rule":"a\\t\\u003cb\\u003e\\u0026\u043a","retry_after":1}'
                                ).encode()


def test_unreachable_closed_is_503():
    d = Decision(False, degraded=True, unreachable=True, cause="connecting: refused")
    status, headers, body = d.rejection()
    assert status == 503
    assert headers == {"Retry-After": "1", "Content-Type": "application/problem+json",
                       "Content-Length": str(len(body))}
    assert json.loads(body) == {"type": "about:blank", "title": "Service Unavailable", "status": 503,
                                "detail": "The rate limiter is unavailable and this service does not admit requests "
                                          "without it; retry in 1 second.", "retry_after": 1}
    assert d.headers() == {"Retry-After": "1"}


def test_unreachable_open_has_no_headers():
    d = Decision(True, degraded=True, unreachable=True, cause="connecting: refused")
    assert d.headers() == {} and d.rejection() is None and d.status == 200
