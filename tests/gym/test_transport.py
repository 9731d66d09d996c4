"""The client's HTTP/1.1 transport against a scripted server on loopback (real sockets, exact bytes)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import httpx
import pytest

from trainer.gym.transport import LeanTransport, Origin, Reply, Timeouts

JSON_OK = b'HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 11\r\n\r\n{"ok":true}'


@dataclass
class Scripted:
    """Answers each request with `script(path)`: the bytes to send, then whether to hang up."""

    script: Callable[[str], tuple[bytes, bool]]
    connections: int = 0
    paths: list[str] = field(default_factory=list)
    port: int = 0
    # Paths whose answer waits for their event.
    hold: dict[str, asyncio.Event] = field(default_factory=dict)

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
                if path in self.hold:
                    await self.hold[path].wait()
                answer, hang_up = self.script(path)
                writer.write(answer)
                await writer.drain()
                if hang_up:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


@contextlib.asynccontextmanager
async def serve(script: Callable[[str], tuple[bytes, bool]]) -> AsyncIterator[Scripted]:
    scripted = Scripted(script)
    server = await asyncio.start_server(scripted.handle, "127.0.0.1", 0)
    scripted.port = server.sockets[0].getsockname()[1]
    try:
        yield scripted
    finally:
        server.close()
        await server.wait_closed()


async def get(transport: LeanTransport, port: int, path: str, read_s: float | None = 5.0) -> Reply:
    origin: Origin = ("http", "127.0.0.1", port)
    headers = [(b"Host", f"127.0.0.1:{port}".encode()), (b"Content-Length", b"0")]
    return await transport.exchange(
        "GET", origin, path.encode(), headers, b"", Timeouts(5.0, read_s, 5.0, 5.0)
    )


async def test_keep_alive_reuses_one_connection() -> None:
    async with serve(lambda _: (JSON_OK, False)) as agent:
        transport = LeanTransport()
        for i in range(5):
            reply = await get(transport, agent.port, f"/x/{i}")
            assert (reply.status, reply.body) == (200, b'{"ok":true}')
        assert agent.connections == 1 and agent.paths == [f"/x/{i}" for i in range(5)]
        await transport.aclose()


async def test_chunked_and_read_to_eof_bodies() -> None:
    chunked = b'HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n4\r\n{"a"\r\n3;ext=1\r\n:1}\r\n0\r\n\r\n'
    to_eof = b"HTTP/1.1 200 OK\r\n\r\n[1,2,3]"

    def script(path: str) -> tuple[bytes, bool]:
        return (chunked, False) if path == "/chunked" else (to_eof, True)

    async with serve(script) as agent:
        transport = LeanTransport()
        assert (await get(transport, agent.port, "/chunked")).body == b'{"a":1}'
        assert (await get(transport, agent.port, "/eof")).body == b"[1,2,3]"
        # A body read to EOF ends its connection: the next call opens another.
        assert (await get(transport, agent.port, "/chunked")).body == b'{"a":1}'
        assert agent.connections == 2
        await transport.aclose()


async def test_connection_close_and_a_server_that_closed_an_idle_connection() -> None:
    close = b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 2\r\n\r\n{}"
    async with serve(lambda path: (close, False) if path == "/close" else (JSON_OK, True)) as agent:
        transport = LeanTransport()
        await get(transport, agent.port, "/close")
        await get(transport, agent.port, "/then")  # served, then the server hangs up the idle connection
        await asyncio.sleep(0.05)
        # The stale connection is noticed before reuse: no error, a fresh connection.
        assert (await get(transport, agent.port, "/again")).status == 200
        assert agent.connections == 3
        await transport.aclose()


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        (b"", "without sending a response"),
        (b'HTTP/1.1 200 OK\r\ncontent-length: 50\r\n\r\n{"half', "complete message body"),
        (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n10\r\nabc", "complete message body"),
        (b"SMTP ready\r\n\r\n", "malformed status line"),
        (b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n", "malformed header line"),
        (b"HTTP/1.1 200 OK\r\ncontent-length: 99999999999\r\n\r\n", "refused"),
    ],
)
async def test_broken_answers_are_protocol_errors_and_the_connection_is_dropped(
    answer: bytes, message: str
) -> None:
    async with serve(lambda path: (answer, True) if path == "/bad" else (JSON_OK, False)) as agent:
        transport = LeanTransport(max_body_bytes=1 << 20)
        with pytest.raises(httpx.RemoteProtocolError, match=message):
            await get(transport, agent.port, "/bad")
        assert (await get(transport, agent.port, "/good")).status == 200
        assert agent.connections == 2
        await transport.aclose()


async def test_read_timeout_and_cancellation_never_reuse_the_connection() -> None:
    answers = {"/slow": (b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\n{", False)}
    async with serve(lambda path: answers.get(path, (JSON_OK, False))) as agent:
        transport = LeanTransport()
        with pytest.raises(httpx.ReadTimeout):
            await get(transport, agent.port, "/slow", read_s=0.2)
        task = asyncio.create_task(get(transport, agent.port, "/slow", read_s=None))
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # Both half-read connections were closed; the answer to this call is not the old tail.
        assert (await get(transport, agent.port, "/good")).body == b'{"ok":true}'
        assert agent.connections == 3
        await transport.aclose()


async def test_unreachable_is_a_connect_error() -> None:
    from gym_agent.launcher import free_port

    transport = LeanTransport()
    with pytest.raises(httpx.ConnectError):
        await get(transport, free_port(), "/")
    await transport.aclose()


async def test_connection_limit_queues_and_pool_timeout() -> None:
    async with serve(lambda _: (JSON_OK, False)) as agent:
        transport = LeanTransport(max_connections=1)
        first = asyncio.create_task(get(transport, agent.port, "/a"))
        second = asyncio.create_task(get(transport, agent.port, "/b"))
        assert [r.status for r in await asyncio.gather(first, second)] == [200, 200]
        assert agent.connections == 1  # the second waited for the first's connection
        agent.hold["/held"] = asyncio.Event()
        held = asyncio.create_task(get(transport, agent.port, "/held"))
        await asyncio.sleep(0.1)
        origin: Origin = ("http", "127.0.0.1", agent.port)
        with pytest.raises(httpx.PoolTimeout):
            await transport.exchange("GET", origin, b"/", [], b"", Timeouts(pool=0.05))
        agent.hold["/held"].set()
        assert (await held).status == 200
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
