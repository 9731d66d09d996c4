"""The run's target level, lowered per agent to what its `/capabilities` declare, both recorded."""

from __future__ import annotations

from eventstore import EventStore
from eventstore.events import GroupReserved
from tests.rollout.conftest import PAYLOAD, PROMPT, MakeAgent, coordinator, gid
from trainer.gym import GymClient


def _reserved(store: EventStore, group_id: str) -> GroupReserved:
    first = next(iter(store.read_stream(f"group-{group_id}"))).decode()
    assert isinstance(first, GroupReserved)
    return first


async def test_level_turn_is_lowered_for_an_agent_that_does_not_declare_continuations(
    store: EventStore, make_agent: MakeAgent
) -> None:
    agent = make_agent("a")
    async with GymClient(agent.url, "a") as client:
        coord = coordinator(store, {"a": client}, mode="sibling", target_level="turn")
        async with coord:
            g = gid()
            await coord.submit(g, PROMPT, "a", 2, PAYLOAD)
            _ = [s async for s in coord.sealed_groups()]
            # A level asked for per group wins over the run's; one that needs no feature is kept.
            g2 = gid()
            await coord.submit(g2, PROMPT, "a", 1, PAYLOAD, target_level="prompt_group")
            await coord.wait_idle(30)
    seen = client.capabilities_seen
    assert seen is not None and "turn_continuation" not in seen.features
    reserved = _reserved(store, g)
    assert (reserved.requested_level, reserved.target_level) == ("turn", "sibling")
    second = _reserved(store, g2)
    assert (second.requested_level, second.target_level) == ("prompt_group", "prompt_group")
