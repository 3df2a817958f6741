"""The shared protocol vectors (proto/testdata/vectors.json): byte-exact encoding of
requests, decoding of answers, and the exchanges against the real daemon."""

import json
import os
import socket

import pytest

import rlsidecar
from rlsidecar import _proto

from conftest import ROOT, Daemon

with open(os.path.join(ROOT, "proto", "testdata", "vectors.json")) as f:
    VECTORS = json.load(f)


def test_protocol_version():
    assert VECTORS["protocol"] == rlsidecar.PROTOCOL


def request_frame(m):
    if m["op"] == "ping":
        return _proto.encode({"id": m["id"], "op": "ping"})
    return _proto.encode(_proto.check_message(m["id"], dict(m.get("attrs", [])), m.get("cost", 1), m.get("limits")))


@pytest.mark.parametrize("v", VECTORS["requests"], ids=lambda v: v["name"])
def test_request_encoding(v):
    assert request_frame(v["message"]).hex() == v["hex"], v["meaning"]


@pytest.mark.parametrize("v", VECTORS["requests"], ids=lambda v: v["name"])
def test_request_frame_with_its_id(v):
    """The clients encode a request once with id 0 (_proto.body) and put each connection's
    id in (_proto.frame): the same bytes."""
    m = v["message"]
    zero = dict(m, id=0)
    b = request_frame(zero)[4:]
    assert _proto.body(_proto.decode(b)) == b
    assert _proto.frame(b, m["id"]).hex() == v["hex"]


@pytest.mark.parametrize("v", VECTORS["responses"], ids=lambda v: v["name"])
def test_response_decoding(v):
    frame = bytes.fromhex(v["hex"])
    assert _proto.frame_length(frame[:4]) == len(frame) - 4
    msg = _proto.decode(frame[4:])
    assert msg == v["message"], v["meaning"]
    want = v["message"]
    if "allowed" in want:
        d = _proto.decision(msg)
        assert (d.allowed, d.rule, d.limit, d.remaining, d.reset_ms, d.retry_after_ms, d.degraded, d.reason) == (
            want["allowed"], want["rule"], want["limit"], want["remaining"], want["reset_ms"], want["retry_after_ms"],
            want["degraded"], want.get("reason", ""))
        assert [(r.name, r.limit, r.window_ms, r.remaining, r.reset_ms, r.retry_after_ms, r.allowed, r.shadow, r.reason)
                for r in d.rules] == [
            (r["name"], r["limit"], r["window_ms"], r["remaining"], r["reset_ms"], r["retry_after_ms"], r["allowed"],
             r["shadow"], r.get("reason", "")) for r in want["rules"]]
    elif "error" in want:
        assert _proto.error_of(msg) == (want["error"]["code"], want["error"]["message"])


def test_exchanges_through_the_client(binary, short_tmp):
    """Each exchange's request, sent by the client's check(), gets the decision of the
    recorded answer (ids aside: the client numbers its own requests)."""
    with open(os.path.join(ROOT, "proto", "testdata", "rules.yaml")) as f:
        d = Daemon(binary, f.read(), short_tmp)
    try:
        client = rlsidecar.Client(d.socket, timeout=2)
        raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        raw.connect(d.socket)
        raw.settimeout(2)
        for ex in VECTORS["exchanges"]:
            req = _proto.decode(bytes.fromhex(ex["request_hex"])[4:])
            want = _proto.decode(bytes.fromhex(ex["response_hex"])[4:])
            if req["op"] != "check":
                raw.sendall(bytes.fromhex(ex["request_hex"]))
                got = raw.recv(65536)
                assert got.hex() == ex["response_hex"], ex["name"]
                continue
            args = (dict(req.get("attrs") or {}), req.get("cost", 1), req.get("limits"))
            if "error" in want:
                with pytest.raises(rlsidecar.ProtocolError) as e:
                    client.check(*args)
                assert (e.value.code, e.value.message) == _proto.error_of(want), ex["name"]
                assert e.value.decision.allowed and e.value.decision.degraded and not e.value.decision.unreachable
                continue
            got = client.check(*args)
            assert got.__class__ is rlsidecar.Decision
            wd = _proto.decision(want)
            assert repr(got) == repr(wd), ex["name"] + ": " + ex["meaning"]
        raw.close()
        client.close()
    finally:
        d.stop()
