"""rlsidecar: the Python client of the rlsidecar rate-limiter daemon.

It asks the sidecar over its Unix socket whether a request may pass (protocol v1,
msgpack frames) and turns the answer into HTTP headers and a 429 or 503:

    client = rlsidecar.Client("/run/rlsidecar/rlsidecar.sock")
    d = client.check({"user": "alice", "path": "/v1/holds"})
    if not d.allowed:
        status, headers, body = d.rejection()

Client is the blocking client (a pool of kept-alive connections), AsyncClient the asyncio
one (checks pipelined over one connection); WSGIMiddleware and ASGIMiddleware do it for a
whole app. When the sidecar gives no answer in time, a check returns the on_unavailable
decision ("open" or "closed"), marked degraded, instead of raising.
"""

from ._path import clean_path, normalize_path, path_attr
from ._proto import MAX_FRAME, PROTOCOL, ClosedError, ProtocolError, RequestTooLargeError
from .aio import AsyncClient
from .client import Client
from .decision import COST_EXCEEDS_CAPACITY, PROBLEM_TYPE, REQUEST_TOO_LARGE, Decision, RuleDecision
from .middleware import ASGIMiddleware, WSGIMiddleware, asgi_attrs, asgi_header, peer_ip, wsgi_attrs, wsgi_header

__version__ = "0.1.0"

__all__ = ["MAX_FRAME", "PROTOCOL", "ClosedError", "ProtocolError", "RequestTooLargeError", "AsyncClient", "Client",
           "COST_EXCEEDS_CAPACITY", "REQUEST_TOO_LARGE",
           "PROBLEM_TYPE", "Decision", "RuleDecision", "ASGIMiddleware", "WSGIMiddleware", "asgi_attrs", "wsgi_attrs", "asgi_header", "wsgi_header",
           "peer_ip", "normalize_path", "clean_path", "path_attr"]
