"""The client's HTTP/1.1 pool against scripted servers on loopback (real sockets, exact bytes).

Every case ends in the right reply or a typed error, and the pool is checked afterwards: nothing
busy, nothing waiting, no connection parked that could hand stale bytes to the next call, and the next
call on the same pool gets its own answer.  Phases advance by explicit gates (events the server sets,
pool states the test waits for, each wait bounded), never by sleeping and hoping.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field

import httpx
import pytest

from trainer.gym.transport import READ_BYTES, LeanTransport, Origin, PoolState, Reply, Timeouts

JSON_OK = b'HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 11\r\n\r\n{"ok":true}'
CLEAN_IDLE = PoolState(idle=1, busy=0, waiting=0)
EMPTY = PoolState(idle=0, busy=0, waiting=0)
GATE_S = 5.0  # the most any gate waits; reaching it fails the test instead of hanging it


def ok(body: bytes, *extra: bytes) -> bytes:
    """A complete keep-alive 200 carrying `body`."""
    head = [b"HTTP/1.1 200 OK", b"content-length: " + str(len(body)).encode(), *extra]
    return b"\r\n".join(head) + b"\r\n\r\n" + body


def echo(path: str) -> tuple[bytes, bool]:
    return ok(path.encode()), False


Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@dataclass
class Scripted:
    """Answers each request with `script(path)`: the bytes to send, then whether to hang up.

    A path in `special` is handled by its own coroutine instead (it owns the connection from then on).
    """

    script: Callable[[str], tuple[bytes, bool]] = echo
    special: dict[str, Handler] = field(default_factory=dict)
    connections: int = 0
    paths: list[str] = field(default_factory=list)
    port: int = 0
    hold: dict[str, asyncio.Event] = field(default_factory=dict)  # paths whose answer waits for their event
    seen: dict[str, asyncio.Event] = field(default_factory=dict)  # set when that path's request arrived
    hung_up: asyncio.Event = field(default_factory=asyncio.Event)  # a client closed a connection

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode().split("\r\n")
                length = next(
                    (int(h.split(":")[1]) for h in lines if h.lower().startswith("content-length")), 0
                )
                await reader.readexactly(length)
                path = lines[0].split(" ")[1]
                self.paths.append(path)
                self.seen.setdefault(path, asyncio.Event()).set()
                if path in self.special:
                    await self.special[path](reader, writer)
                    return
                if path in self.hold:
                    await self.hold[path].wait()
                answer, hang_up = self.script(path)
                writer.write(answer)
                await writer.drain()
                if hang_up:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            self.hung_up.set()
        finally:
            writer.close()

    async def reached(self, path: str) -> None:
        async with asyncio.timeout(GATE_S):
            await self.seen.setdefault(path, asyncio.Event()).wait()


@contextlib.asynccontextmanager
async def serve(
    script: Callable[[str], tuple[bytes, bool]] = echo, /, **special: Handler
) -> AsyncIterator[Scripted]:
    scripted = Scripted(script, {f"/{name}": h for name, h in special.items()})
    tasks: set[asyncio.Task[None]] = set()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        tasks.add(task)
        try:
            await scripted.handle(reader, writer)
        finally:
            tasks.discard(task)

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    scripted.port = server.sockets[0].getsockname()[1]
    try:
        yield scripted
    finally:
        server.close()
        for task in list(tasks):
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await server.wait_closed()


async def get(
    transport: LeanTransport, port: int, path: str, read_s: float | None = 5.0, method: str = "GET"
) -> Reply:
    origin: Origin = ("http", "127.0.0.1", port)
    headers = [(b"Host", f"127.0.0.1:{port}".encode()), (b"Content-Length", b"0")]
    return await transport.exchange(
        method, origin, path.encode(), headers, b"", Timeouts(5.0, read_s, 5.0, 5.0)
    )


async def until(predicate: Callable[[], bool]) -> None:
    """A gate on the client's own state, bounded."""
    async with asyncio.timeout(GATE_S):
        while not predicate():
            await asyncio.sleep(0.005)


async def assert_healthy(transport: LeanTransport, agent: Scripted) -> None:
    """Nothing busy or waiting, and the next call on this pool gets its own answer and parks clean."""
    before = transport.pool_state()
    assert before.busy == 0 and before.waiting == 0
    reply = await get(transport, agent.port, "/next")
    assert (reply.status, reply.body) == (200, b"/next")
    assert transport.pool_state() == PoolState(idle=max(before.idle, 1), busy=0, waiting=0)


async def read_times_out(agent: Scripted, path: str, read_s: float = 0.3) -> LeanTransport:
    """A GET of `path` that meets its read deadline: the connection is dropped, never pooled, and the
    transport's next exchange is healthy.  The transport, for the caller's own checks and to close."""
    transport = LeanTransport()
    with pytest.raises(httpx.ReadTimeout):
        await get(transport, agent.port, path, read_s=read_s)
    assert transport.pool_state() == EMPTY
    await assert_healthy(transport, agent)
    return transport


# -- what HTTP/1.1 allows is answered ----------------------------------------------------------------


async def test_keep_alive_reuses_one_connection() -> None:
    async with serve() as agent:
        transport = LeanTransport()
        for i in range(5):
            reply = await get(transport, agent.port, f"/x/{i}")
            assert (reply.status, reply.body) == (200, f"/x/{i}".encode())
            assert transport.pool_state() == CLEAN_IDLE
        assert agent.connections == 1 and agent.paths == [f"/x/{i}" for i in range(5)]
        await transport.aclose()


@pytest.mark.parametrize(
    ("answer", "body", "header"),
    [
        # Interim responses come before the real one and are skipped.
        (
            b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\n" + ok(b"[1]"),
            b"[1]",
            None,
        ),
        # Whitespace around a value is not part of it.
        (b"HTTP/1.1 200 OK\r\nx-note:  one two \t\r\ncontent-length: 2\r\n\r\n{}", b"{}", b"one two"),
        # Chunked, with a chunk extension and trailers.
        (
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
            b'4\r\n{"a"\r\n3;ext=1\r\n:1}\r\n0\r\nx-trailer: t\r\n\r\n',
            b'{"a":1}',
            None,
        ),
        # Upper-case header names (handed over lower-cased) and a reason phrase with spaces.
        (b"HTTP/1.1 200 All Good Here\r\nCONTENT-LENGTH: 2\r\nX-Note: one two\r\n\r\n{}", b"{}", b"one two"),
        # Bytes beyond ASCII (obs-text) in a value are kept as they are.
        (b"HTTP/1.1 200 OK\r\nx-note: caf\xc3\xa9\r\ncontent-length: 2\r\n\r\n{}", b"{}", b"caf\xc3\xa9"),
        # Empty lines after the body are skipped before any next message (RFC 9112 §2.2): no message.
        (ok(b"{}") + b"\r\n", b"{}", None),
    ],
    ids=[
        "interim-responses",
        "value-whitespace",
        "chunked-trailers",
        "header-case",
        "obs-text",
        "blank-line-after",
    ],
)
async def test_what_http_allows_is_answered_and_the_connection_kept(
    answer: bytes, body: bytes, header: bytes | None
) -> None:
    async with serve(lambda path: (answer, False) if path == "/odd" else echo(path)) as agent:
        transport = LeanTransport()
        reply = await get(transport, agent.port, "/odd")
        assert (reply.status, reply.body) == (200, body)
        if header is not None:
            assert (b"x-note", header) in reply.headers
        assert transport.pool_state() == CLEAN_IDLE
        await assert_healthy(transport, agent)
        assert agent.connections == 1
        await transport.aclose()


async def test_bodies_without_length_end_their_connection() -> None:
    to_eof = b"HTTP/1.1 200 OK\r\n\r\n[1,2,3]"
    close = b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 2\r\n\r\n{}"
    old = b"HTTP/1.0 200 OK\r\ncontent-length: 2\r\n\r\n{}"
    # HTTP/1.0 keep-alive is an extension the pool does not take up: the connection is closed.
    old_alive = b"HTTP/1.0 200 OK\r\nconnection: keep-alive\r\ncontent-length: 2\r\n\r\n{}"
    answers = {
        "/eof": (to_eof, True),
        "/close": (close, True),
        "/old": (old, True),
        "/alive": (old_alive, False),
    }
    async with serve(lambda path: answers.get(path) or echo(path)) as agent:
        transport = LeanTransport()
        assert (await get(transport, agent.port, "/eof")).body == b"[1,2,3]"
        assert transport.pool_state() == EMPTY
        assert (await get(transport, agent.port, "/close")).body == b"{}"
        assert transport.pool_state() == EMPTY
        assert (await get(transport, agent.port, "/old")).body == b"{}"
        assert transport.pool_state() == EMPTY
        reply = await get(transport, agent.port, "/alive")
        assert (reply.body, reply.http_version) == (b"{}", b"HTTP/1.0")
        assert transport.pool_state() == EMPTY
        await assert_healthy(transport, agent)
        assert agent.connections == 5
        await transport.aclose()


async def test_body_less_replies_keep_the_connection_and_a_head_reply_closes_it() -> None:
    no_content = b"HTTP/1.1 204 No Content\r\n\r\n"
    not_modified = b"HTTP/1.1 304 Not Modified\r\ncontent-length: 1234\r\n\r\n"
    head = b"HTTP/1.1 200 OK\r\ncontent-length: 1234\r\n\r\n"
    answers = {"/none": (no_content, False), "/same": (not_modified, False), "/head": (head, False)}
    async with serve(lambda path: answers.get(path) or echo(path)) as agent:
        transport = LeanTransport()
        assert (await get(transport, agent.port, "/none")).body == b""
        assert transport.pool_state() == CLEAN_IDLE
        reply = await get(transport, agent.port, "/same")
        assert (reply.status, reply.body) == (304, b"")
        assert transport.pool_state() == CLEAN_IDLE
        # llhttp cannot be told the request was HEAD: the reply ends at its head, the connection closes.
        reply = await get(transport, agent.port, "/head", method="HEAD")
        assert (reply.status, reply.body) == (200, b"")
        assert transport.pool_state() == EMPTY
        await assert_healthy(transport, agent)
        assert agent.connections == 2
        await transport.aclose()


# -- what HTTP/1.1 forbids is a typed error, and the connection is dropped -----------------------------


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        (b"", "without sending a response"),
        (b'HTTP/1.1 200 OK\r\ncontent-length: 50\r\n\r\n{"half', "complete message body"),
        (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n10\r\nabc", "complete message body"),
        (b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\ncontent-length: 50\r\n", "response head"),
        # Two Content-Length headers are refused even when they agree (RFC 9110 §8.6 allows either).
        (b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ncontent-length: 2\r\n\r\n{}", "Duplicate Content-Length"),
        (b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ncontent-length: 3\r\n\r\n{}x", "Duplicate Content-Length"),
        (b"HTTP/1.1 200 OK\r\ncontent-length: 2, 3\r\n\r\n{}x", "Content-Length"),
        (b"HTTP/1.1 200 OK\r\ncontent-length: 2, 2\r\n\r\n{}", "Content-Length"),
        (b"HTTP/1.1 200 OK\r\ncontent-length: -2\r\n\r\n{}", "Content-Length"),
        (
            b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\ntransfer-encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
            "Transfer-Encoding can't be present with Content-Length",
        ),
        (
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-length: 5\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
            "Content-Length can't be present with Transfer-Encoding",
        ),
        # A framing field in the trailers.
        (
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\ncontent-length: 9\r\n\r\n",
            "Content-Length",
        ),
        # Obsolete line folding (RFC 9112 §5.2): refused, as llhttp does in its strict mode.
        (
            b"HTTP/1.1 200 OK\r\nx-note: one\r\n  two\r\ncontent-length: 2\r\n\r\n{}",
            "whitespace after header",
        ),
        (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n", "chunk size"),
        (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n-2\r\n{}\r\n0\r\n\r\n", "chunk size"),
        (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2 \r\n{}\r\n0\r\n\r\n", "chunk size"),
        (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\n{}XX0\r\n\r\n", "after chunk data"),
        (b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip\r\n\r\n{}", "Transfer-Encoding"),
        (
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip, chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
            "Transfer-Encoding",
        ),
        (
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n",
            "Transfer-Encoding",
        ),
        (b"HTTP/1.1 101 Switching Protocols\r\nupgrade: h2c\r\n\r\n", "malformed response"),
        (b"SMTP ready\r\n\r\n", "illegal status line"),
        # llhttp also frames RTSP and ICE replies and skips blank lines before a status line: not here.
        (b"RTSP/1.0 200 OK\r\ncontent-length: 2\r\n\r\n{}", "illegal status line"),
        (b"\r\nHTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}", "illegal status line"),
        (b"HTTP/1.1 99 Low\r\ncontent-length: 2\r\n\r\n{}", "status"),
        (b"HTTP/1.1 200 OK\ncontent-length: 2\n\n{}", "CR"),
        (b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n", "header token"),
        (b"HTTP/1.1 200 OK\r\ncontent-length : 2\r\n\r\n{}", "header field char"),
        (b"HTTP/1.1 200 OK\r\nx-note: a\x00b\r\ncontent-length: 2\r\n\r\n{}", "header value char"),
        (b"HTTP/1.1 200 OK\r\nx-note: a\x7fb\r\ncontent-length: 2\r\n\r\n{}", "header value char"),
        (b"HTTP/1.1 200 OK\r\ncontent-length: 99999999999\r\n\r\n", "refused"),
        (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + b"100001\r\n" + b"a" * 0x100001, "over"),
        (b"HTTP/1.1 200 OK\r\n\r\n" + b"a" * (1 << 20) + b"tail", "over"),
    ],
    ids=[
        "no-answer",
        "mid-body-close",
        "mid-chunk-close",
        "mid-head-close",
        "duplicate-equal-length",
        "conflicting-length",
        "conflicting-list",
        "equal-list",
        "negative-length",
        "length-and-chunked",
        "chunked-and-length",
        "length-in-trailers",
        "obs-fold",
        "bad-chunk-size",
        "negative-chunk-size",
        "space-after-chunk-size",
        "bad-chunk-footer",
        "unknown-coding",
        "coding-list",
        "two-codings",
        "unasked-101",
        "bad-status-line",
        "rtsp-status-line",
        "blank-line-first",
        "two-digit-status",
        "bare-lf",
        "bad-header-line",
        "space-before-colon",
        "nul-in-value",
        "del-in-value",
        "declared-too-large",
        "chunked-too-large",
        "eof-body-too-large",
    ],
)
async def test_broken_answers_are_protocol_errors_and_the_connection_is_dropped(
    answer: bytes, message: str
) -> None:
    async with serve(lambda path: (answer, True) if path == "/bad" else echo(path)) as agent:
        transport = LeanTransport(max_body_bytes=1 << 20)
        with pytest.raises(httpx.RemoteProtocolError, match=message):
            await get(transport, agent.port, "/bad")
        assert transport.pool_state() == EMPTY
        await assert_healthy(transport, agent)
        assert agent.connections == 2
        await transport.aclose()


async def test_large_bodies_and_bodies_read_to_eof_across_many_reads() -> None:
    # The head cap counts only reads that leave the head unfinished: a big body in the head's own
    # write is a body, not head bytes.
    big = b"x" * (512 << 10)
    pieces = [b"HTTP/1.1 200 OK\r\n", b"x-note: split\r\n\r\n", b"[to", b" eof", b"]"]

    async def in_pieces(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for piece in pieces:  # each drained on its own: the client may see them in separate reads
            writer.write(piece)
            await writer.drain()
        writer.close()

    async with serve(
        lambda path: (ok(big), False) if path == "/big" else echo(path), pieces=in_pieces
    ) as agent:
        transport = LeanTransport()
        assert (await get(transport, agent.port, "/big")).body == big
        assert transport.pool_state() == CLEAN_IDLE
        reply = await get(transport, agent.port, "/pieces")
        assert (reply.body, (b"x-note", b"split") in reply.headers) == (b"[to eof]", True)
        assert transport.pool_state() == EMPTY
        await assert_healthy(transport, agent)
        await transport.aclose()


# -- a body read in place ---------------------------------------------------------------------------

# More than one read's scratch (READ_BYTES): whatever the first read holds, the rest is read in place.
BIG = bytes(range(256)) * 1024
assert len(BIG) > READ_BYTES


def head_of(length: int) -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-length: " + str(length).encode() + b"\r\n\r\n"


@pytest.mark.parametrize("split", ["one-write", "head-alone", "head-and-a-byte", "in-pieces"])
async def test_a_long_body_is_read_in_place_whole_and_the_connection_kept(split: str) -> None:
    answer = ok(BIG)
    at = answer.index(b"\r\n\r\n") + 4
    writes = {
        "one-write": [answer],
        "head-alone": [answer[:at], answer[at:]],
        "head-and-a-byte": [answer[: at + 1], answer[at + 1 :]],
        "in-pieces": [answer[i : i + 7919] for i in range(0, len(answer), 7919)],
    }[split]
    served: list[Scripted] = []

    async def in_writes(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for piece in writes:  # each drained on its own: the client may see them in separate reads
            writer.write(piece)
            await writer.drain()
        await served[0].handle(reader, writer)  # then the same connection answers as usual

    async with serve(big=in_writes) as agent:
        served.append(agent)
        transport = LeanTransport()
        reply = await get(transport, agent.port, "/big")
        assert reply.body == BIG
        assert isinstance(reply.body, bytearray)  # read in place, not joined from llhttp's chunks
        assert transport.pool_state() == CLEAN_IDLE
        await assert_healthy(transport, agent)
        assert agent.connections == 2  # `handle` twice on one connection: the /next call reused it
        await transport.aclose()


async def test_a_long_body_cut_short_is_a_protocol_error() -> None:
    answers = {"/short": (head_of(len(BIG) + 100) + BIG, True)}
    async with serve(lambda path: answers.get(path) or echo(path)) as agent:
        transport = LeanTransport()
        with pytest.raises(httpx.RemoteProtocolError, match=f"received {len(BIG)} bytes"):
            await get(transport, agent.port, "/short")
        assert transport.pool_state() == EMPTY
        await assert_healthy(transport, agent)
        await transport.aclose()


async def test_a_long_body_stalled_midway_meets_the_read_deadline() -> None:
    async def stall(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(head_of(len(BIG)) + BIG[: len(BIG) // 2])
        await writer.drain()
        await asyncio.Event().wait()  # the connection stays open: only the deadline can end this

    async with serve(stall=stall) as agent:
        transport = await read_times_out(agent, "/stall")
        await transport.aclose()


@pytest.mark.parametrize("after", ["bytes-past-the-length", "a-second-response"])
async def test_bytes_past_a_long_body_are_never_the_next_reply(after: str) -> None:
    # A Content-Length shorter than what is sent: the reply is what it declared, the rest is never
    # read as a reply (the connection carrying it is closed, never parked for the next call).
    extra = BIG[:1000] if after == "bytes-past-the-length" else ok(b"unsolicited")
    answers = {"/long": (head_of(len(BIG)) + BIG + extra, False)}
    async with serve(lambda path: answers.get(path) or echo(path)) as agent:
        transport = LeanTransport()
        assert (await get(transport, agent.port, "/long")).body == BIG
        await until(lambda: transport.pool_state().idle == 0)
        await assert_healthy(transport, agent)
        assert agent.connections == 2
        await transport.aclose()


async def test_a_long_chunked_body_is_framed_by_llhttp() -> None:
    chunks = b"".join(
        b"%x\r\n%s\r\n" % (len(BIG[i : i + 30000]), BIG[i : i + 30000]) for i in range(0, len(BIG), 30000)
    )
    answer = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + chunks + b"0\r\n\r\n"
    async with serve(lambda path: (answer, False) if path == "/chunked" else echo(path)) as agent:
        transport = LeanTransport()
        reply = await get(transport, agent.port, "/chunked")
        assert (reply.body, type(reply.body)) == (BIG, bytes)
        assert transport.pool_state() == CLEAN_IDLE
        await assert_healthy(transport, agent)
        assert agent.connections == 1
        await transport.aclose()


async def test_a_header_block_without_end_is_refused_without_waiting_for_more() -> None:
    async def endless_head(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\n" + b"x-pad: aaaaaaaa\r\n" * 10000)
        await writer.drain()
        await asyncio.Event().wait()  # the connection stays open: only the client's cap can end this

    async with serve(endless=endless_head) as agent:
        transport = LeanTransport()
        with pytest.raises(httpx.RemoteProtocolError, match="too long"):
            await get(transport, agent.port, "/endless", read_s=GATE_S)
        assert transport.pool_state() == EMPTY
        await assert_healthy(transport, agent)
        await transport.aclose()


# -- never another call's bytes --------------------------------------------------------------------------


async def test_an_extra_response_in_the_same_write_is_never_the_next_reply() -> None:
    async with serve(lambda path: (ok(path.encode()) + ok(b"unsolicited"), False)) as agent:
        transport = LeanTransport()
        assert (await get(transport, agent.port, "/first")).body == b"/first"
        assert (await get(transport, agent.port, "/second")).body == b"/second"
        assert agent.connections == 2  # the first connection carried bytes beyond its reply: closed
        await transport.aclose()


async def test_an_extra_response_after_the_reply_closes_the_idle_connection() -> None:
    go = asyncio.Event()

    async def reply_then_extra(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(ok(b"/late"))
        await writer.drain()
        await go.wait()
        writer.write(ok(b"unsolicited"))
        await writer.drain()
        await asyncio.Event().wait()  # keeps the connection open: only the client can end it

    async with serve(late=reply_then_extra) as agent:
        transport = LeanTransport()
        assert (await get(transport, agent.port, "/late")).body == b"/late"
        assert transport.pool_state() == CLEAN_IDLE
        go.set()
        await until(lambda: transport.pool_state().idle == 0)  # the unsolicited bytes poisoned it
        await assert_healthy(transport, agent)
        assert agent.connections == 2
        await transport.aclose()


async def test_many_calls_in_flight_each_get_their_own_reply() -> None:
    # Every third answer is followed by an unsolicited one, every fifth hangs up mid-body.
    def script(path: str) -> tuple[bytes, bool]:
        if not path.startswith("/x/"):
            return echo(path)
        n = int(path.rsplit("/", 1)[1])
        if n % 5 == 0:
            return ok(path.encode())[:-3], True
        return (ok(path.encode()) + (ok(b"/x/999999") if n % 3 == 0 else b"")), False

    async with serve(script) as agent:
        transport = LeanTransport(max_connections=16)

        async def call(n: int) -> bytes | bytearray | None:
            try:
                return (await get(transport, agent.port, f"/x/{n}")).body
            except httpx.RemoteProtocolError:
                return None

        bodies = await asyncio.gather(*(call(n) for n in range(300)))
        for n, body in enumerate(bodies):
            assert body == (None if n % 5 == 0 else f"/x/{n}".encode())
        assert transport.pool_state().busy == 0
        await assert_healthy(transport, agent)
        await transport.aclose()


# -- hang-ups, half-closes, stale connections -----------------------------------------------------------


async def test_a_connection_the_server_closed_while_idle_is_not_reused() -> None:
    async with serve(lambda path: echo(path) if path != "/bye" else (ok(b"/bye"), True)) as agent:
        transport = LeanTransport()
        assert (await get(transport, agent.port, "/bye")).body == b"/bye"  # answered, then hung up
        await until(lambda: transport.pool_state().idle == 0)
        await assert_healthy(transport, agent)
        assert agent.connections == 2
        await transport.aclose()


async def test_half_closed_sockets() -> None:
    async def body_to_eof_then_half_close(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\n\r\n[to eof]")
        writer.write_eof()  # our side keeps reading: a half-closed socket, not a closed one
        await asyncio.Event().wait()

    async def half_close_without_answer(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write_eof()
        await asyncio.Event().wait()

    async def answer_then_half_close(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(ok(b"/kept"))
        writer.write_eof()
        await asyncio.Event().wait()

    handlers = {
        "eof": body_to_eof_then_half_close,
        "mute": half_close_without_answer,
        "kept": answer_then_half_close,
    }
    async with serve(**handlers) as agent:
        transport = LeanTransport()
        assert (await get(transport, agent.port, "/eof")).body == b"[to eof]"
        assert transport.pool_state() == EMPTY
        with pytest.raises(httpx.RemoteProtocolError, match="without sending a response"):
            await get(transport, agent.port, "/mute")
        assert transport.pool_state() == EMPTY
        assert (await get(transport, agent.port, "/kept")).body == b"/kept"
        await until(lambda: transport.pool_state().idle == 0)  # the EOF that followed is noticed
        await assert_healthy(transport, agent)
        assert agent.connections == 4
        await transport.aclose()


@pytest.mark.parametrize("slow", ["head", "body"])
async def test_a_slowloris_server_meets_the_read_deadline(slow: str) -> None:
    async def drip(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if slow == "head":
            stream = b"HTTP/1.1 200 OK\r\n" + b"x-pad: a\r\n" * 10000
        else:
            stream = b"HTTP/1.1 200 OK\r\ncontent-length: 100000\r\n\r\n" + b"a" * 100000
        for i in range(len(stream)):  # one byte at a time, each before the deadline could pass
            writer.write(stream[i : i + 1])
            await writer.drain()
            await asyncio.sleep(0.01)

    async with serve(drip=drip) as agent:
        transport = await read_times_out(agent, "/drip")
        await transport.aclose()


# -- cancellation at every await ------------------------------------------------------------------------


@contextlib.contextmanager
def full_backlog() -> Iterator[int]:
    """A listening socket that never accepts and whose queue is full: a connect to it hangs."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    fillers = []
    for _ in range(4):
        filler = socket.socket()
        filler.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            filler.connect(("127.0.0.1", port))
        fillers.append(filler)
    try:
        yield port
    finally:
        for s in [*fillers, listener]:
            s.close()


async def test_cancelled_while_waiting_for_a_slot() -> None:
    async with serve() as agent:
        agent.hold["/held"] = asyncio.Event()
        transport = LeanTransport(max_connections=1)
        held = asyncio.create_task(get(transport, agent.port, "/held"))
        await agent.reached("/held")
        queued = asyncio.create_task(get(transport, agent.port, "/queued"))
        await until(lambda: transport.pool_state().waiting == 1)
        queued.cancel()
        with pytest.raises(asyncio.CancelledError):
            await queued
        assert transport.pool_state() == PoolState(idle=0, busy=1, waiting=0)
        agent.hold["/held"].set()
        assert (await held).body == b"/held"
        await assert_healthy(transport, agent)
        assert "/queued" not in agent.paths and agent.connections == 1
        await transport.aclose()


async def test_cancelled_while_connecting() -> None:
    with full_backlog() as port:
        transport = LeanTransport(max_connections=1)
        task = asyncio.create_task(get(transport, port, "/"))
        await until(lambda: transport.pool_state().busy == 1)
        await asyncio.sleep(0.05)  # lets the connect start; it cannot finish, so the cancel lands in it
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert transport.pool_state() == EMPTY
        async with serve() as agent:  # the slot came back: a call to a live server goes through
            await assert_healthy(transport, agent)
        await transport.aclose()


async def test_cancelled_while_sending_a_body_the_server_does_not_read() -> None:
    accepted = asyncio.Event()

    async def never_read(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.set()
        await asyncio.Event().wait()

    server = await asyncio.start_server(never_read, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    transport = LeanTransport(max_connections=1)
    origin: Origin = ("http", "127.0.0.1", port)
    body = b"x" * (64 << 20)  # far beyond what loopback socket buffers hold
    headers = [(b"Host", b"h"), (b"Content-Length", str(len(body)).encode())]
    task = asyncio.create_task(transport.exchange("POST", origin, b"/", headers, body, Timeouts()))
    async with asyncio.timeout(GATE_S):
        await accepted.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert transport.pool_state() == EMPTY
    server.close()
    async with serve() as agent:
        await assert_healthy(transport, agent)
    await transport.aclose()


async def test_a_write_timeout_closes_the_connection() -> None:
    async def never_read(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.Event().wait()

    server = await asyncio.start_server(never_read, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    transport = LeanTransport(max_connections=1)
    body = b"x" * (64 << 20)
    headers = [(b"Host", b"h"), (b"Content-Length", str(len(body)).encode())]
    with pytest.raises(httpx.WriteTimeout):
        await transport.exchange(
            "POST", ("http", "127.0.0.1", port), b"/", headers, body, Timeouts(write=0.2)
        )
    assert transport.pool_state() == EMPTY
    server.close()
    await transport.aclose()


@pytest.mark.parametrize("stage", ["head", "body"])
async def test_cancelled_while_reading_the_response(stage: str) -> None:
    async def partial(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if stage == "body":
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n{")
            await writer.drain()
        await asyncio.Event().wait()

    async with serve(stuck=partial) as agent:
        transport = LeanTransport(max_connections=1)
        task = asyncio.create_task(get(transport, agent.port, "/stuck", read_s=None))
        await agent.reached("/stuck")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert transport.pool_state() == EMPTY
        await assert_healthy(transport, agent)
        assert agent.connections == 2
        await transport.aclose()


async def test_read_timeout_never_reuses_the_connection() -> None:
    answers = {"/slow": (b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\n{", False)}
    async with serve(lambda path: answers.get(path) or echo(path)) as agent:
        transport = await read_times_out(agent, "/slow", read_s=0.2)
        assert agent.connections == 2
        await transport.aclose()


# -- the pool ------------------------------------------------------------------------------------------


async def test_unreachable_is_a_connect_error() -> None:
    from gym_agent.launcher import free_port

    transport = LeanTransport()
    with pytest.raises(httpx.ConnectError):
        await get(transport, free_port(), "/")
    assert transport.pool_state() == EMPTY
    await transport.aclose()


async def test_connection_limit_queues_and_pool_timeout() -> None:
    async with serve() as agent:
        transport = LeanTransport(max_connections=1)
        first = asyncio.create_task(get(transport, agent.port, "/a"))
        second = asyncio.create_task(get(transport, agent.port, "/b"))
        assert [r.body for r in await asyncio.gather(first, second)] == [b"/a", b"/b"]
        assert agent.connections == 1  # the second waited for the first's connection
        agent.hold["/held"] = asyncio.Event()
        held = asyncio.create_task(get(transport, agent.port, "/held"))
        await agent.reached("/held")
        origin: Origin = ("http", "127.0.0.1", agent.port)
        with pytest.raises(httpx.PoolTimeout):
            await transport.exchange("GET", origin, b"/", [(b"Host", b"h")], b"", Timeouts(pool=0.05))
        agent.hold["/held"].set()
        assert (await held).body == b"/held"
        await assert_healthy(transport, agent)
        await transport.aclose()


@pytest.mark.parametrize(
    ("method", "target", "headers", "body", "message"),
    [
        ("GET", b"/", [], b"", "Host"),
        ("GET", b"/", [(b"Host", b"h"), (b"host", b"h")], b"", "Host"),
        ("GET", b"/", [(b"Host", b"h"), (b"X-Note", b"a\r\nX-Smuggled: 1")], b"", "header value"),
        ("GET", b"/", [(b"Host", b"h"), (b"X-Note", b"a\nb")], b"", "header value"),
        ("GET", b"/", [(b"Host", b"h"), (b"X-Note", b"a\x00b")], b"", "header value"),
        ("GET", b"/", [(b"Host", b"h\r\n")], b"", "header value"),
        ("GET", b"/", [(b"Host", b"h"), (b"X-Note\r\nX-Smuggled", b"1")], b"", "header name"),
        ("GET", b"/", [(b"Host", b"h"), (b"X Note", b"1")], b"", "header name"),
        ("GET", b"/ HTTP/1.1\r\nX-Smuggled: 1\r\n", [(b"Host", b"h")], b"", "target"),
        ("GET", b"/a b", [(b"Host", b"h")], b"", "target"),
        ("GET\r\n", b"/", [(b"Host", b"h")], b"", "method"),
        ("POST", b"/", [(b"Host", b"h"), (b"Content-Length", b"3")], b"{}", "Content-Length"),
        (
            "POST",
            b"/",
            [(b"Host", b"h"), (b"Content-Length", b"2"), (b"Content-Length", b"2")],
            b"{}",
            "Content-Length",
        ),
        ("POST", b"/", [(b"Host", b"h"), (b"Transfer-Encoding", b"chunked")], b"{}", "Transfer-Encoding"),
    ],
    ids=[
        "no-host",
        "two-hosts",
        "crlf-in-value",
        "lf-in-value",
        "nul-in-value",
        "crlf-in-host",
        "crlf-in-name",
        "space-in-name",
        "crlf-in-target",
        "space-in-target",
        "crlf-in-method",
        "length-mismatch",
        "two-lengths",
        "chunked-request",
    ],
)
async def test_a_malformed_request_is_a_local_error_and_sends_nothing(
    method: str, target: bytes, headers: list[tuple[bytes, bytes]], body: bytes, message: str
) -> None:
    async with serve() as agent:
        transport = LeanTransport()
        origin: Origin = ("http", "127.0.0.1", agent.port)
        with pytest.raises(httpx.LocalProtocolError, match=message):
            await transport.exchange(method, origin, target, headers, body, Timeouts())
        assert transport.pool_state() == EMPTY and agent.paths == []
        await assert_healthy(transport, agent)
        await transport.aclose()


async def test_a_body_without_content_length_gets_one() -> None:
    async with serve() as agent:
        transport = LeanTransport()
        origin: Origin = ("http", "127.0.0.1", agent.port)
        reply = await transport.exchange("POST", origin, b"/posted", [(b"Host", b"h")], b"{}", Timeouts())
        assert (reply.status, reply.body) == (200, b"/posted")
        await assert_healthy(transport, agent)
        assert agent.connections == 1  # the server read exactly the body: the connection stayed in step
        await transport.aclose()


async def test_it_is_an_httpx_transport() -> None:
    async with serve(lambda _: (JSON_OK, False)) as agent:
        async with httpx.AsyncClient(
            transport=LeanTransport(), base_url=f"http://127.0.0.1:{agent.port}"
        ) as c:
            response = await c.post("/p?q=1", json={"x": 1})
            assert response.status_code == 200 and response.json() == {"ok": True}
            assert response.headers["content-type"] == "application/json"
        assert agent.paths == ["/p?q=1"]


async def test_an_httpx_streamed_body_goes_whole_with_its_length() -> None:
    async def chunks() -> AsyncIterator[bytes]:
        yield b'{"x":'
        yield b"1}"

    async with serve() as agent:
        transport = LeanTransport()
        async with httpx.AsyncClient(transport=transport, base_url=f"http://127.0.0.1:{agent.port}") as c:
            # httpx frames a streamed body as chunked; the pool reads it whole and sends a length.
            response = await c.post("/streamed", content=chunks())
            assert (response.status_code, response.content) == (200, b"/streamed")
            assert (await c.get("/after")).content == b"/after"
        assert agent.connections == 1  # the server read exactly the body: the connection stayed in step
