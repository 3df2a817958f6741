"""The shared HTTP table (clients/testdata/http_headers.json): headers, status and the
problem+json body of every case, as the Go client makes them."""

import json
import os

import pytest

from rlsidecar import Decision, RuleDecision, _proto

from conftest import ROOT

with open(os.path.join(ROOT, "clients", "testdata", "http_headers.json")) as f:
    CASES = json.load(f)


def decision_of(c):
    d = c["decision"]
    rules = [RuleDecision(r["name"], r["limit"], r["window_ms"], r["remaining"], r["reset_ms"], r["retry_after_ms"],
                          r["allowed"], r["shadow"], warning=r.get("warning", False), unasked=r.get("unasked", False),
                          concurrency=r.get("concurrency", False)) for r in d["rules"]]
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


with open(os.path.join(ROOT, "clients", "testdata", "problem_bodies.json"), encoding="utf-8") as f:
    BODIES = json.load(f)


@pytest.mark.parametrize("c", BODIES, ids=lambda c: c["name"])
def test_problem_bodies(c):
    """Every case of clients/testdata/problem_bodies.json, status and body byte for byte as
    the Go client's WriteRejection writes them. (Before, only the Go and Lua clients read
    the file: this client's bodies were checked against a few cases written here.)"""
    d = decision_of(c)
    if c["unreachable"]:
        d.unreachable, d.degraded, d.cause = True, True, "connecting: refused"
    status, headers, body = d.rejection()
    assert (status, body.decode("utf-8")) == (c["status"], c["body"]), c["meaning"]
    h = lower(headers)
    for k, v in c["headers"].items():
        assert h.get(k.lower()) == v, (c["name"], k)


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


# A refused check's answer, as the daemon encodes it (proto.Encoder.EncodeCheck): per-ip
# refused; per-account left unasked (refused before its store was asked), its remaining 0
# and reset_ms 0 not read.
UNASKED_FRAME = bytes.fromhex(
    "0000011d89a2696401a7616c6c6f776564c2a472756c65a67065722d6970a56c696d697402a972656d61696e696e6700a872657365745f6d73"
    "cd7530ae72657472795f61667465725f6d73cd38a4a86465677261646564c2a572756c65739288a46e616d65a67065722d6970a56c696d6974"
    "02a977696e646f775f6d73cdea60a972656d61696e696e6700a872657365745f6d73cd7530ae72657472795f61667465725f6d73cd38a4a761"
    "6c6c6f776564c2a6736861646f77c289a46e616d65ab7065722d6163636f756e74a56c696d697405a977696e646f775f6d73ce0036ee80a972"
    "656d61696e696e6700a872657365745f6d7300ae72657472795f61667465725f6d7300a7616c6c6f776564c3a6736861646f77c2a7756e6173"
    "6b6564c3")


def test_unasked_rule_left_out():
    """An unasked rule is exposed as such, keeps its RateLimit-Policy item (its quota is
    known) and has no RateLimit item: "r=0;t=0" would say it has nothing left."""
    d = _proto.decision(_proto.decode(UNASKED_FRAME[4:]))
    assert [(r.name, r.unasked) for r in d.rules] == [("per-ip", False), ("per-account", True)]
    assert d.headers() == {"RateLimit-Policy": '"per-ip";q=2;w=60, "per-account";q=5;w=3600',
                           "RateLimit": '"per-ip";r=0;t=15',
                           "Retry-After": "15"}


with open(os.path.join(ROOT, "proto", "testdata", "vectors.json")) as f:
    LEASES = {v["name"]: v for v in json.load(f)["lease_responses"]}


@pytest.mark.parametrize("name,headers", [
    ("check-lease", {"RateLimit-Policy": '"exports";q=2;qu="concurrent-requests"', "RateLimit": '"exports";r=1'}),
    ("check-lease-refused", {"RateLimit-Policy": '"exports";q=2;qu="concurrent-requests"',
                             "RateLimit": '"exports";r=0;t=1', "Retry-After": "1"}),
])
def test_concurrency_rule(name, headers):
    """The lease vectors (proto/testdata/vectors.json): a concurrency rule's entry says
    concurrency: true; its items are a quota of concurrent requests with no window."""
    d = _proto.decision(_proto.decode(bytes.fromhex(LEASES[name]["hex"])[4:]))
    assert [(r.name, r.concurrency) for r in d.rules] == [("exports", True)]
    assert d.headers() == headers
    # A rate rule's entry is not one.
    assert [r.concurrency for r in _proto.decision(_proto.decode(UNASKED_FRAME[4:])).rules] == [False, False]


# A refused check's answer with Redis away, as the daemon encodes it: otp (global,
# on_store_failure: closed) refused by its failure policy, its entry degraded; per-ip,
# a local rule, decided as usual.
DEGRADED_FRAME = bytes.fromhex(
    "0000010f89a2696402a7616c6c6f776564c2a472756c65a36f7470a56c696d697405a972656d61696e696e6700a872657365745f6d7300ae"
    "72657472795f61667465725f6d73cd03e8a86465677261646564c3a572756c65739288a46e616d65a67065722d6970a56c696d697464a977"
    "696e646f775f6d73cdea60a972656d61696e696e6763a872657365745f6d73cd0258ae72657472795f61667465725f6d7300a7616c6c6f77"
    "6564c3a6736861646f77c289a46e616d65a36f7470a56c696d697405a977696e646f775f6d73cdea60a972656d61696e696e6700a8726573"
    "65745f6d7300ae72657472795f61667465725f6d73cd03e8a7616c6c6f776564c2a6736861646f77c2a86465677261646564c3")


def test_degraded_rule_exposed():
    """A rule decided by its failure policy is exposed as degraded."""
    d = _proto.decision(_proto.decode(DEGRADED_FRAME[4:]))
    assert d.degraded
    assert [(r.name, r.degraded) for r in d.rules] == [("per-ip", False), ("otp", True)]
