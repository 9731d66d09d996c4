"""An HTTP/1.1 keep-alive pool for the Gym client: a lean pool, framing by h11.

The pool is ours, the HTTP is not.  httpx's default pool (httpcore) walks every connection of the
pool on every request and polls each idle socket; with thousands of `/run` calls open that walk costs
more than the rest of the hand-off.  This pool keeps, per origin, a stack of idle connections and
looks only at the one it reuses.  Every byte on the wire is framed by h11 (the HTTP/1.1 state
machine httpcore itself runs on): status lines, headers (obsolete line folding included), `100
Continue`, `Content-Length` (conflicting values refused), chunked bodies and their trailers, bodies
read to EOF, keep-alive rules.  `benchmarks/gym_client.py` measures the pool against aiohttp's and
httpx's clients; `docs/http-client.md` has the table.

Each connection is an `asyncio.Protocol` that feeds what arrives straight into its h11 state
machine, so a reply is complete the moment its last byte is parsed, without a task switch per read.
A connection goes back to the pool only when h11 says both sides finished the exchange cleanly,
the server allows keep-alive and nothing arrived beyond the response.  Bytes or an EOF arriving on
an idle connection close it at once: an unsolicited response can never become the next call's reply.
Anything else (an error, a timeout, a cancellation at any await) closes the connection: its state is
unknown.

It is also a plain `httpx.AsyncBaseTransport`, so any `httpx.AsyncClient` can run on it; `GymClient`
calls `exchange()` directly (the same bytes and httpx's exceptions, without httpx's client layer).
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import h11
import httpx

# uvicorn closes idle keep-alive connections after 5 s; reusing one at that instant loses the request
# to a race, so this side gives them up first.
DEFAULT_KEEPALIVE_EXPIRY_S = 4.0
# Header block and body caps: a misbehaving agent cannot make the trainer buffer without bound.
MAX_HEADER_BYTES = 64 * 1024
DEFAULT_MAX_BODY_BYTES = 256 * 1024 * 1024

NO_RESPONSE = "Server disconnected without sending a response."

Origin = tuple[str, str, int]


def origin_of(url: httpx.URL) -> Origin:
    """(scheme, host, port) of `url`, the port defaulted by scheme."""
    return (url.scheme, url.host, url.port or (443 if url.scheme == "https" else 80))


@dataclass(frozen=True)
class Timeouts:
    """Seconds (None: no limit) for each phase of an exchange, as httpx names them.

    `read` bounds the whole response, from the request written to its last byte (not the gap between
    two reads): a server that drips a byte at a time cannot hold a call past it.
    """

    connect: float | None = None
    read: float | None = None
    write: float | None = None
    pool: float | None = None

    @classmethod
    def of(cls, request: httpx.Request) -> Timeouts:
        value = request.extensions.get("timeout") or {}
        return cls(value.get("connect"), value.get("read"), value.get("write"), value.get("pool"))


@dataclass(frozen=True)
class Reply:
    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes
    http_version: bytes = b"HTTP/1.1"
    reason: bytes = b""


@dataclass(frozen=True)
class PoolState:
    """What the pool holds now: `idle` counts parked connections that are clean and reusable."""

    idle: int
    busy: int
    waiting: int


class _Link(asyncio.Protocol):
    """One connection: its socket, its h11 state machine and the reply being read on it."""

    def __init__(self, max_body: int) -> None:
        self.parser = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEADER_BYTES)
        self.max_body = max_body
        self.transport: asyncio.Transport | None = None
        self.dead = False  # closed, by us or the peer, or poisoned: never reused
        self.idle_since = 0.0
        self._reply: asyncio.Future[Reply] | None = None
        self._head: h11.Response | None = None
        self._parts: list[bytes] = []
        self._size = 0
        self._heard = False  # any byte of this exchange's response arrived
        self._write_paused = False
        self._drained: asyncio.Future[None] | None = None

    # -- asyncio.Protocol callbacks ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass of asyncio's

    def data_received(self, data: bytes) -> None:
        if self._reply is None or self._reply.done():
            # Nobody asked: an unsolicited response (or garbage) must not become the next call's reply.
            self.close()
            return
        self._heard = True
        self.parser.receive_data(data)
        self._pump()

    def eof_received(self) -> bool:
        if self._reply is not None and not self._reply.done():
            self.parser.receive_data(b"")  # a body read to EOF ends here; any other reply is cut short
            self._pump()
        self.dead = True
        return False  # the transport closes itself

    def connection_lost(self, exc: Exception | None) -> None:
        self.dead = True
        if self._reply is not None and not self._reply.done():
            if exc is None:
                self.parser.receive_data(b"")
                self._pump()
            if self._reply is not None and not self._reply.done():
                self._fail(httpx.ReadError(f"connection lost while reading the response: {exc}"))
        self._wake_writer(ConnectionResetError(f"connection lost: {exc}"))

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        self._wake_writer(None)

    # -- the exchange ----------------------------------------------------------------------------

    def reusable(self, now: float, expiry_s: float) -> bool:
        return (
            not self.dead
            and self.parser.our_state is h11.IDLE
            and self.parser.their_state is h11.IDLE
            and now - self.idle_since < expiry_s
        )

    def close(self) -> None:
        self.dead = True
        if self.transport is not None:
            self.transport.close()

    async def exchange(
        self,
        method: str,
        target: bytes,
        headers: Sequence[tuple[bytes, bytes]],
        body: bytes,
        timeouts: Timeouts,
    ) -> Reply:
        if self.dead or self.transport is None or self.transport.is_closing():
            raise httpx.RemoteProtocolError("the server closed the connection before the request was sent")
        try:
            fields = headers if isinstance(headers, list) else list(headers)
            wire = self.parser.send(h11.Request(method=method, target=target, headers=fields)) or b""
            if body:
                wire += self.parser.send(h11.Data(data=body)) or b""
            wire += self.parser.send(h11.EndOfMessage()) or b""
        except h11.LocalProtocolError as exc:
            self.close()
            raise httpx.LocalProtocolError(f"request refused before sending: {exc}") from None
        loop = asyncio.get_running_loop()
        reply: asyncio.Future[Reply] = loop.create_future()
        self._reply = reply
        self._head, self._parts, self._size, self._heard = None, [], 0, False
        self.transport.write(wire)
        if self._write_paused:
            await self._drain(timeouts.write, reply)
        if timeouts.read is None:
            return await reply
        # A timer that fails the reply costs less per call than an `asyncio.timeout` scope.
        timer = loop.call_later(timeouts.read, self._expire)
        try:
            return await reply
        finally:
            timer.cancel()

    def _expire(self) -> None:
        self._fail(httpx.ReadTimeout("no complete response in time"))

    async def _drain(self, timeout: float | None, reply: asyncio.Future[Reply]) -> None:
        self._drained = asyncio.get_running_loop().create_future()
        try:
            async with asyncio.timeout(timeout):
                await self._drained
        except TimeoutError:
            raise httpx.WriteTimeout("sending the request timed out") from None
        except OSError as exc:
            if reply.done():  # the server answered (and hung up) before reading everything
                return
            raise httpx.WriteError(f"sending the request failed: {exc}") from exc
        finally:
            self._drained = None

    def _wake_writer(self, exc: BaseException | None) -> None:
        if self._drained is not None and not self._drained.done():
            if exc is None:
                self._drained.set_result(None)
            else:
                self._drained.set_exception(exc)

    def _fail(self, exc: Exception) -> None:
        self.close()
        if self._reply is not None and not self._reply.done():
            self._reply.set_exception(exc)
        self._reply = None

    def _pump(self) -> None:
        """Takes every event h11 can frame from what arrived; ends the reply when the response ends."""
        parser = self.parser
        try:
            while True:
                event = parser.next_event()
                if event is h11.NEED_DATA:
                    return
                if isinstance(event, h11.Data):
                    self._size += len(event.data)
                    if self._size > self.max_body:
                        self._fail(httpx.RemoteProtocolError(f"response body over {self.max_body} bytes"))
                        return
                    self._parts.append(event.data)
                elif isinstance(event, h11.Response):
                    if not self._head_ok(event):
                        return
                    self._head = event
                elif isinstance(event, h11.EndOfMessage):
                    self._finish()
                    return
                elif isinstance(event, h11.ConnectionClosed):
                    self._fail(httpx.RemoteProtocolError(NO_RESPONSE))
                    return
                elif event is h11.PAUSED:  # pragma: no cover - h11 pauses only after EndOfMessage
                    return
                # An InformationalResponse (100 Continue, 103 Early Hints) precedes the real response.
        except h11.RemoteProtocolError as exc:
            if not self._heard:  # h11 calls an EOF in place of a response a protocol error
                self._fail(httpx.RemoteProtocolError(NO_RESPONSE))
            else:
                self._fail(httpx.RemoteProtocolError(f"malformed response: {exc}"))

    def _head_ok(self, head: h11.Response) -> bool:
        length: bytes | None = None
        chunked = False
        for name, value in head.headers:
            if name == b"content-length":
                length = value
            elif name == b"transfer-encoding":
                chunked = True
        if length is not None and chunked:
            # Framing by one header and not the other is how responses get split or smuggled: refused.
            self._fail(httpx.RemoteProtocolError("malformed response: Content-Length with Transfer-Encoding"))
            return False
        if length is not None and int(length) > self.max_body:
            self._fail(httpx.RemoteProtocolError(f"response body of {int(length)} bytes refused"))
            return False
        return True

    def _finish(self) -> None:
        assert self._reply is not None and self._head is not None
        head, parser = self._head, self.parser
        parts = self._parts
        body = b"".join(parts) if len(parts) != 1 else bytes(parts[0])
        self._parts, self._head = [], None
        # Reusable only if h11 says both sides are done, keep-alive holds and nothing came after.
        if (
            parser.our_state is h11.DONE
            and parser.their_state is h11.DONE
            and not parser.trailing_data[0]
            and not self.dead
        ):
            parser.start_next_cycle()
            self.idle_since = time.monotonic()
        else:
            self.close()
        self._reply.set_result(
            Reply(head.status_code, list(head.headers), body, b"HTTP/" + head.http_version, head.reason)
        )
        self._reply = None  # a parked connection holds no reply (nor its body)


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
        self._idle: dict[Origin, deque[_Link]] = {}
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
                request.headers.raw,
                await request.aread(),
                Timeouts.of(request),
            )
        except httpx.TransportError as exc:
            exc.request = request
            raise
        return httpx.Response(
            reply.status,
            headers=reply.headers,
            stream=httpx.ByteStream(reply.body),
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
        link: _Link | None = None
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

    def _reuse(self, origin: Origin) -> _Link | None:
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

    def _park(self, origin: Origin, link: _Link) -> None:
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

    async def _connect(self, origin: Origin, timeout: float | None) -> _Link:
        scheme, host, port = origin
        tls: ssl.SSLContext | None = None
        if scheme == "https":
            tls = self._ssl_context or ssl.create_default_context()
        loop = asyncio.get_running_loop()
        extra: dict[str, Any] = {"ssl": tls, "server_hostname": host} if tls else {}
        max_body = self._max_body
        try:
            async with asyncio.timeout(timeout):
                _, link = await loop.create_connection(lambda: _Link(max_body), host, port, **extra)
        except TimeoutError:
            raise httpx.ConnectTimeout(f"connecting to {host}:{port} timed out") from None
        except (OSError, ssl.SSLError) as exc:
            raise httpx.ConnectError(f"{host}:{port}: {exc}") from exc
        return link
