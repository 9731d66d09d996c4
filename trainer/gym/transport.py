"""An HTTP/1.1 keep-alive transport for httpx, lean enough for thousands of calls a second.

httpx's default pool (httpcore) walks every connection of the pool on every request and polls each
idle socket for readability; with the hundred-odd `/run` calls a trainer keeps open that walk cost
more than the rest of the hand-off together (`benchmarks/gym_client.py` measures both side by side).
This transport keeps, per origin, a stack of idle connections and checks only the one it reuses.

It is a plain `httpx.AsyncBaseTransport`, so any `httpx.AsyncClient` can run on it; `GymClient` calls
its `exchange()` directly (the same bytes and httpx's own exceptions, without httpx's client layer
per call).  What it implements
of HTTP/1.1 is what a JSON API needs: keep-alive, `Content-Length` and chunked bodies, a body read to
EOF when the server closes, `Connection: close`, TLS through an `ssl.SSLContext`.  A connection whose
request was cancelled or failed half-way is closed, never reused: its state is unknown.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import httpx

# uvicorn closes idle keep-alive connections after 5 s; reusing one at that instant loses the request
# to a race, so this side gives them up first.
DEFAULT_KEEPALIVE_EXPIRY_S = 4.0
# Header block and body caps: a misbehaving agent cannot make the trainer buffer without bound.
MAX_HEADER_BYTES = 64 * 1024
DEFAULT_MAX_BODY_BYTES = 256 * 1024 * 1024

_NO_BODY_STATUS = frozenset({204, 304})
_CHUNK_LINE_MAX = 1024

Origin = tuple[str, str, int]


@dataclass
class _Connection:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    idle_since: float = field(default_factory=time.monotonic)

    def reusable(self, expiry_s: float) -> bool:
        # An idle connection the server closed has seen EOF (the loop reads it as it arrives).
        return (
            not self.reader.at_eof()
            and not self.writer.is_closing()
            and time.monotonic() - self.idle_since < expiry_s
        )

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.writer.close()


def origin_of(url: httpx.URL) -> Origin:
    """(scheme, host, port) of `url`, the port defaulted by scheme."""
    return (url.scheme, url.host, url.port or (443 if url.scheme == "https" else 80))


@dataclass(frozen=True)
class Timeouts:
    """Seconds (None: no limit) for each phase of an exchange, as httpx names them."""

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


class LeanTransport(httpx.AsyncBaseTransport):
    """HTTP/1.1 over asyncio streams; at most `max_connections` open (idle or busy) per transport."""

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
        self._idle: dict[Origin, deque[_Connection]] = {}
        self._closed = False

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
        try:
            async with asyncio.timeout(timeouts.pool):
                await self._slots.acquire()
        except TimeoutError:
            raise httpx.PoolTimeout("no connection slot free in time") from None
        try:
            conn = self._reuse(origin) or await self._connect(origin, timeouts.connect)
            keep = False
            try:
                await self._write(conn, method, target, headers, body, timeouts.write)
                reply, keep = await self._read_response(conn, method, timeouts.read)
                return reply
            finally:
                # Anything but a complete exchange (an error, a cancellation) leaves the stream mid-message.
                if keep and not self._closed:
                    self._park(origin, conn)
                else:
                    conn.close()
        finally:
            self._slots.release()

    def _reuse(self, origin: Origin) -> _Connection | None:
        stack = self._idle.get(origin)
        while stack:
            conn = stack.pop()  # the most recently used: the least likely to have expired
            if conn.reusable(self._expiry_s):
                return conn
            conn.close()
        return None

    def _park(self, origin: Origin, conn: _Connection) -> None:
        stack = self._idle.setdefault(origin, deque())
        if len(stack) >= self._max_idle:
            conn.close()
            return
        conn.idle_since = time.monotonic()
        stack.append(conn)

    async def _connect(self, origin: Origin, timeout: float | None) -> _Connection:
        scheme, host, port = origin
        tls: ssl.SSLContext | None = None
        if scheme == "https":
            tls = self._ssl_context or ssl.create_default_context()
        try:
            async with asyncio.timeout(timeout):
                reader, writer = await asyncio.open_connection(
                    host, port, ssl=tls, server_hostname=host if tls else None, limit=MAX_HEADER_BYTES
                )
        except TimeoutError:
            raise httpx.ConnectTimeout(f"connecting to {host}:{port} timed out") from None
        except (OSError, ssl.SSLError) as exc:
            raise httpx.ConnectError(f"{host}:{port}: {exc}") from exc
        return _Connection(reader, writer)

    @staticmethod
    async def _write(
        conn: _Connection,
        method: str,
        target: bytes,
        headers: Sequence[tuple[bytes, bytes]],
        body: bytes,
        timeout: float | None,
    ) -> None:
        head = [method.encode("ascii"), b" ", target, b" HTTP/1.1\r\n"]
        for name, value in headers:
            head += [name, b": ", value, b"\r\n"]
        head.append(b"\r\n")
        try:
            conn.writer.write(b"".join(head) + body)
            async with asyncio.timeout(timeout):
                await conn.writer.drain()
        except TimeoutError:
            raise httpx.WriteTimeout("sending the request timed out") from None
        except OSError as exc:
            raise httpx.WriteError(f"sending the request failed: {exc}") from exc

    async def _read_response(
        self, conn: _Connection, method: str, timeout: float | None
    ) -> tuple[Reply, bool]:
        try:
            async with asyncio.timeout(timeout):
                return await self._read_message(conn, method)
        except TimeoutError:
            raise httpx.ReadTimeout("no complete response in time") from None
        except asyncio.IncompleteReadError as exc:
            if not exc.partial and not getattr(exc, "_head_seen", False):
                raise httpx.RemoteProtocolError("Server disconnected without sending a response.") from None
            raise httpx.RemoteProtocolError(
                "peer closed connection without sending complete message body"
            ) from None
        except asyncio.LimitOverrunError:
            raise httpx.RemoteProtocolError("response header block too large") from None
        except OSError as exc:
            raise httpx.ReadError(f"reading the response failed: {exc}") from exc

    async def _read_message(self, conn: _Connection, method: str) -> tuple[Reply, bool]:
        reader = conn.reader
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head[:-4].split(b"\r\n")
        try:
            version, status_text, *reason = lines[0].split(b" ", 2)
            status = int(status_text)
        except ValueError:
            raise httpx.RemoteProtocolError(f"malformed status line {lines[0][:100]!r}") from None
        if not version.startswith(b"HTTP/1.") or not 100 <= status <= 999:
            raise httpx.RemoteProtocolError(f"malformed status line {lines[0][:100]!r}")
        headers: list[tuple[bytes, bytes]] = []
        length: int | None = None
        chunked = False
        close = version == b"HTTP/1.0"
        for line in lines[1:]:
            name, sep, value = line.partition(b":")
            if not sep:
                raise httpx.RemoteProtocolError(f"malformed header line {line[:100]!r}")
            value = value.strip()
            headers.append((name, value))
            lower = name.lower()
            if lower == b"content-length":
                try:
                    length = int(value)
                except ValueError:
                    raise httpx.RemoteProtocolError("malformed Content-Length") from None
            elif lower == b"transfer-encoding":
                chunked = b"chunked" in value.lower()
            elif lower == b"connection":
                token = value.lower()
                close = close or b"close" in token
                if version == b"HTTP/1.0" and b"keep-alive" in token:
                    close = False
        if 100 <= status < 200:
            raise httpx.RemoteProtocolError(f"unexpected interim response {status}")
        if method == "HEAD" or status in _NO_BODY_STATUS:
            body = b""
        elif chunked:
            body = await self._read_chunked(reader)
        elif length is not None:
            if length < 0 or length > self._max_body:
                raise httpx.RemoteProtocolError(f"response body of {length} bytes refused")
            try:
                body = await reader.readexactly(length)
            except asyncio.IncompleteReadError as exc:
                exc._head_seen = True  # type: ignore[attr-defined]
                raise
        else:
            body = await self._read_to_eof(reader)
            close = True
        return Reply(status, headers, body, version, reason[0] if reason else b""), not close

    async def _read_chunked(self, reader: asyncio.StreamReader) -> bytes:
        parts: list[bytes] = []
        total = 0
        try:
            while True:
                line = await reader.readuntil(b"\r\n")
                if len(line) > _CHUNK_LINE_MAX:
                    raise httpx.RemoteProtocolError("chunk size line too long")
                try:
                    size = int(line.split(b";", 1)[0].strip(), 16)
                except ValueError:
                    raise httpx.RemoteProtocolError("malformed chunk size") from None
                if size == 0:
                    while await reader.readuntil(b"\r\n") != b"\r\n":  # trailers, ignored
                        pass
                    return b"".join(parts)
                total += size
                if total > self._max_body:
                    raise httpx.RemoteProtocolError("chunked response body too large")
                chunk = await reader.readexactly(size + 2)
                if chunk[-2:] != b"\r\n":
                    raise httpx.RemoteProtocolError("malformed chunk terminator")
                parts.append(chunk[:-2])
        except asyncio.IncompleteReadError as exc:
            exc._head_seen = True  # type: ignore[attr-defined]
            raise

    async def _read_to_eof(self, reader: asyncio.StreamReader) -> bytes:
        parts: list[bytes] = []
        total = 0
        while chunk := await reader.read(65536):
            total += len(chunk)
            if total > self._max_body:
                raise httpx.RemoteProtocolError("response body too large")
            parts.append(chunk)
        return b"".join(parts)
