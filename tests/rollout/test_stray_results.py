"""A stray result: a try the log retired, run again by an agent that lost its state, is released.

The agent (real, over loopback, behind a proxy whose port the trainer keeps) hangs in try 0, which
times out and is retired at the agent (cancelled); try 1 runs and the sibling is sealed.  The agent
then restarts on an empty state directory behind the same port (its tombstone of try 0 gone), and
the `/run` of try 0 the trainer sent first reaches it late (a stale process's or a duplicate
delivery).  The agent runs it and holds a finished result of a try whose outcome the log settled as
retired: no ACK debt names it, so without the stray-results rule it stays there, bound to the
trainer and carried by every later checkpoint.  The reconciliation finds it in the agent's status,
owes a retire for it, and the relay releases it through its ACK; nothing is sealed twice.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from eventstore import EventStore
from eventstore.events import AckAccepted, RetireOwed, RetirePaid, SiblingSealed
from projections.audit import audit_log
from protocol.wire import AttemptFault, RunRequest
from tests.rollout.conftest import PAYLOAD, PROMPT, MakeAgent, coordinator, gid
from tests.rollout.test_retire_owed import Cuttable, events
from trainer.gym import GymClient
from trainer.gym.client import Completed


class Recording(GymClient):
    """Keeps every `/run` body it sends, so the test can deliver one of them again, late."""

    sent: list[RunRequest]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.sent = []

    async def run_completed(self, request: RunRequest, **kwargs: Any) -> Completed:
        self.sent.append(request)
        return await super().run_completed(request, **kwargs)


async def held(client: GymClient) -> int:
    return (await client.status()).completed_unacknowledged


async def test_a_retired_try_run_again_after_its_agent_lost_its_state_is_released(
    store: EventStore, make_agent: MakeAgent, tmp_path: Path
) -> None:
    first = make_agent("a")
    proxy = Cuttable(first.port)
    await proxy.start()
    client = Recording(proxy.url, "a", control_timeout_s=2.0)
    g = gid()
    rid = f"{g}_g0"
    async with GymClient(first.url, "a") as direct:
        await direct.set_faults(AttemptFault(rollout_id=rid, attempt_index=0, hang=True))
    coord = coordinator(store, {"a": client}, mode="sibling", rollout_timeout_s=1.0, reconcile_every_s=0.2)
    try:
        async with asyncio.timeout(60):
            await coord.start()
            await coord.submit(g, PROMPT, "a", 1, PAYLOAD)
            [sealed] = [s async for s in coord.sealed_groups()]
            await coord.wait_idle(30)
        assert [a.attempt_index for a in sealed.attempts] == [1]
        try0 = coord.ledger.attempt(rid, 0)
        assert try0 is not None and (try0.status, try0.retire_outcome) == ("retired", "cancelled")
        [late] = [r for r in client.sent if r.attempt_index == 0]

        # The agent restarts with its state lost, behind the port the trainer knows.
        first.stop()
        second = make_agent("a", state_dir=tmp_path / "a-restarted")
        proxy.target_port = second.port
        async with GymClient(second.url, "a") as restarted:
            restarted.drive_as(coord.settings.trainer_id)
            # Try 0's first `/run`, delivered now: the restarted agent knows nothing of its retire.
            reply = await restarted.run(late, timeout_s=30)
            assert reply is not None
            # The gate: released (the result held, then the ACK the owed retire led to accepted).
            async with asyncio.timeout(30):
                while await held(restarted) or coord.ledger.retires or coord.ledger.unpaid_debts():
                    await asyncio.sleep(0.05)
            await coord.wait_idle(30)

            log = events(store, g)
            owed = [(e.rollout_id, e.attempt_index, e.agent_name) for e in log if isinstance(e, RetireOwed)]
            assert owed == [(rid, 0, "a")]
            assert [e.outcome for e in log if isinstance(e, RetirePaid)] == ["released"]
            assert [(e.rollout_id, e.attempt_index) for e in log if isinstance(e, AckAccepted)] == [
                (rid, 1),
                (rid, 0),
            ]
            # Released, never sealed: the sibling keeps the try it was sealed with.
            assert [e.attempt_index for e in log if isinstance(e, SiblingSealed)] == [1]
            assert coord.retires.released == 1

            await coord.close()
            # Holding nothing of this trainer's, the agent was unbound at close: another trainer binds it.
            bound = await restarted.bind_driver("another-trainer")
            assert bound is not None and bound.trainer_id == "another-trainer"
        report = audit_log(store)
        assert report.ok, report.as_json()
    finally:
        await coord.close()
        await client.aclose()
        proxy.cut()
