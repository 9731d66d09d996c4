"""One keep-alive HTTP/1.1 connection of the Gym client's pool: its socket and the llhttp parser that
frames its responses.

Responses are framed by llhttp (through httptools: the C parser of Node.js and uvicorn), in its strict
mode: status lines, headers, `100 Continue`, `Content-Length` (a second one refused), chunked bodies and
their trailers, keep-alive rules.  On top of it this module refuses what llhttp would accept but the
pool cannot read safely (any transfer coding but `chunked`, an unasked `101`, oversize heads and
bodies), ends a body delimited by EOF at the EOF (httptools has no call for it) and, as llhttp cannot
be told a request was `HEAD`, ends a HEAD reply at its head.  Requests are written whole by
`encode_request` (`trainer/gym/http_request.py`).

Each connection is an `asyncio.BufferedProtocol` that feeds what arrives straight into its parser, so
a reply is complete the moment its last byte is parsed, without a task switch per read.  Reads land
in one scratch buffer of the pool's (`READ_BYTES`, reused by every connection: a read and its parse
run to the end before the loop reads again); once a head with a `Content-Length` is parsed and the
body is not all in that read, the rest of the body is read straight into one buffer of the body's
length (`bytearray`), its last byte ending the reply.  A large body is so written once, by the
kernel, instead of three times (a fresh bytes object per read, llhttp's copy of each body chunk,
their join), each copy a fresh mapping under the trainer's mmap threshold.  llhttp has framed the
head, so the rules above hold; the body it no longer sees is counted to its length, and the parser,
now mid-message, is replaced by a fresh one before the connection is reused.  A connection
goes back to the pool only when the final response was framed completely, llhttp says the server
keeps the HTTP/1.1 connection alive, and no further message began behind the response.  Bytes or an
EOF arriving on an idle connection close it at once: an unsolicited response can never become the
next call's reply.  Anything else (an error, a timeout, a cancellation at any await) closes the
connection: its state is unknown.

The pool that holds these connections is `trainer.gym.transport`; this module holds one of them, so
the HTTP framing rules can be read (and benchmarked, `benchmarks/http_framing.py`) on their own.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import cast

import httptools
import httpx

from trainer.gym.http_request import encode_request
from trainer.gym.http_types import Reply, Timeouts

# The header block cap: a misbehaving agent cannot make the trainer buffer a head without bound
# (the body cap is the pool's, `max_body`).
MAX_HEADER_BYTES = 64 * 1024
# The scratch buffer each read lands in until a body is read in place: libuv's own read size.
READ_BYTES = 64 * 1024

NO_RESPONSE = "Server disconnected without sending a response."
_HTTP_NAME = b"HTTP/"
_HTTP_11 = b"HTTP/1.1"


class _Stop(Exception):
    """Raised in a parser callback to stop llhttp mid-buffer: the exchange's fate is already decided."""


class Link(asyncio.BufferedProtocol):
    """One connection: its socket, its llhttp response parser and the reply being read on it.

    The parser calls back into this object (`on_status`, `on_header`, ...) as it frames the bytes
    `data_received` feeds it.  `_status` stays 0 until the head of the final (non-1xx) response is
    complete; `_keep_alive` is llhttp's verdict on that head, narrowed to HTTP/1.1.  `_body` is the
    buffer the rest of a body is read into in place (None while llhttp frames what arrives).

    `scratch` is where reads land (`get_buffer`): the pool's, shared by its connections (one event
    loop: each read is parsed before the next lands), or the link's own.
    """

    def __init__(self, max_body: int, scratch: bytearray | None = None) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.max_body = max_body
        self._scratch = memoryview(scratch if scratch is not None else bytearray(READ_BYTES))
        self._body: bytearray | None = None
        self.transport: asyncio.Transport | None = None
        self.dead = False  # closed, by us or the peer, or poisoned: never reused
        self.idle_since = 0.0
        self._reply: asyncio.Future[Reply] | None = None
        self._head_only = False  # the request was HEAD: the response ends with its head
        self._status = 0
        self._reason = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._length: int | None = None  # the final response's Content-Length
        self._coded = False  # a Transfer-Encoding header arrived
        self._keep_alive = False
        self._to_eof = False  # the body is delimited by the end of the stream
        self._parts: list[bytes] = []
        self._size = 0
        self._head_bytes = 0
        self._heard = False  # any byte of this exchange's response arrived
        self._write_paused = False
        self._drained: asyncio.Future[None] | None = None

    # -- asyncio.Protocol callbacks ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass of asyncio's

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._body is not None:
            return memoryview(self._body)[self._size :]  # exactly the body's rest: no byte past it
        return self._scratch

    def buffer_updated(self, nbytes: int) -> None:
        if self._body is None:
            self.data_received(self._scratch[:nbytes])
            return
        if self._reply is None or self._reply.done():
            self.close()  # timed out or failed meanwhile: the body is nobody's
            return
        self._size += nbytes
        if self._size == len(self._body):
            self._finish(reusable=self._keep_alive)

    def data_received(self, data: bytes | memoryview) -> None:
        if self._reply is None or self._reply.done():
            # Nobody asked: an unsolicited response (or garbage) must not become the next call's reply.
            self.close()
            return
        if not self._heard:
            self._heard = True
            # llhttp also frames RTSP/ and ICE/ replies and skips blank lines before a status line.
            if not _HTTP_NAME.startswith(data[:5]):
                self._fail(
                    httpx.RemoteProtocolError(f"malformed response: illegal status line {bytes(data[:40])!r}")
                )
                return
        try:
            self.parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            # A refusal of ours (raised as _Stop) has already failed or finished the reply: this
            # only closes the connection.  Anything else is llhttp refusing the bytes.
            self._fail(httpx.RemoteProtocolError(f"malformed response: {exc}"))
            return
        if self._status and self._reply is not None and self._length is not None and not self._coded:
            # The head is framed and the body's rest is still to come: it is read in place.
            self._read_in_place(self._length)
            return
        if self._status == 0 and self._reply is not None:
            # Every byte of this read belonged to the head (or to interim responses).
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEADER_BYTES:
                self._fail(
                    httpx.RemoteProtocolError(
                        f"response head too long: no end within {MAX_HEADER_BYTES} bytes"
                    )
                )

    def eof_received(self) -> bool:
        self._end_of_stream()
        self.dead = True
        return False  # the transport closes itself

    def connection_lost(self, exc: Exception | None) -> None:
        self.dead = True
        if exc is None:
            self._end_of_stream()
        if self._reply is not None and not self._reply.done():
            self._fail(httpx.ReadError(f"connection lost while reading the response: {exc}"))
        self._wake_writer(ConnectionResetError(f"connection lost: {exc}"))

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        self._wake_writer(None)

    # -- llhttp callbacks (httptools calls them from inside `feed_data`) ---------------------------

    def on_message_begin(self) -> None:
        if self._reply is None or self._reply.done():
            # A second message after the reply in the same read: never the next call's reply.
            self.close()
            raise _Stop
        self._reason, self._headers, self._length, self._coded = b"", [], None, False

    def on_status(self, reason: bytes) -> None:
        self._reason += reason  # called once per read the reason phrase spans

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._status:
            return  # a trailer field after a chunked body: dropped (it cannot change the framing)
        name = name.lower()
        if name == b"content-length":
            self._length = int(value)  # llhttp has checked the digits and refused any second one
        elif name == b"transfer-encoding":
            # Only `chunked` alone frames a response the way the pool reads it; a coding such as
            # gzip would leave the body delimited by EOF, and a second header could disagree.
            if self._coded or value.lower() != b"chunked":
                self._fail(
                    httpx.RemoteProtocolError(f"malformed response: unsupported Transfer-Encoding {value!r}")
                )
                raise _Stop
            self._coded = True
        self._headers.append((name, value.rstrip(b" \t")))  # llhttp keeps trailing whitespace

    def on_headers_complete(self) -> None:
        parser = self.parser
        status = parser.get_status_code()
        if status < 200:
            if status == 101:  # nobody asked for an upgrade
                self._fail(httpx.RemoteProtocolError("malformed response: unasked 101 Switching Protocols"))
                raise _Stop
            return  # 100 Continue, 103 Early Hints: the real response follows (llhttp ends this one)
        self._status = status
        if self._head_only:
            # httptools cannot tell llhttp to skip the body a HEAD reply's headers announce: the reply
            # ends here, and the connection, whose parser is now out of step, is closed.
            self._finish(reusable=False)
            raise _Stop
        no_body = status == 204 or status == 304
        if self._length is not None and self._length > self.max_body and not no_body:
            self._fail(httpx.RemoteProtocolError(f"response body of {self._length} bytes refused"))
            raise _Stop
        self._to_eof = self._length is None and not self._coded and not no_body
        self._keep_alive = parser.should_keep_alive() and parser.get_http_version() == "1.1"

    def on_body(self, body: bytes) -> None:
        self._size += len(body)
        if self._size > self.max_body:
            self._fail(httpx.RemoteProtocolError(f"response body over {self.max_body} bytes"))
            raise _Stop
        self._parts.append(body)

    def on_message_complete(self) -> None:
        if self._status:
            self._finish(reusable=self._keep_alive)
        # else an interim response ended; the next message is the real one

    # -- the exchange ----------------------------------------------------------------------------

    def reusable(self, now: float, expiry_s: float) -> bool:
        return not self.dead and self._reply is None and now - self.idle_since < expiry_s

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
            wire = encode_request(method, target, headers, body)
        except httpx.LocalProtocolError as exc:
            self.close()
            raise httpx.LocalProtocolError(f"request refused before sending: {exc}") from None
        loop = asyncio.get_running_loop()
        reply: asyncio.Future[Reply] = loop.create_future()
        self._reply = reply
        self._head_only = method == "HEAD"
        self._status, self._parts, self._size, self._head_bytes, self._heard = 0, [], 0, 0, False
        self._body = None
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

    def _read_in_place(self, length: int) -> None:
        """The rest of a `length`-byte body goes straight into one buffer (what llhttp framed of it
        so far copied in first); llhttp sees none of it."""
        body = bytearray(length)
        size = self._size
        if size:
            body[:size] = self._parts[0] if len(self._parts) == 1 else b"".join(self._parts)
        self._parts = []
        self._body = body

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
        self._body = None
        if self._reply is not None and not self._reply.done():
            self._reply.set_exception(exc)
        self._reply = None

    def _end_of_stream(self) -> None:
        """The peer's EOF: it ends a body delimited by EOF; any other response it cuts short."""
        if self._reply is None or self._reply.done():
            return
        if self._status and self._to_eof:
            self._finish(reusable=False)
        elif not self._heard:
            self._fail(httpx.RemoteProtocolError(NO_RESPONSE))
        elif self._status:
            self._fail(
                httpx.RemoteProtocolError(
                    f"peer closed connection without sending complete message body: received {self._size} bytes"
                )
            )
        else:
            self._fail(httpx.RemoteProtocolError("peer closed connection in the middle of the response head"))

    def _finish(self, *, reusable: bool) -> None:
        assert self._reply is not None
        parts = self._parts
        body: bytes | bytearray = parts[0] if len(parts) == 1 else b"".join(parts)
        self._parts = []
        version = self.parser.get_http_version()
        if self._body is not None:
            # llhttp stopped at the body's first byte it did not see: a fresh parser for the next reply.
            body, self._body = self._body, None
            self.parser = httptools.HttpResponseParser(self)
        if reusable and not self.dead:
            # Any byte after this response in the same read starts a message: `on_message_begin`
            # closes the connection before the awaiting call can park it.
            self.idle_since = time.monotonic()
        else:
            self.close()
        self._reply.set_result(
            Reply(
                self._status,
                self._headers,
                body,
                _HTTP_11 if version == "1.1" else b"HTTP/" + version.encode(),
                self._reason,
            )
        )
        self._reply = None  # a parked connection holds no reply (nor its body)
