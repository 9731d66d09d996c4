"""One trainer per agent: the binding at /driver, the header on every call that changes what the
agent holds, and the release when it holds nothing (participant.driver)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gym_agent.config import AgentConfig
from gym_agent.server import serve_in_thread
from tests.gym.conftest import MakeAgent, run_request
from trainer.gym import GymClient, GymError, TrainerConflictError


async def test_an_agent_is_driven_by_one_trainer_at_a_time(make_agent: MakeAgent) -> None:
    agent = make_agent("ag")
    async with GymClient(agent.url, "ag") as a, GymClient(agent.url, "ag") as b:
        a.drive_as("A")
        b.drive_as("B")
        bound = await a.bind_driver("A")
        assert bound is not None and (bound.bound, bound.trainer_id) == (True, "A")
        assert (await a.bind_driver("A")) == bound  # again: the same answer
        with pytest.raises(TrainerConflictError, match="driven by trainer 'A', not by trainer 'B'"):
            await b.bind_driver("B")
        # Every call of B's that changes what the agent holds is refused; reads are not.
        for call in (
            lambda: b.run(run_request("rB")),
            lambda: b.retire("rB", 0),
            lambda: b.prepare("ck", timeout_s=1),
            lambda: b.abort("ck"),
            lambda: b.commit("ck"),
        ):
            with pytest.raises(TrainerConflictError):
                await call()
        assert "rB" not in await b.debug_runs()
        assert (await b.status()).phase == "idle"
        # A runs; while it holds an unacknowledged result, its release keeps the binding.
        await a.run(run_request("rA"))
        kept = await a.release_driver("A")
        assert kept is not None and kept.bound and kept.trainer_id == "A"
        with pytest.raises(TrainerConflictError):
            await b.release_driver("B")
        receipt = await a.completion_receipt("rA", 0)
        with pytest.raises(TrainerConflictError):  # B cannot release what A owes
            await b.acknowledge([receipt])
        assert (await a.acknowledge([receipt]))[0].acknowledged
        released = await a.release_driver("A")
        assert released is not None and not released.bound
        # Unbound, the first call naming a trainer binds the agent to it.
        await b.run(run_request("rB2"))
        with pytest.raises(TrainerConflictError, match="driven by trainer 'B'"):
            await a.run(run_request("rA2"))


async def test_the_unnamed_trainer_is_a_trainer_too(make_agent: MakeAgent) -> None:
    agent = make_agent("ag")
    async with GymClient(agent.url, "ag") as unnamed, GymClient(agent.url, "ag") as named:
        unnamed.drive_as(None)
        named.drive_as("A")
        await unnamed.run(run_request("r0"))
        with pytest.raises(TrainerConflictError, match="driven by the unnamed trainer, not by trainer 'A'"):
            await named.bind_driver("A")
        # A client that names no trainer (an operator's tool) is not checked.
        async with GymClient(agent.url, "ag") as tool:
            receipt = await tool.completion_receipt("r0", 0)
            assert (await tool.acknowledge([receipt]))[0].acknowledged


async def test_the_binding_survives_a_restart_with_the_state_directory(tmp_path: Path) -> None:
    config = AgentConfig(name="ag", state_dir=tmp_path / "ag", log_level="warning")
    with serve_in_thread(config) as agent:
        async with GymClient(agent.url, "ag") as a:
            await a.bind_driver("A")
    with serve_in_thread(config) as agent:
        async with GymClient(agent.url, "ag") as b:
            with pytest.raises(TrainerConflictError, match="driven by trainer 'A'"):
                await b.bind_driver("B")
    # A lost state directory loses the binding with the results it guarded.
    fresh = AgentConfig(name="ag", state_dir=tmp_path / "ag-new", log_level="warning")
    with serve_in_thread(fresh) as agent:
        async with GymClient(agent.url, "ag") as b:
            answer = await b.bind_driver("B")
            assert answer is not None and answer.trainer_id == "B"


async def test_a_bad_trainer_header_is_refused_as_a_request(make_agent: MakeAgent) -> None:
    agent = make_agent("ag")
    async with GymClient(agent.url, "ag") as c:
        c._trainer = ((b"x-ledger-trainer", b"not a trainer id"),)
        with pytest.raises(GymError, match="is not a trainer id"):
            await c.retire("r", 0)
        assert (await c.status()).phase == "idle"
