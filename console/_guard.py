"""The console's guard: a plain ASGI wrapper in front of every route, as the agents have.

With a token configured (`--token` / `LEDGER_CONSOLE_TOKEN`) every path but `/health` needs it, by the
agents' rules (participant.guard): checked in constant time before any route runs, refused with 401
and never echoed.  A script sends `Authorization: Bearer TOKEN`; a browser, which cannot add a header
to a page it is sent to nor to a server-sent event stream, takes HTTP Basic (any user name, the token
as the password): the 401 asks for it, and the browser sends it with every request after.

Every answer says how long the server took (`Server-Timing: app;dur=MS`).  Only GET and HEAD reach a route: anything else is 405 here, whatever the route, so no request can
carry a body into the console.  Every answer carries headers that keep a page from being framed or
from loading anything but the console's own files (a Content Security Policy without inline
scripts: what a string that got past the templates' escaping could not run anyway).
"""

from __future__ import annotations

import base64
import binascii
import hmac
import json
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

OPEN_PATHS = frozenset({"/health"})
SECURITY_HEADERS: list[tuple[bytes, bytes]] = [
    (
        b"content-security-policy",
        b"default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        b"connect-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'",
    ),
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    (b"referrer-policy", b"no-referrer"),
]


async def _refuse(send: Send, status: int, message: str, extra: list[tuple[bytes, bytes]]) -> None:
    body = json.dumps(
        {"error": "unauthorized" if status == 401 else "method_not_allowed", "message": message}
    )
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        *SECURITY_HEADERS,
        *extra,
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body.encode()})


class ConsoleGuard:
    def __init__(self, app: ASGIApp, *, token: str | None) -> None:
        self.app = app
        self._token = token.encode() if token is not None else None

    def authorized(self, scope: Scope) -> bool:
        if self._token is None or scope["path"] in OPEN_PATHS:
            return True
        provided = b""
        for name, value in scope["headers"]:
            if name == b"authorization":
                provided = value
                break
        scheme, _, credentials = provided.partition(b" ")
        if scheme.lower() == b"bearer":
            given = credentials
        elif scheme.lower() == b"basic":
            try:
                given = base64.b64decode(credentials, validate=True).partition(b":")[2]
            except (binascii.Error, ValueError):
                given = b""
        else:
            given = b""
        # Compared whole and in constant time, as the agents compare theirs; an empty token never passes.
        return hmac.compare_digest(given, self._token) and bool(given)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if scope["method"] not in ("GET", "HEAD"):
            await _refuse(
                send, 405, "the console is read-only: GET and HEAD only", [(b"allow", b"GET, HEAD")]
            )
            return
        if not self.authorized(scope):
            await _refuse(
                send,
                401,
                "missing or wrong token",
                [(b"www-authenticate", b'Basic realm="ledger console", charset="UTF-8"')],
            )
            return

        started = time.perf_counter()

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                # The server's time to the answer's first byte (a page is rendered whole before it):
                # what benchmarks/console.py reads.
                took = f"app;dur={(time.perf_counter() - started) * 1000:.1f}".encode()
                message = {
                    **message,
                    "headers": [*message.get("headers", []), *SECURITY_HEADERS, (b"server-timing", took)],
                }
            await send(message)

        await self.app(scope, receive, send_with_headers)


__all__ = ["OPEN_PATHS", "SECURITY_HEADERS", "ConsoleGuard"]
