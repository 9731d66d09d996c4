"""Agents for the hostile-input tests: real uvicorn on loopback, zero-work episodes (fast)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest

from gym_agent.config import AgentConfig
from gym_agent.server import ThreadAgent, serve_in_thread
from trainer.gym import GymClient

TOKEN = "hostile-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def agent_config(state_dir: Path, name: str, **overrides: Any) -> AgentConfig:
    values: dict[str, Any] = {
        "name": name,
        "state_dir": state_dir / name,
        "token": TOKEN,
        "zero_work": True,
        "turns": (1, 2),
        "log_level": "error",
    }
    values.update(overrides)
    return AgentConfig(**values)


@pytest.fixture(scope="module")
def two_agents(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ThreadAgent, ThreadAgent]]:
    root = tmp_path_factory.mktemp("hostile-agents")
    with ExitStack() as stack:
        a = stack.enter_context(serve_in_thread(agent_config(root, "agent-a")))
        b = stack.enter_context(serve_in_thread(agent_config(root, "agent-b", seed=1)))
        yield a, b


@pytest.fixture
async def clients(two_agents: tuple[ThreadAgent, ThreadAgent]) -> AsyncIterator[tuple[GymClient, GymClient]]:
    a, b = two_agents
    async with (
        GymClient(a.url, a.config.name, token=TOKEN) as ca,
        GymClient(b.url, b.config.name, token=TOKEN) as cb,
    ):
        yield ca, cb


@pytest.fixture
async def raw_a(two_agents: tuple[ThreadAgent, ThreadAgent]) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=two_agents[0].url, timeout=20, headers=AUTH) as c:
        yield c
