"""Real agents over loopback HTTP and a coordinator on a fresh log."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AsyncExitStack, ExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from eventstore import EventStore, open_store
from eventstore.events import PromptRef
from gym_agent.config import AgentConfig
from gym_agent.server import ThreadAgent, serve_in_thread
from trainer import RolloutCoordinator, SealedGroup
from trainer.gym import GymClient

_ids = itertools.count()

MakeAgent = Callable[..., ThreadAgent]


def gid(prefix: str = "p") -> str:
    return f"{prefix}{next(_ids)}"


def set_setting(coord: RolloutCoordinator, **values: Any) -> None:
    """Changes a setting of a running coordinator (a test's gate on a lease): every part of it holds
    the one `Settings` value, so it is changed in place."""
    for name, value in values.items():
        object.__setattr__(coord.settings, name, value)


PROMPT = PromptRef(sample_id="s1", task_name="math")
PAYLOAD: dict[str, Any] = {"responses_create_params": {"input": [{"role": "user", "content": "2+2?"}]}}


@pytest.fixture
def make_agent(tmp_path: Path) -> Iterator[MakeAgent]:
    with ExitStack() as stack:

        def make(name: str = "agent", **overrides: Any) -> ThreadAgent:
            values: dict[str, Any] = {
                "name": name,
                "state_dir": tmp_path / name,
                "log_level": "warning",
                "turns": (2, 3),
                "delay_s": 0.02,
            }
            values.update(overrides)
            return stack.enter_context(serve_in_thread(AgentConfig(**values)))

        yield make


@pytest.fixture
def store(store_url: str) -> Iterator[EventStore]:
    s = open_store(store_url)
    yield s
    s.close()


@pytest.fixture
def sqlite_store(sqlite_url: str) -> Iterator[EventStore]:
    s = open_store(sqlite_url, migrate_schema=True)
    yield s
    s.close()


@pytest.fixture
async def clients() -> AsyncIterator[Callable[[ThreadAgent], GymClient]]:
    async with AsyncExitStack() as stack:
        made: list[GymClient] = []

        def make(agent: Any, name: str | None = None) -> GymClient:
            c = GymClient(agent.url, name or (agent.config.name if hasattr(agent, "config") else agent.name))
            made.append(c)
            return c

        yield make
        for c in made:
            await stack.enter_async_context(c)


def coordinator(store: EventStore, agents: dict[str, GymClient], **kwargs: Any) -> RolloutCoordinator:
    kwargs.setdefault("rollout_timeout_s", 10.0)
    kwargs.setdefault("prepare_timeout_s", 20.0)
    return RolloutCoordinator(store, agents, **kwargs)


@asynccontextmanager
async def one_sealed_group(
    store: EventStore,
    make_agent: MakeAgent,
    mode: str,
    tries: int,
    *,
    settle: bool = True,
    **agent_options: Any,
) -> AsyncIterator[tuple[RolloutCoordinator, SealedGroup]]:
    """One agent "a" (`agent_options`: its `AgentConfig`'s), a coordinator on `store` (a minute a
    try), one group of `tries` submitted and sealed; open while the caller reads or damages what it
    stored.  `settle`: idle first (every payload put and every event appended), else as soon as the
    seal is read."""
    agent = make_agent("a", **agent_options)
    async with GymClient(agent.url, "a") as client:
        coord = coordinator(store, {"a": client}, mode=mode, rollout_timeout_s=60.0)
        async with coord:
            await coord.submit(gid(), PROMPT, "a", tries, PAYLOAD)
            [sealed] = [s async for s in coord.sealed_groups()]
            if settle:
                await coord.wait_idle(120)
            yield coord, sealed
