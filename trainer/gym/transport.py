"""An HTTP/1.1 keep-alive pool for the Gym client: a lean pool, responses framed by llhttp.

The pool is ours, the HTTP parsing is not.  httpx's default pool (httpcore) walks every connection of
the pool on every request and polls each idle socket; with thousands of `/run` calls open that walk
costs more than the rest of the hand-off.  This pool keeps, per origin, a stack of idle connections
and looks only at the one it reuses.  Each connection (`trainer.gym.connection`) frames its responses
with llhttp, reads large bodies in place and says when it may be reused; the pool parks only those.
`benchmarks/gym_client.py` measures the pool against aiohttp's and httpx's clients;
`docs/http-client.md` has the table.

It is also a plain `httpx.AsyncBaseTransport`, so any `httpx.AsyncClient` can run on it; `GymClient`
calls `exchange()` directly (the same bytes and httpx's exceptions, without httpx's client layer).
The shapes of an exchange (`Origin`, `Timeouts`, `Reply`) are defined in `trainer.gym.http_types` and
named here too: callers of the pool import its whole interface from this one module.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from trainer.gym.connection import READ_BYTES, Link
from trainer.gym.http_types import Origin, Reply, Timeouts, origin_of

__all__ = [
    "DEFAULT_KEEPALIVE_EXPIRY_S",
    "DEFAULT_MAX_BODY_BYTES",
    "READ_BYTES",
    "LeanTransport",
    "Origin",
    "PoolState",
    "Reply",
    "Timeouts",
    "origin_of",
]

# uvicorn closes idle keep-alive connections after 5 s; reusing one at that instant loses the request
# to a race, so this side gives them up first.
DEFAULT_KEEPALIVE_EXPIRY_S = 4.0
# A body cap: a misbehaving agent cannot make the trainer buffer without bound.
DEFAULT_MAX_BODY_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True)
class PoolState:
    """What the pool holds now: `idle` counts parked connections that are clean and reusable."""

    idle: int
    busy: int
    waiting: int


class LeanTransport(httpx.AsyncBaseTransport):
    """HTTP/1.1 on asyncio protocols; at most `max_connections` open (idle or busy) per transport."""

    def __init__(
        self,
        *,
        ssl_context: ssl.SSLContext | None = None,
        max_connections: int = 1024,
        max_idle_per_origin: int | None = None,
        keepalive_expiry_s: float = DEFAULT_KEEPALIVE_EXPIRY_S,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    ) -> None:
        self._ssl_context = ssl_context
        self._slots = asyncio.Semaphore(max_connections)
        self._max_idle = max_idle_per_origin if max_idle_per_origin is not None else max_connections
        self._expiry_s = keepalive_expiry_s
        self._max_body = max_body_bytes
        # Where every connection's reads land (one loop: a read is parsed before the next one lands).
        self._scratch = bytearray(READ_BYTES)
        self._idle: dict[Origin, deque[Link]] = {}
        self._busy = 0
        self._waiting = 0
        self._closed = False

    def pool_state(self) -> PoolState:
        now = time.monotonic()
        idle = sum(link.reusable(now, self._expiry_s) for stack in self._idle.values() for link in stack)
        return PoolState(idle=idle, busy=self._busy, waiting=self._waiting)

    async def aclose(self) -> None:
        self._closed = True
        for stack in self._idle.values():
            while stack:
                stack.pop().close()
        self._idle.clear()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        """The httpx transport interface: any `httpx.AsyncClient` can run on this pool."""
        try:
            reply = await self.exchange(
                request.method,
                origin_of(request.url),
                request.url.raw_path,
                # The body is read whole: it goes with a Content-Length, never chunked.
                [(k, v) for k, v in request.headers.raw if k.lower() != b"transfer-encoding"],
                await request.aread(),
                Timeouts.of(request),
            )
        except httpx.TransportError as exc:
            exc.request = request
            raise
        return httpx.Response(
            reply.status,
            headers=reply.headers,
            stream=httpx.ByteStream(bytes(reply.body)),
            extensions={"http_version": reply.http_version, "reason_phrase": reply.reason},
            request=request,
        )

    async def exchange(
        self,
        method: str,
        origin: Origin,
        target: bytes,
        headers: Sequence[tuple[bytes, bytes]],
        body: bytes,
        timeouts: Timeouts,
    ) -> Reply:
        """One request and its complete response, without building httpx request/response objects.

        `headers` are sent as given (the caller includes Host and Content-Length); errors are httpx's
        transport exceptions.  This is what `GymClient` calls: httpx's client layer (URL merging,
        cookies, auth and redirect hooks) cost twice the exchange itself per call.
        """
        if self._closed:
            raise RuntimeError("the transport is closed")
        self._waiting += 1
        try:
            if timeouts.pool is None or not self._slots.locked():
                await self._slots.acquire()
            else:
                async with asyncio.timeout(timeouts.pool):
                    await self._slots.acquire()
        except TimeoutError:
            raise httpx.PoolTimeout("no connection slot free in time") from None
        finally:
            self._waiting -= 1
        self._busy += 1
        link: Link | None = None
        try:
            link = self._reuse(origin) or await self._connect(origin, timeouts.connect)
            reply = await link.exchange(method, target, headers, body, timeouts)
            if self._closed or link.dead:
                link.close()
            else:
                self._park(origin, link)
            return reply
        except BaseException:
            # An error, a timeout or a cancellation leaves the connection mid-message: never reused.
            if link is not None:
                link.close()
            raise
        finally:
            self._busy -= 1
            self._slots.release()

    def _reuse(self, origin: Origin) -> Link | None:
        stack = self._idle.get(origin)
        if not stack:
            return None
        now = time.monotonic()
        while stack:
            link = stack.pop()  # the most recently used: the least likely to have expired
            if link.reusable(now, self._expiry_s):
                return link
            link.close()
        return None

    def _park(self, origin: Origin, link: Link) -> None:
        stack = self._idle.get(origin)
        if stack is None:
            stack = self._idle[origin] = deque()
        if len(stack) >= self._max_idle:
            # Full of parked connections: drop the ones the peer already closed before giving up this one.
            alive = [old for old in stack if not old.dead]
            stack.clear()
            stack.extend(alive)
            if len(stack) >= self._max_idle:
                link.close()
                return
        stack.append(link)

    async def _connect(self, origin: Origin, timeout: float | None) -> Link:
        scheme, host, port = origin
        tls: ssl.SSLContext | None = None
        if scheme == "https":
            tls = self._ssl_context or ssl.create_default_context()
        loop = asyncio.get_running_loop()
        extra: dict[str, Any] = {"ssl": tls, "server_hostname": host} if tls else {}
        max_body, scratch = self._max_body, self._scratch
        try:
            async with asyncio.timeout(timeout):
                _, link = await loop.create_connection(lambda: Link(max_body, scratch), host, port, **extra)
        except TimeoutError:
            raise httpx.ConnectTimeout(f"connecting to {host}:{port} timed out") from None
        except (OSError, ssl.SSLError) as exc:
            raise httpx.ConnectError(f"{host}:{port}: {exc}") from exc
        return link
