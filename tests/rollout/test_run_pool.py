"""A try's lease starts when its /run holds a connection: the trainer's own queue spends none of it."""

from __future__ import annotations

import asyncio

from eventstore import EventStore
from projections.audit import audit_log
from protocol.ids import rollout_id_of
from protocol.streams import group_stream
from protocol.wire import AttemptFault
from tests.rollout.conftest import PAYLOAD, PROMPT, MakeAgent, coordinator, gid, set_setting
from trainer.gym import GymClient


async def test_a_try_queued_behind_the_run_pool_spends_none_of_its_lease(
    sqlite_store: EventStore, make_agent: MakeAgent
) -> None:
    """A pool of one connection.  The first group's try hangs at the agent for its whole 8 s lease and
    holds the connection; the second group's try (1 s at the agent) waits for it meanwhile, visibly.
    Its lease starts only once it has the connection, so it finishes inside it: no try of the second
    group fails, and its `RunDispatched` comes after the first try's deadline.

    The leases are set by gates, not raced: the lease setting is 0.5 s while the second try is
    queued (a lease taken and started in the queue runs out there) and 600 s once the test saw it
    queued (a lease taken with the connection lets the 1 s try finish however loaded the machine)."""
    agent = make_agent("a", turns=(1, 1))
    async with GymClient(agent.url, "a", max_run_connections=1) as client:
        first, second = gid(), gid()
        await client.set_faults(AttemptFault(rollout_id=rollout_id_of(first, 0), attempt_index=0, hang=True))
        await client.set_faults(
            AttemptFault(rollout_id=rollout_id_of(second, 0), attempt_index=0, delay_s=1.0)
        )
        coord = coordinator(sqlite_store, {"a": client}, mode="sibling", rollout_timeout_s=8.0)

        def lease_setting(seconds: float) -> None:
            set_setting(coord, rollout_timeout_s=seconds)

        async with coord:
            await coord.submit(first, PROMPT, "a", 1, PAYLOAD)

            async def hung_at_the_agent() -> None:
                while (await client.status()).running != 1:
                    await asyncio.sleep(0.02)

            await asyncio.wait_for(hung_at_the_agent(), 30)
            lease_setting(0.5)
            await coord.submit(second, PROMPT, "a", 1, PAYLOAD)

            async def queued() -> None:
                while coord.queued_attempts() != 1:
                    await asyncio.sleep(0.02)

            await asyncio.wait_for(queued(), 30)
            lease_setting(600.0)
            assert (await coord.metrics())["coordinator/queued_attempts"] == 1.0
            assert rollout_id_of(second, 0) not in await client.debug_runs()
            await coord.wait_idle(60)
            assert coord.queued_attempts() == 0
        events = list(sqlite_store.read_all())
        of_second = [e.type for e in events if e.stream_id == group_stream(second)]
        assert "RunFailed" not in of_second and "GroupSealed" in of_second
        first_deadline = next(
            e.position for e in events if e.stream_id == group_stream(first) and e.type == "RunFailed"
        )
        second_dispatch = next(
            e.position for e in events if e.stream_id == group_stream(second) and e.type == "RunDispatched"
        )
        assert second_dispatch > first_deadline
    report = audit_log(sqlite_store)
    assert report.ok, report.as_json()["violations"]
