"""An ASGI app behind ASGIMiddleware, for test_websocket.py to serve with a real server
(uvicorn, hypercorn): the sidecar's socket is $RLS_SOCKET. A WebSocket is accepted and
held until its client goes; an HTTP request is answered 200."""

import os

import rlsidecar

_client = None


async def _inner(scope, receive, send):
    if scope["type"] == "lifespan":
        while True:
            m = await receive()
            if m["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif m["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    if scope["type"] == "http":
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})
        return
    assert (await receive())["type"] == "websocket.connect"
    await send({"type": "websocket.accept"})
    while (await receive())["type"] != "websocket.disconnect":
        pass


async def app(scope, receive, send):
    global _client
    if _client is None:  # made in the server's event loop
        _client = rlsidecar.AsyncClient(os.environ["RLS_SOCKET"], timeout=3)
    return await rlsidecar.ASGIMiddleware(_inner, _client)(scope, receive, send)
