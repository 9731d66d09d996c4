"""Real agents on loopback: uvicorn in a thread for most tests, subprocesses for crash/stop tests."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest

from gym_agent.config import AgentConfig
from gym_agent.server import ThreadAgent, serve_in_thread
from protocol.wire import RunRequest, TokenEntry
from trainer.gym import GymClient

TOKEN = "s3cret-token-for-tests"
_ids = itertools.count()

MakeAgent = Callable[..., ThreadAgent]


def fresh_id(prefix: str = "r") -> str:
    """A rollout id no other test in this session uses (agents are shared)."""
    return f"{prefix}{next(_ids)}"


async def token_entries(client: GymClient, key: str) -> list[TokenEntry]:
    """The try's token records as `TokenEntry` models (the client hands over arrays; tests compare fields)."""
    arrays = await client.token_capture(key)
    return [TokenEntry.model_validate(r) for r in arrays.to_records()]


def run_request(rollout_id: str, attempt_index: int = 0, **task: Any) -> RunRequest:
    return RunRequest(
        rollout_id=rollout_id,
        attempt_index=attempt_index,
        responses_create_params={"input": [{"role": "user", "content": "2+2?"}]},
        **(task or {"question_id": rollout_id.split("_")[0]}),
    )


async def wait_for(predicate: Callable[[], Awaitable[bool]], timeout_s: float = 60.0, what: str = "") -> None:
    """Polls until `predicate` holds; the bound only guards against waiting for ever (a loaded
    machine can take seconds for what takes milliseconds alone)."""
    async with asyncio.timeout(timeout_s):
        while not await predicate():
            await asyncio.sleep(0.01)


def _config(state_dir: Path, name: str, **overrides: Any) -> AgentConfig:
    values: dict[str, Any] = {"name": name, "state_dir": state_dir / name, "log_level": "warning"}
    values.update(overrides)
    return AgentConfig(**values)


@pytest.fixture(scope="session")
def shared_agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ThreadAgent]:
    """One agent for tests that use their own ids and leave the phase idle."""
    with serve_in_thread(_config(tmp_path_factory.mktemp("agents"), "shared")) as agent:
        yield agent


@pytest.fixture(scope="session")
def token_agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ThreadAgent]:
    with serve_in_thread(_config(tmp_path_factory.mktemp("agents"), "guarded", token=TOKEN)) as agent:
        yield agent


@pytest.fixture
def make_agent(tmp_path: Path) -> Iterator[MakeAgent]:
    """Fresh agents for tests that move the checkpoint phase or need their own settings."""
    with ExitStack() as stack:

        def make(name: str = "agent", **overrides: Any) -> ThreadAgent:
            return stack.enter_context(serve_in_thread(_config(tmp_path, name, **overrides)))

        yield make


@pytest.fixture
async def client(shared_agent: ThreadAgent) -> AsyncIterator[GymClient]:
    async with GymClient(shared_agent.url, shared_agent.config.name) as c:
        yield c


@pytest.fixture
async def token_client(token_agent: ThreadAgent) -> AsyncIterator[GymClient]:
    async with GymClient(token_agent.url, token_agent.config.name, token=TOKEN) as c:
        yield c
