"""A plain ASGI wrapper that authenticates and caps request bodies before any route runs.

Plain ASGI on purpose: Starlette's `BaseHTTPMiddleware` would turn the drop_reply fault's broken
connection into a clean truncated 200, and a refusal here happens before FastAPI parses anything, so a
refused call cannot change the agent's state.
"""

from __future__ import annotations

import hmac
import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from protocol.errors import INVALID_REQUEST, PAYLOAD_TOO_LARGE, UNAUTHORIZED

# Past this many bytes an oversized body is no longer drained, the connection is just closed.
DRAIN_LIMIT_FACTOR = 8


async def _send_error(send: Send, status: int, error: str, message: str, close: bool = False) -> None:
    body = json.dumps({"error": error, "message": message}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def replayed(body: bytes, receive: Receive) -> Receive:
    """`receive` with a body already read whole given once more, first; later calls wait for the
    client's disconnect, as usual."""
    given = False

    async def replay() -> Message:
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


class GuardMiddleware:
    def __init__(
        self, app: ASGIApp, *, token: str | None, max_body_bytes: int, open_paths: frozenset[str]
    ) -> None:
        self.app = app
        self._expected = f"Bearer {token}".encode() if token is not None else None
        self.max_body_bytes = max_body_bytes
        self.open_paths = open_paths

    def _authorized(self, scope: Scope) -> bool:
        if self._expected is None or scope["path"] in self.open_paths:
            return True
        provided = b""
        for name, value in scope["headers"]:
            if name == b"authorization":
                provided = value
                break
        return hmac.compare_digest(provided, self._expected)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if not self._authorized(scope):
            await _send_error(send, 401, UNAUTHORIZED, "missing or wrong bearer token")
            return
        declared: int | None = None
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    await _send_error(send, 400, INVALID_REQUEST, "invalid Content-Length header", close=True)
                    return
        cap = self.max_body_bytes
        if declared is not None and declared > cap * DRAIN_LIMIT_FACTOR:
            await _send_error(send, 413, PAYLOAD_TOO_LARGE, f"request body over {cap} bytes", close=True)
            return
        if scope["method"] in ("GET", "HEAD", "DELETE", "OPTIONS") and declared in (None, 0):
            await self.app(scope, receive, send)
            return

        # Read the whole body under the cap (it also catches chunked bodies that declare no length),
        # then hand the route a replayed copy.
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size <= cap:
                chunks.append(chunk)
            elif size > cap * DRAIN_LIMIT_FACTOR:
                await _send_error(send, 413, PAYLOAD_TOO_LARGE, f"request body over {cap} bytes", close=True)
                return
            if not message.get("more_body", False):
                break
        if size > cap:
            # Drained, so the client reads this answer instead of a broken pipe.
            await _send_error(send, 413, PAYLOAD_TOO_LARGE, f"request body over {cap} bytes")
            return

        await self.app(scope, replayed(b"".join(chunks), receive), send)
