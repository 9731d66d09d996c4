"""The `GymClient` as its private workers see it (`trainer.gym.runs`, `.control`, `.phases`).

Each worker holds the client itself, not copies of its parts, and reads them at each call: a caller
may replace a pool after construction (tests and the simulation put counting or faulty pools in), a
subclass may override `_send` or `_exchange` (tests gate and break calls there) or a public call, and
`connect` may set `reduced` at any time.  A Protocol, so the workers need not import the client that
imports them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from pydantic import BaseModel

from trainer.gym.http_types import Reply
from trainer.gym.reduced import ReducedMode
from trainer.gym.transport import LeanTransport


class Facade(Protocol):
    base_url: str
    agent_name: str
    control_timeout_s: float
    reduced: ReducedMode | None
    _run: LeanTransport
    _control: LeanTransport
    _phases: LeanTransport
    _trainer: tuple[tuple[bytes, bytes], ...]

    @property
    def completion_in_run(self) -> bool: ...

    @property
    def carries_completed(self) -> bool: ...

    async def connect_quietly(self) -> None: ...

    async def _send(
        self,
        pool: LeanTransport,
        method: str,
        path: str,
        *,
        body: BaseModel | None = None,
        timeout_s: float | None = None,
        extra_headers: Sequence[tuple[bytes, bytes]] = (),
    ) -> Reply: ...

    async def _exchange(
        self,
        pool: LeanTransport,
        method: str,
        path: str,
        *,
        body: BaseModel | None = None,
        timeout_s: float | None = None,
        extra_headers: Sequence[tuple[bytes, bytes]] = (),
    ) -> Reply: ...
