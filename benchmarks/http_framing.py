"""CPU per HTTP exchange of the Gym transport's framing: llhttp (ours) against h11 (the baseline).

No sockets: each exchange writes the bytes of a typical `GymClient` request and frames a typical reply
(`200`, JSON body, the headers uvicorn sends) fed as one read, on one kept-alive connection, the way
`LeanTransport` does per call.  The baseline drives an `h11.Connection` the way the transport did
before it moved to llhttp (h11 stays installed: httpcore, under httpx, runs on it); ours is
`encode_request` and a `Link` fed the reply through its `data_received`.  Both run in this process,
alternately, and the table gives the best of `--repeats` rounds of `--exchanges` each.

    python -m benchmarks.http_framing
    python -m benchmarks.http_framing --body-bytes 20000 --exchanges 50000
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Callable

import h11
from rich.console import Console
from rich.table import Table

from trainer.gym.connection import Link
from trainer.gym.http_request import encode_request
from trainer.gym.http_types import Reply

HEADERS = [
    (b"Host", b"127.0.0.1:8000"),
    (b"Accept", b"application/json"),
    (b"User-Agent", b"ledger-gym-client"),
    (b"Content-Length", b"2"),
    (b"Content-Type", b"application/json"),
]
REQUEST_BODY = b"{}"


def reply_bytes(body_bytes: int) -> bytes:
    body = b'{"x":"' + b"a" * max(0, body_bytes - 8) + b'"}'
    head = (
        b"HTTP/1.1 200 OK\r\ndate: Mon, 30 Nov 2026 12:00:00 GMT\r\nserver: uvicorn\r\n"
        b"content-length: " + str(len(body)).encode() + b"\r\ncontent-type: application/json\r\n\r\n"
    )
    return head + body


def h11_rounds(reply: bytes) -> Callable[[int], float]:
    conn = h11.Connection(h11.CLIENT, max_incomplete_event_size=64 * 1024)

    def run(n: int) -> float:
        start = time.process_time()
        for _ in range(n):
            wire = conn.send(h11.Request(method="POST", target=b"/run", headers=HEADERS)) or b""
            wire += conn.send(h11.Data(data=REQUEST_BODY)) or b""
            wire += conn.send(h11.EndOfMessage()) or b""
            conn.receive_data(reply)
            head: h11.Response | None = None
            parts: list[bytes] = []
            while True:
                event = conn.next_event()
                if isinstance(event, h11.Response):
                    head = event
                elif isinstance(event, h11.Data):
                    parts.append(event.data)
                elif isinstance(event, h11.EndOfMessage):
                    break
            assert head is not None and parts
            conn.start_next_cycle()
        return time.process_time() - start

    return run


class _Sink:
    """Stands in for the socket: `Link` only writes to it and asks whether it is closing."""

    def write(self, data: bytes) -> None:
        pass

    def is_closing(self) -> bool:
        return False

    def close(self) -> None:
        raise AssertionError("a clean exchange never closes its connection")


def llhttp_rounds(reply: bytes, loop: asyncio.AbstractEventLoop) -> Callable[[int], float]:
    link = Link(256 * 1024 * 1024)
    link.transport = _Sink()  # type: ignore[assignment]

    def run(n: int) -> float:
        start = time.process_time()
        for _ in range(n):
            # What `Link.exchange` does before and after its await, without the await.
            wire = encode_request("POST", b"/run", HEADERS, REQUEST_BODY)
            assert wire
            future: asyncio.Future[Reply] = loop.create_future()
            link._reply, link._head_only = future, False
            link._status, link._parts, link._size, link._head_bytes, link._heard = 0, [], 0, 0, False
            link.data_received(reply)
            assert future.result().status == 200
        return time.process_time() - start

    return run


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--exchanges", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--body-bytes", type=int, default=600, help="reply body size")
    args = parser.parse_args()
    reply = reply_bytes(args.body_bytes)
    loop = asyncio.new_event_loop()
    variants = {
        "h11 (baseline)": h11_rounds(reply),
        "llhttp + encode_request (ours)": llhttp_rounds(reply, loop),
    }
    best = {name: float("inf") for name in variants}
    for _ in range(args.repeats):
        for name, run in variants.items():  # alternately, so drift in the machine's load hits both
            best[name] = min(best[name], run(args.exchanges))
    loop.close()
    baseline = best["h11 (baseline)"]
    table = Table(
        title=f"HTTP framing, {args.exchanges:,} exchanges x {args.repeats}, reply {len(reply):,} bytes"
    )
    for column in ("framing", "us per exchange (best round)", "vs h11"):
        table.add_column(column, justify="left" if column == "framing" else "right")
    for name, seconds in best.items():
        table.add_row(name, f"{seconds / args.exchanges * 1e6:.1f}", f"{seconds / baseline:.2f}x")
    Console().print(table)


if __name__ == "__main__":
    main()
