"""One trainer per agent, at the coordinator: a second trainer given an agent another one drives is
refused at `start()` with one line, having written nothing; once the first closes holding nothing at
the agent, the agent is free for the next trainer."""

from __future__ import annotations

import pytest

from eventstore import EventStore
from protocol.streams import group_stream
from tests.rollout.conftest import PAYLOAD, PROMPT, MakeAgent, coordinator, gid
from trainer import AgentShared
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
