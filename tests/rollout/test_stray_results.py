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
from projections.base import fold
from projections.ledger import LedgerProjection
from protocol.wire import AttemptFault, RunRequest
from tests.rollout.conftest import PAYLOAD, PROMPT, MakeAgent, coordinator, gid
from tests.rollout.test_retire_owed import Cuttable, events
from trainer.gym import Completed, GymClient


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


async def released_after_a_late_run(
    store: EventStore,
    make_agent: MakeAgent,
    tmp_path: Path,
    late_try: int,
    fault: AttemptFault | None = None,
) -> tuple[str, list[Any]]:
    """One sibling submitted to agent "a" (behind a proxy), sealed; the agent restarted on an empty
    state directory behind the same port; the `/run` of try `late_try` the trainer sent delivered to
    it again, late.  Returns the rollout id and its group's log once the agent holds nothing, the log
    owes nothing and the coordinator closed (the agent then unbound: another trainer binds it)."""
    first = make_agent("a")
    proxy = Cuttable(first.port)
    await proxy.start()
    client = Recording(proxy.url, "a", control_timeout_s=2.0)
    g = gid()
    rid = f"{g}_g0"
    if fault is not None:
        async with GymClient(first.url, "a") as direct:
            await direct.set_faults(fault.model_copy(update={"rollout_id": rid}))
    coord = coordinator(store, {"a": client}, mode="sibling", rollout_timeout_s=1.0, reconcile_every_s=0.2)
    try:
        async with asyncio.timeout(60):
            await coord.start()
            await coord.submit(g, PROMPT, "a", 1, PAYLOAD)
            [_] = [s async for s in coord.sealed_groups()]
            await coord.wait_idle(30)
        [late] = [r for r in client.sent if r.attempt_index == late_try]

        # The agent restarts with its state lost, behind the port the trainer knows.
        first.stop()
        second = make_agent("a", state_dir=tmp_path / "a-restarted")
        proxy.target_port = second.port
        async with GymClient(second.url, "a") as restarted:
            restarted.drive_as(coord.settings.trainer_id)
            # The try's `/run`, delivered again now: the restarted agent knows nothing of it.
            assert await restarted.run(late, timeout_s=30) is not None
            # The gate: released (the result held, then the ACK the owed retire led to accepted).
            async with asyncio.timeout(30):
                while await held(restarted) or coord.ledger.retires or coord.ledger.unpaid_debts():
                    await asyncio.sleep(0.05)
            await coord.wait_idle(30)
            assert coord._retires.released == 1
            await coord.close()
            bound = await restarted.bind_driver("another-trainer")
            assert bound is not None and bound.trainer_id == "another-trainer"
        return rid, events(store, g)
    finally:
        await coord.close()
        await client.aclose()
        proxy.cut()


def released(log: list[Any], rid: str, late_try: int, sealed_try: int) -> None:
    owed = [(e.rollout_id, e.attempt_index, e.agent_name) for e in log if isinstance(e, RetireOwed)]
    assert owed == [(rid, late_try, "a")]
    assert [e.outcome for e in log if isinstance(e, RetirePaid)] == ["released"]
    acks = [(e.rollout_id, e.attempt_index) for e in log if isinstance(e, AckAccepted)]
    assert acks == [(rid, sealed_try), (rid, late_try)]
    # Released, never sealed again: the sibling keeps the try it was sealed with.
    assert [e.attempt_index for e in log if isinstance(e, SiblingSealed)] == [sealed_try]


async def test_a_retired_try_run_again_after_its_agent_lost_its_state_is_released(
    store: EventStore, make_agent: MakeAgent, tmp_path: Path
) -> None:
    # Try 0 hangs, times out and is cancelled at the agent; try 1 is sealed.
    hang = AttemptFault(rollout_id="x", attempt_index=0, hang=True)
    rid, log = await released_after_a_late_run(store, make_agent, tmp_path, 0, hang)
    ledger = fold(LedgerProjection(), store.read_all())
    try0 = ledger.attempt(rid, 0)
    assert try0 is not None and (try0.status, try0.retire_outcome) == ("retired", "cancelled")
    released(log, rid, 0, 1)
    report = audit_log(store)
    assert report.ok, report.as_json()


async def test_a_sealed_try_run_again_after_its_agent_lost_its_state_is_released(
    store: EventStore, make_agent: MakeAgent, tmp_path: Path
) -> None:
    # Sealed and ACKed, its record of the ACK lost with the agent's state, then delivered again.
    rid, log = await released_after_a_late_run(store, make_agent, tmp_path, 0)
    released(log, rid, 0, 0)
    report = audit_log(store)
    assert report.ok, report.as_json()
