"""The fleet audit (simulation.agent_audit) sees, from a real agent's state directory and phase beside
the log, what the log alone cannot: a result the log paid still held (two agents of one name mixed
up), an agent shared by two trainers, and an agent left prepared by a checkpoint the log aborted."""

from __future__ import annotations

from pathlib import Path

import pytest

from eventstore import open_store
from gym_agent.config import AgentConfig
from gym_agent.server import serve_in_thread
from projections.ownership import AgentRef
from simulation.agent_audit import (
    NO_STALE_PREPARE,
    ONE_TRAINER_PER_AGENT,
    PAID_RESULT_HELD,
    AgentSeen,
    audit_agents,
)
from tests.gym.conftest import run_request
from tests.projections.builder import LogBuilder
from trainer.gym import GymClient, NotReadyError

A = AgentRef("A", "ag")


async def test_each_case_is_named_and_a_clean_fleet_is_clean(tmp_path: Path, sqlite_url: str) -> None:
    store = open_store(sqlite_url, migrate_schema=True)
    log = LogBuilder(store, agent="ag")
    # Trainer A's group g1: both tries sealed and ACKed in the log.
    log.reserve("g1", generations=2, trainer="A")
    log.mint("g1", generations=2)
    for rid in ("g1_g0", "g1_g1"):
        log.dispatch(rid)
        log.reply(rid)
        log.seal(rid)
        log.ack(rid)
    # Trainer B's group g2 (B drives its own agent "ag").
    b = LogBuilder(store, agent="ag")
    b.reserve("g2", generations=1, trainer="B")
    state = tmp_path / "ag"
    with serve_in_thread(AgentConfig(name="ag", state_dir=state, log_level="warning", turns=(1, 1))) as agent:
        async with GymClient(agent.url, "ag") as client:
            # A's agent ran g1_g0 and released it: clean.
            await client.run(run_request("g1_g0"))
            receipt = await client.completion_receipt("g1_g0", 0)
            assert (await client.acknowledge([receipt]))[0].acknowledged
            assert audit_agents(store, {A: AgentSeen(state, await client.status())}) == []
            # Case 1: the agent holds g1_g1 unreleased, which the log says was ACKed (the ACK went
            # to B's agent of the same name).
            await client.run(run_request("g1_g1"))
            # Case 2: B's try g2_g0 ran at A's agent.
            await client.run(run_request("g2_g0"))
            # Case 5: prepared by checkpoint ck1, which the log aborted.
            log.prepare("ck1", participants=["ag"], trainer="A")
            log.abort("ck1")
            # (not ready: it holds unreleased results; it stays preparing ck1 all the same)
            with pytest.raises(NotReadyError):
                await client.prepare("ck1", timeout_s=0.5)
            assert (await client.status()).active_checkpoint_id == "ck1"
            found = audit_agents(store, {A: AgentSeen(state, await client.status())})
            await client.abort("ck1")
    by_rule = {v.rule: v.message for v in found}
    assert set(by_rule) == {PAID_RESULT_HELD, ONE_TRAINER_PER_AGENT, NO_STALE_PREPARE}, by_rule
    assert "g1_g1#0" in by_rule[PAID_RESULT_HELD] and "g1_g0" not in by_rule[PAID_RESULT_HELD]
    assert "g2_g0#0 (trainer 'B')" in by_rule[ONE_TRAINER_PER_AGENT]
    assert "ck1" in by_rule[NO_STALE_PREPARE] and "aborted" in by_rule[NO_STALE_PREPARE]
    assert all(str(A) in v.line() for v in found)
    store.close()


async def test_a_binding_to_another_trainer_is_named(tmp_path: Path, sqlite_url: str) -> None:
    store = open_store(sqlite_url, migrate_schema=True)
    state = tmp_path / "ag"
    with serve_in_thread(AgentConfig(name="ag", state_dir=state, log_level="warning")) as agent:
        async with GymClient(agent.url, "ag") as client:
            await client.bind_driver("B")
    found = audit_agents(store, {A: AgentSeen(state)})
    assert [(v.rule, v.message) for v in found] == [
        (ONE_TRAINER_PER_AGENT, "bound to trainer 'B', driven by trainer 'A'")
    ]
    store.close()
