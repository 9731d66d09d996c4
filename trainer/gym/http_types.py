"""The shapes one HTTP exchange of the Gym client takes and gives: where it goes (`Origin`), how long
each phase may take (`Timeouts`) and the reply it ends with (`Reply`).

They are shared by the connection (`trainer.gym.connection`), the pool (`trainer.gym.transport`) and
the client's exchange (`trainer.gym.exchange`), so they live below all three.
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx

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
    # A body read in place is the bytearray it was read into (not copied to bytes): read it, never
    # write it.
    body: bytes | bytearray
    http_version: bytes = b"HTTP/1.1"
    reason: bytes = b""
