"""A reference agent served in this process, restartable with its state directory kept or lost."""

from __future__ import annotations

import asyncio
import contextvars
import shutil
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

from gym_agent.app import create_app
from gym_agent.config import AgentConfig
from participant import ExecutionRegistry
from simulation.explore_store.plan import CallKind
from simulation.explore_store.process import INCARNATION
from trainer.gym.transport import Reply

DAY_S = 86_400.0


class Agent:
    """One reference agent served in-process: its app is called through httpx's ASGI transport.  A
    restart closes its registry (runs in flight end), starts a new app on the same state directory
    (kept) or on an empty one (lost: the old one is moved aside, its evidence still read by the
    checker), and breaks every call in flight to the old one."""

    def __init__(
        self, key: str, name: str, base: Path, seed: int, delay_s: float = 0.0, clock_back: bool = False
    ) -> None:
        self.key = key  # unique in the schedule (faults, restarts, its directory)
        self.name = name  # what it and its trainer call it (several trainers' agents may share it)
        self.base = base
        self.config = AgentConfig(
            name=name,
            state_dir=base / "state",
            zero_work=True,
            seed=seed,
            turns=(1, 2),
            log_level="error",
            delay_s=delay_s,
        )
        self.lives = 0
        self.restarts = 0
        # Its wall clock steps back a day at each restart (the new process's records are dated earlier
        # than the old one's): nothing may judge by those dates.
        self.clock_back = clock_back
        self.state_dirs = [base / "state"]
        self._start()

    def _start(self) -> None:
        app, registry = create_app(self.config)
        self.registry: ExecutionRegistry = registry
        if self.clock_back and self.restarts:
            back = DAY_S * self.restarts
            registry.evidence.clock = lambda: time.time() - back
        self.transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        self.lives += 1

    def restart(self, keep_state: bool) -> None:
        self.registry.close()
        self.registry.evidence.close()
        self.restarts += 1
        if not keep_state:
            lost = self.base / f"lost-{self.restarts}"
            shutil.move(str(self.config.resolved_state_dir), lost)
            self.state_dirs.append(lost)
        self._start()

    async def call(
        self, method: str, target: bytes, headers: Sequence[tuple[bytes, bytes]], body: bytes
    ) -> Reply:
        """One request to the app, in a task of no trainer's (the agent's work is not the trainer's)."""
        life, transport = self.lives, self.transport
        request = httpx.Request(method, "http://agent" + target.decode(), headers=list(headers), content=body)

        async def send() -> Reply:
            response = await transport.handle_async_request(request)
            data = await response.aread()
            return Reply(response.status_code, response.headers.raw, data)

        context = contextvars.copy_context()
        context.run(INCARNATION.set, None)
        reply = await asyncio.shield(asyncio.get_running_loop().create_task(send(), context=context))
        if self.lives != life:
            raise httpx.ReadError("the agent restarted while the call was in flight")
        return reply


def call_kind(method: str, target: bytes) -> CallKind:
    path = target.decode()
    if path == "/run":
        return "run"
    for prefix, kind in (
        ("/completion_receipt/", "receipt"),
        ("/token_capture/", "tokens"),
        ("/acknowledge", "ack"),
        ("/retire", "retire"),
        ("/checkpoint/prepare", "prepare"),
        ("/checkpoint/commit", "commit"),
        ("/checkpoint/resume", "resume"),
        ("/checkpoint/abort", "abort"),
        ("/status", "status"),
    ):
        if path.startswith(prefix):
            return kind  # type: ignore[return-value]
    return "other"
