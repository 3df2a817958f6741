"""WSGI and ASGI middleware: check every request, answer 429/503 or pass it on with the
rate-limit headers — the same behaviour as the Go client's Middleware."""

import asyncio
import collections.abc
import threading
import time

from ._path import _ABSOLUTE, clean_path, normalize_path, path_attr
from ._proto import ClosedError, ProtocolError
from .decision import Decision


def peer_ip(addr):
    """The ip attribute every rlsidecar client sends for a peer address (without a port):
    addr itself, except that an IPv4-mapped IPv6 address ("::ffff:" before a dotted quad)
    is sent as the IPv4 address it maps. An IPv4 client of a server bound to "::"
    (dual-stack) has that form, "::ffff:203.0.113.7", which the Go client and nginx send as
    "203.0.113.7": one form, one key per client whichever gateway asks
    (clients/testdata/ips.json)."""
    if addr[:7].lower() == "::ffff:":
        quad = addr[7:].split(".")
        if len(quad) == 4 and all(q.isdigit() and q.isascii() and (q == "0" or q[0] != "0") and len(q) <= 3
                                  and int(q) <= 255 for q in quad):
            return addr[7:]
    return addr


def wsgi_attrs(environ):
    """The default attributes of a WSGI request: ip (REMOTE_ADDR, as peer_ip gives it),
    method, path.

    The path is normalized as every rlsidecar client does (normalize_path): from the raw
    request target when the server gives it (RAW_URI: gunicorn; REQUEST_URI: uWSGI,
    mod_wsgi, werkzeug), else from SCRIPT_NAME + PATH_INFO, which the server decoded
    already and which is not decoded again (clean_path). Either way it is the bytes the
    client sent (PATH_INFO's latin-1 characters encoded back), as path_attr gives them.
    """
    raw = environ.get("RAW_URI") or environ.get("REQUEST_URI")
    if raw:
        path = normalize_path(_wsgi_bytes(raw))
    else:
        decoded = _wsgi_bytes(environ.get("SCRIPT_NAME", "") + environ.get("PATH_INFO", ""))
        # A target in absolute form (http://host/a, as a proxy sends it) that the server
        # put in PATH_INFO as it came (wsgiref does): counted from its path, as nginx does.
        m = _ABSOLUTE.match(decoded)
        if m is not None:
            decoded = decoded[m.end():]
        path = clean_path(decoded)
    attrs = {"method": environ.get("REQUEST_METHOD", ""), "path": path_attr(path)}
    addr = environ.get("REMOTE_ADDR")
    if addr:  # else left out, not sent as "": every such request would share one per-ip bucket
        attrs = {"ip": peer_ip(addr), **attrs}
    return attrs


def wsgi_header(environ, name):
    """The value of request header ``name`` (e.g. "X-User") for an attribute, or None
    when the request has none: its bytes as the client sent them, a str when they are
    UTF-8 (else bytes, sent as a msgpack bin), as the Go and Lua clients send a header.
    ``environ.get("HTTP_X_USER")`` is those bytes read as latin-1 (PEP 3333): sent as
    it is, a non-ASCII value reaches the daemon as other bytes (X-User: café as
    "cafÃ©"), another key than through any other gateway. Content-Type and
    Content-Length are CONTENT_TYPE and CONTENT_LENGTH in the environ (PEP 3333), without
    HTTP_."""
    key = name.upper().replace("-", "_")
    v = environ.get(key if key in ("CONTENT_TYPE", "CONTENT_LENGTH") else "HTTP_" + key)
    if v is None:
        return None
    return path_attr(_wsgi_bytes(v))


def asgi_header(scope, name):
    """The value of request header ``name`` in an ASGI scope, for an attribute, or None:
    as wsgi_header (several lines of it joined with ", ", as a server joins them)."""
    want = name.lower().encode("latin-1")
    vals = [v for k, v in scope.get("headers") or () if k.lower() == want]
    if not vals:
        return None
    return path_attr(b", ".join(vals))


def _wsgi_bytes(s):
    """The bytes of a WSGI "native string": each character one byte (PEP 3333 decodes them
    as latin-1). A server that broke the rule and put other characters there gets them
    as UTF-8."""
    try:
        return s.encode("latin-1")
    except UnicodeEncodeError:
        return s.encode("utf-8", "surrogateescape")


def asgi_attrs(scope):
    """The default attributes of an ASGI HTTP request or WebSocket handshake: ip (the
    client's host, as peer_ip gives it), method (GET for a WebSocket scope, which has
    none: the handshake is a GET), path.

    The path is normalized as every rlsidecar client does (normalize_path): from
    scope["raw_path"], the bytes the client sent, when the server gives it; else from
    scope["path"], which the server decoded already and which is not decoded again
    (clean_path). The value is as path_attr gives it."""
    client = scope.get("client")
    raw = scope.get("raw_path")
    if raw:
        # A str where the spec says bytes: Uvicorn's WebSocket scopes (to 0.2x) have the
        # target, read as latin-1, there.
        path = normalize_path(_wsgi_bytes(raw) if isinstance(raw, str) else bytes(raw))
    else:
        path = clean_path(scope.get("path", "").encode("utf-8", "surrogateescape"))
    # A WebSocket scope has no method: its handshake is a GET, as the Go middleware and
    # nginx see it (a rule on GET /chat applies to it).
    method = scope.get("method") or ("GET" if scope.get("type") == "websocket" else "")
    attrs = {"method": method, "path": path_attr(path)}
    if client and client[0]:  # else left out, not sent as "" (as wsgi_attrs)
        attrs = {"ip": peer_ip(client[0]), **attrs}
    return attrs


def _closed(client):
    return Decision(client.on_unavailable == "open", degraded=True, cause="client closed")


def _reason(status):
    return {200: "OK", 429: "Too Many Requests", 431: "Request Header Fields Too Large",
            503: "Service Unavailable"}[status]


class WSGIMiddleware:
    """WSGI middleware around ``app`` that checks every request with ``client`` (a
    rlsidecar.Client):

    - allowed: the rate-limit headers (Decision.headers()) are added to the app's
      response;
    - rejected by a rule: 429 with Retry-After and a problem+json body; the app is not
      called;
    - no answer from the sidecar: the client's on_unavailable — "open" calls the app
      without rate-limit headers, "closed" answers 503 with Retry-After: 1;
    - a request too large to be checked (RequestTooLargeError: attributes whose frame is
      over the client's max_frame, such as a huge header an attrs function sends): 431
      (Request Header Fields Too Large) with a problem+json body; the app is not called;
    - another ProtocolError (``attrs`` or ``cost`` produced something the sidecar
      refuses) or a closed client: the client's on_unavailable, as for an unreachable
      sidecar.

    ``attrs(environ) -> dict`` and ``cost(environ) -> int`` choose what is checked;
    by default wsgi_attrs and 1.

    A request's concurrency lease is renewed (Client.renew, each rule's own lease) at
    about half of what is left of it until it is released, by a thread of its own, so a
    request longer than its rule's lease (an upload, a stream) keeps its slot;
    ``renew_leases=False`` turns that off.
    """

    def __init__(self, app, client, attrs=wsgi_attrs, cost=None, renew_leases=True):
        self.app = app
        self.client = client
        self.attrs = attrs
        self.cost = cost
        self.renew_leases = renew_leases

    def __call__(self, environ, start_response):
        cost = self.cost(environ) if self.cost is not None else 1
        try:
            d = self.client.check(self.attrs(environ), cost)
        except ProtocolError as e:
            d = e.decision  # a 431 for RequestTooLargeError, else the policy's
        except ClosedError:
            d = _closed(self.client)
        if not d.allowed:
            status, headers, body = d.rejection()
            start_response("%d %s" % (status, _reason(status)), list(headers.items()))
            return [body]
        renewal = None
        try:  # a renewal thread that cannot start (RuntimeError at a process's thread limit) too
            if d.lease and self.renew_leases:
                renewal = _LeaseRenewal(self.client, d.lease, _first_renewal(d), _lease_life(d))
            if d.delay_ms:
                time.sleep(d.delay_ms / 1000)  # a rule's delay: its tokens are reserved, the request waits
        except BaseException:
            if d.lease:
                self._release(d.lease, renewal)
            raise
        extra = list(d.headers().items())
        start = start_response
        if extra:
            def start(status, headers, exc_info=None):
                return start_response(status, headers + extra, exc_info) if exc_info else start_response(status, headers + extra)
        if not d.lease:
            return self.app(environ, start)
        length = []  # the response's Content-Length, when the app gives one

        def start_noting_length(status, headers, exc_info=None):
            for k, v in headers:
                if k.lower() == "content-length" and v.strip().isdigit():
                    length[:] = [int(v)]
            return start(status, headers, exc_info) if exc_info else start(status, headers)
        try:
            body = self.app(environ, start_noting_length)
        except BaseException:
            self._release(d.lease, renewal)
            raise
        releasing = _SizedReleasing if isinstance(body, collections.abc.Sized) else _Releasing
        return releasing(body, lambda: self._release(d.lease, renewal), length)

    def _release(self, lease, renewal=None):
        if renewal is not None:
            renewal.stop()
        try:
            self.client.release(lease)
        except Exception:  # the lease then expires on its own; the response is not at fault
            pass


class _LeaseRenewal:
    """A thread renewing one lease with a blocking Client, first after ``first`` seconds,
    then at half of what each renewal answers is left of it, until stop() (which waits for
    a renewal under way, at most the client's timeout, so that the release follows it).
    It ends by itself when a renewal answers that the lease is gone, when the client is
    closed, and when the sidecar does not answer until the lease's last known expiry."""

    def __init__(self, client, lease, first, life=0):
        self._client = client
        self._lease = lease
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(first, life), name="rlsidecar-renew", daemon=True)
        self._thread.start()

    def _run(self, wait, life):
        expires = time.monotonic() + (life if life > 0 else 2 * wait)  # see _lease_life
        while not self._stop.wait(max(wait, MIN_RENEWAL)):
            try:
                renewed, expires_ms = self._client.renew(self._lease)
            except ClosedError:
                return  # every later renewal would fail at once too, down to every 10 ms
            except (OSError, ProtocolError):
                left = expires - time.monotonic()
                if left <= 0:
                    return
                wait = left / 2
                continue
            if not renewed:
                return
            expires = time.monotonic() + expires_ms / 1000
            wait = expires_ms / 2000

    def stop(self):
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()


class _Releasing:
    """A WSGI response body that releases a concurrency lease when the server closes it
    (the request is over: PEP 3333), or sooner: before it hands the server the body's last
    part, when that is known (a list or tuple body; the Content-Length reached). The server
    may write that part and read the client's next request (on another connection, in
    another thread) before it calls close(): released first, that request finds the slot
    free. A streamed body of unknown length is released at close()."""

    def __init__(self, body, release, length):
        self._body = body
        self._release = release
        self._length = length  # [Content-Length] once start_response gave one, else []

    def __iter__(self):
        body = self._body
        if isinstance(body, (list, tuple)):
            for i, chunk in enumerate(body):
                if i == len(body) - 1:
                    self._release_now()
                yield chunk
            return
        sent = 0
        for chunk in body:
            sent += len(chunk)
            if self._length and sent >= self._length[0]:
                self._release_now()
            yield chunk

    def _release_now(self):
        release, self._release = self._release, None
        if release is not None:
            release()

    def close(self):
        try:
            close = getattr(self._body, "close", None)
            if close is not None:
                close()
        finally:
            self._release_now()


class _SizedReleasing(_Releasing):
    """A _Releasing around a body that has a len() (a list, a tuple): len() is the
    body's, as PEP 3333 lets a server use it. A server that finds a body of one part
    (wsgiref) sends its Content-Length, where it could not with a _Releasing (no
    __len__). A body without len() gets a _Releasing, which has none either."""

    def __len__(self):
        return len(self._body)


class ASGIMiddleware:
    """ASGI middleware around ``app`` that checks every HTTP request and every WebSocket
    handshake with ``client`` (a rlsidecar.AsyncClient); other scopes (lifespan) pass
    through. It behaves as WSGIMiddleware does; ``attrs(scope) -> dict`` and
    ``cost(scope) -> int`` default to asgi_attrs and 1.

    A WebSocket handshake is checked as the GET it is (asgi_attrs). Allowed, the
    rate-limit headers are added to the app's websocket.accept (its 101). Refused, it is
    answered with the 429 (503, 431) an HTTP request gets, through the ASGI
    "websocket.http.response" extension when the server offers it in
    scope["extensions"] (Hypercorn does; Uvicorn from 0.30); else with a websocket.close
    before the accept, which the server answers with a 403 without those headers. A
    WebSocket's concurrency lease is held (and renewed) for the session: released when
    the app sends websocket.close or returns. A request held for a rule's delay whose client disconnects
    meanwhile is dropped: the app is not called and its lease is released (see _hold).
    Until a request's concurrency lease is released, it is renewed (AsyncClient.renew,
    each rule's own lease) at about half of what is left of it, so a request longer than
    its rule's lease (an upload, a stream) keeps its slot; ``renew_leases=False`` turns
    that off."""

    def __init__(self, app, client, attrs=asgi_attrs, cost=None, renew_leases=True):
        self.app = app
        self.client = client
        self.attrs = attrs
        self.cost = cost
        self.renew_leases = renew_leases

    async def __call__(self, scope, receive, send):
        kind = scope.get("type")
        if kind != "http" and kind != "websocket":
            return await self.app(scope, receive, send)
        cost = self.cost(scope) if self.cost is not None else 1
        try:
            d = await self.client.check(self.attrs(scope), cost)
        except ProtocolError as e:
            d = e.decision
        except ClosedError:
            d = _closed(self.client)
        if not d.allowed:
            status, headers, body = d.rejection()
            headers = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
            if kind == "http":
                await send({"type": "http.response.start", "status": status, "headers": headers})
                await send({"type": "http.response.body", "body": body})
            elif "websocket.http.response" in (scope.get("extensions") or {}):
                # The server lets the app answer the handshake with an HTTP response
                # (Hypercorn; Uvicorn from 0.30): the same 429 (503, 431) as for HTTP.
                await send({"type": "websocket.http.response.start", "status": status, "headers": headers})
                await send({"type": "websocket.http.response.body", "body": body})
            else:
                # Else the only refusal ASGI has: a close before the accept, which the
                # server answers with a 403, without the rate-limit headers.
                await send({"type": "websocket.close", "code": 1008})
            return
        extra = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in d.headers().items()]
        if d.lease:
            pending = [d.lease]
            renewal = asyncio.ensure_future(_keep_lease(self.client, d.lease, _first_renewal(d), _lease_life(d))) \
                if self.renew_leases else None

            async def release():
                # Nothing is awaited before the release is written (AsyncClient writes it
                # before its first await, on a connection that is up): a request cancelled
                # again meanwhile (as an anyio cancel scope does at every await) still
                # frees its slot. A renewal cancelled sends nothing more; one it sent is
                # ahead of the release on the connection (and a renew that came after
                # the release would answer renewed: false, taking no slot). The lease
                # stays pending until the release is answered (or fails): cancelled
                # before, it is sent again from the finally below (a second release of it
                # answers False).
                if pending:
                    if renewal is not None:
                        renewal.cancel()
                    try:
                        await self.client.release(pending[0])
                    except Exception:  # the lease then expires on its own
                        pass
                    pending.clear()

            async def send_releasing(message):
                # The response's last body message goes out only once the slot is free, so
                # a client that has the whole response and asks again finds it free (as
                # the Go middleware, whose release precedes the response's end).
                if _ends_response(message):
                    await release()
                await send(message)

            try:  # the delay too: a request cancelled, or whose client left, while held frees its slot
                receive, gone = await _hold(d, receive)
                if gone:
                    return
                return await self._call(scope, receive, send_releasing, extra)
            finally:
                await release()
        receive, gone = await _hold(d, receive)
        if gone:
            return
        return await self._call(scope, receive, send, extra)

    async def _call(self, scope, receive, send, extra):
        if not extra:
            return await self.app(scope, receive, send)

        async def send_with_headers(message):
            if message["type"] in _HEADED:
                message = dict(message)
                message["headers"] = list(message.get("headers", ())) + extra
            await send(message)

        return await self.app(scope, receive, send_with_headers)


#: The send messages that carry the response's headers, to which the rate-limit headers
#: are added: an HTTP response's start, a WebSocket's accept (its 101), and the start of
#: the HTTP response an app gives a WebSocket handshake it refuses itself.
_HEADED = ("http.response.start", "websocket.accept", "websocket.http.response.start")


def _ends_response(message):
    """Whether an ASGI send message is a response's last: a body message without
    more_body, or one of the extensions that send a file (http.response.pathsend, always
    the last; http.response.zerocopysend, the last without more_body). Starlette's
    FileResponse sends a pathsend where the server offers it (Hypercorn does). For a
    WebSocket: its close, or the last body of the HTTP response the app refused its
    handshake with (the session is over; an app that goes on running after it, as after
    an HTTP response's end, no longer holds the slot)."""
    t = message["type"]
    if t == "http.response.body" or t == "http.response.zerocopysend" or t == "websocket.http.response.body":
        return not message.get("more_body", False)
    return t == "http.response.pathsend" or t == "websocket.close"


#: The request body ASGIMiddleware reads ahead, at most, while it holds a request for a
#: rule's delay (watching for the client's disconnect); past it, it stops watching and
#: the request is held to the end of its delay.
HOLD_READ_AHEAD = 65536


async def _hold(d, receive):
    """Hold the request d.delay_ms (a rule's delay: its tokens are reserved, the request
    waits) while watching for the client going away. Returns the receive callable to give
    the app (the messages read meanwhile first, in order) and whether the client
    disconnected: then the app is not called, nothing is sent, and the caller releases the
    lease.

    Only receive() tells an ASGI app that its client went away (http.disconnect), and it
    also hands out the request body: the body that arrives during the wait is kept for the
    app, up to HOLD_READ_AHEAD bytes; past that the wait goes on without watching. Once the
    body is complete, receive() waits until the client disconnects (the ASGI spec); that
    last receive() is cancelled when the wait ends (servers' receive() awaits a queue or
    an event, which loses nothing when cancelled)."""
    if not d.delay_ms:
        return receive, False
    loop = asyncio.get_running_loop()
    deadline = loop.time() + d.delay_ms / 1000
    kept = []  # messages read during the wait, for the app
    size = 0
    complete = False  # the body's last message was read
    watching = True
    while True:
        left = deadline - loop.time()
        if left <= 0:
            break
        if not watching:
            await asyncio.sleep(left)
            break
        got = asyncio.ensure_future(receive())
        try:
            await asyncio.wait((got,), timeout=left)
        finally:
            if not got.done():  # the wait is over (or cancelled): the app asks again
                got.cancel()
        if not got.done() or got.cancelled():
            break
        msg = got.result()
        if msg.get("type") in ("http.disconnect", "websocket.disconnect"):
            return receive, True
        kept.append(msg)
        size += len(msg.get("body", b""))
        if complete or msg.get("type") != "http.request" or size > HOLD_READ_AHEAD:
            # Past the read-ahead, or a server whose receive() does not wait after the body
            # (not as the spec says): the rest of the wait is not watched.
            watching = False
        elif not msg.get("more_body", False):
            complete = True
    if not kept:
        return receive, False

    async def receive_kept():
        if kept:
            return kept.pop(0)
        return await receive()

    return receive_kept, False


#: The shortest wait between two renewals of a lease, in seconds.
MIN_RENEWAL = 0.01


def _first_renewal(d):
    """When to renew d's lease first, in seconds: half the shortest window among d's rules.
    A concurrency rule's entry has its lease as its window; a rate rule's may be shorter,
    which only brings the first renewal forward (its answer says when the lease expires,
    and the next renewal follows that)."""
    w = min((r.window_ms for r in d.rules if r.window_ms), default=2000)
    return max(w / 2000, MIN_RENEWAL)


def _lease_life(d):
    """How long d's lease lasts unless renewed, in seconds: the shortest window of its
    concurrency entries (a concurrency rule's window is its lease; a renewal of a lease
    one of whose slots ran out answers renewed: false); 0 when d flags none (an earlier
    daemon), and the renewals then take twice the first wait. It is the lease's expiry
    until a renewal answers. Before, that was always twice the first wait, the shortest
    window of all the rules: a rate rule of 10 per second beside a lease of a minute
    made it one second, and a sidecar that did not answer the renewals of that second
    (stalled, restarting) ended them for good, the lease left to expire under a request
    still running."""
    return min((r.window_ms for r in d.rules if r.concurrency and r.window_ms), default=0) / 1000


async def _keep_lease(client, lease, first, life=0):
    """Renew lease with client (an AsyncClient), first after ``first`` seconds, then at
    half of what each renewal answers is left of it, until cancelled. It returns when a
    renewal answers that the lease is gone, when the client is closed, and when the
    sidecar does not answer until the lease's last known expiry (retrying meanwhile at
    half of what is left of it)."""
    loop = asyncio.get_running_loop()
    expires = loop.time() + (life if life > 0 else 2 * first)  # see _lease_life
    wait = first
    while True:
        await asyncio.sleep(max(wait, MIN_RENEWAL))
        try:
            renewed, expires_ms = await client.renew(lease)
        except ClosedError:
            return  # every later renewal would fail at once too, down to every 10 ms
        except (ConnectionError, ProtocolError):
            left = expires - loop.time()
            if left <= 0:
                return
            wait = left / 2
            continue
        if not renewed:
            return
        expires = loop.time() + expires_ms / 1000
        wait = expires_ms / 2000
