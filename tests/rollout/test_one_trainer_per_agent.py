"""One trainer per agent, at the coordinator: a second trainer given an agent another one drives is
refused at `start()` with one line, having written nothing, or, when the agent was away at its start,
at its first call to it, the same way (trainer.core.refusal); once the first closes holding nothing at
the agent, the agent is free for the next trainer."""

from __future__ import annotations

import asyncio

import pytest

from eventstore import EventStore
from projections.audit import audit_log
from protocol.streams import group_stream
from tests.rollout.conftest import PAYLOAD, PROMPT, MakeAgent, coordinator, gid
from tests.rollout.test_retire_owed import Cuttable
from trainer import AgentShared, RolloutCoordinator
from trainer.gym import GymClient


async def test_a_second_trainer_is_refused_an_agent_the_first_drives(
    sqlite_store: EventStore, make_agent: MakeAgent
) -> None:
    agent = make_agent("ag", turns=(1, 1))
    async with GymClient(agent.url, "ag") as ca, GymClient(agent.url, "ag") as cb:
        a = coordinator(sqlite_store, {"ag": ca}, mode="sibling", trainer_id="A")
        async with a:
            g = gid()
            await a.submit(g, PROMPT, "ag", 1, PAYLOAD)
            await a.wait_idle(60)
            before = sqlite_store.head()
            b = coordinator(sqlite_store, {"ag": cb}, mode="sibling", trainer_id="B")
            with pytest.raises(AgentShared) as refused:
                await b.start()
            message = str(refused.value)
            assert "\n" not in message and agent.url in message
            assert "driven by trainer 'A', not by trainer 'B'" in message
            assert sqlite_store.head() == before  # B wrote nothing, not even its epoch
            await b.close()
        assert "GroupSealed" in [e.type for e in sqlite_store.read_stream(group_stream(g))]
        # A closed holding nothing at the agent (its result ACKed): B may drive it now.
        b = coordinator(sqlite_store, {"ag": cb}, mode="sibling", trainer_id="B")
        async with b:
            g2 = gid()
            await b.submit(g2, PROMPT, "ag", 1, PAYLOAD)
            await b.wait_idle(60)
        assert "GroupSealed" in [e.type for e in sqlite_store.read_stream(group_stream(g2))]


def _events(store: EventStore, group_id: str) -> list[str]:
    return [e.type for e in store.read_stream(group_stream(group_id))]


async def test_an_agent_away_at_start_refuses_the_second_trainer_at_its_first_call(
    sqlite_store: EventStore, make_agent: MakeAgent
) -> None:
    """B starts while its agent is away (nothing listens on the port it was given), so its start
    cannot be refused; the agent comes back bound to A, and B's first call (`/run`) is answered
    `409 trainer_conflict`.  That is the refusal of the start, late: B stops driving the agent at
    once (well inside the 30 s its tries would spend retrying, and the 300 s prepare deadline), owes
    it nothing, records no failure, and says so once in its errors; its group waits open, and a
    recovery once A let the agent go runs it.  A's work goes on untouched."""
    agent = make_agent("ag", turns=(1, 1))
    proxy = Cuttable(agent.port)
    await proxy.start()
    proxy.cut()  # away: B's start finds nothing listening
    async with GymClient(agent.url, "ag") as ca, GymClient(proxy.url, "ag", control_timeout_s=2.0) as cb:
        a = coordinator(sqlite_store, {"ag": ca}, mode="sibling", trainer_id="A")
        b = coordinator(sqlite_store, {"ag": cb}, mode="sibling", trainer_id="B", prepare_timeout_s=300.0)
        try:
            await a.start()
            await b.start()  # not refused: the agent did not answer
            await proxy.start()  # back, on the same port, bound to A
            g = gid()
            await b.submit(g, PROMPT, "ag", 2, PAYLOAD)
            with pytest.raises(AgentShared) as refused:
                await b.wait_idle(20)
            line = str(refused.value)
            assert "\n" not in line and proxy.url in line, line
            assert "driven by trainer 'A', not by trainer 'B'" in line, line
            assert b.errors == [refused.value]  # once, though both siblings were refused
            # Nothing recorded against the agent: no failure, no retire owed, the group open.
            assert _events(sqlite_store, g) == [
                "GroupReserved", "AttemptMinted", "AttemptMinted", "RunDispatched", "RunDispatched",
            ]  # fmt: skip
            assert not b.ledger.retires and not b.ledger.unpaid_debts()
            async with asyncio.timeout(20):
                with pytest.raises(AgentShared):  # not a wait for a group nothing drives
                    [s async for s in b.sealed_groups()]
                outcome = await b.checkpoint("ck-b")  # without the agent: it holds nothing of B
            assert outcome.committed, outcome
            before = sqlite_store.head()
            with pytest.raises(AgentShared):  # as at start: refused with nothing written
                await b.submit(gid(), PROMPT, "ag", 1, PAYLOAD)
            assert sqlite_store.head() == before and b.errors == [refused.value]
            # A drives its agent as before.
            mine = gid()
            await a.submit(mine, PROMPT, "ag", 1, PAYLOAD)
            await a.wait_idle(60)
            assert "GroupSealed" in _events(sqlite_store, mine)
        finally:
            await b.close()
            await a.close()
            proxy.cut()
        assert not any(key.startswith(f"{g}_g") for key in await ca.debug_runs())  # B's tries never ran
    # A let the agent go: B's recovery drives the group that waited (its tries never started there).
    async with GymClient(agent.url, "ag") as client:
        b = await RolloutCoordinator.recover(
            sqlite_store, {"ag": client}, mode="sibling", trainer_id="B", rollout_timeout_s=10.0
        )
        try:
            [sealed] = [s async for s in b.sealed_groups()]
            await b.wait_idle(60)
        finally:
            await b.close()
    assert sealed.group_id == g and "GroupSealed" in _events(sqlite_store, g)
    report = audit_log(sqlite_store)
    assert report.ok, report.as_json()["violations"]


async def test_a_prepare_answered_trainer_conflict_fails_at_once(
    sqlite_store: EventStore, make_agent: MakeAgent
) -> None:
    """B's first call to its agent is a checkpoint's prepare, answered `trainer_conflict`: the
    checkpoint aborts at once with the refusal as its reason (not after the 300 s prepare deadline),
    the abort asks nothing more of the agent, and B's next checkpoint leaves the agent out."""
    agent = make_agent("ag", turns=(1, 1))
    proxy = Cuttable(agent.port)
    await proxy.start()
    proxy.cut()
    async with GymClient(agent.url, "ag") as ca, GymClient(proxy.url, "ag", control_timeout_s=2.0) as cb:
        a = coordinator(sqlite_store, {"ag": ca}, mode="sibling", trainer_id="A")
        b = coordinator(sqlite_store, {"ag": cb}, mode="sibling", trainer_id="B", prepare_timeout_s=300.0)
        try:
            await a.start()
            await b.start()
            await proxy.start()
            async with asyncio.timeout(20):
                first = await b.checkpoint("ck-1")
                second = await b.checkpoint("ck-2")
            assert not first.committed and "driven by trainer 'A', not by trainer 'B'" in first.reason
            assert [str(e) for e in b.errors] == [first.reason.removeprefix("ag: ")], (first.reason, b.errors)
            assert second.committed
            prepared = [
                e.data["participants"]
                for e in sqlite_store.read_all(0)
                if e.type == "CheckpointPrepareStarted"
            ]
            assert prepared == [["ag"], []]
            assert (await ca.status()).phase == "idle"  # A's agent never prepared for B
        finally:
            await b.close()
            await a.close()
            proxy.cut()
