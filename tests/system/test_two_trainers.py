"""Two trainers on one log (fast): each drives, checkpoints, recovers and trains only its own groups."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest

from eventstore import open_store, upgrade_database
from eventstore.events import PromptRef
from gym_agent.config import AgentConfig
from gym_agent.server import ThreadAgent, serve_in_thread
from projections.audit import audit_log
from protocol.ids import rollout_id_of
from protocol.wire import AttemptFault
from trainer import RolloutCoordinator
from trainer.errors import GroupConflict, UnknownGroup
from trainer.gym import GymClient

PROMPT = PromptRef(sample_id="s1", task_name="math")
PAYLOAD = {"responses_create_params": {"input": [{"role": "user", "content": "2+2?"}]}}


@pytest.fixture
def agents(tmp_path: Path) -> Iterator[dict[str, ThreadAgent]]:
    with ExitStack() as stack:
        yield {
            name: stack.enter_context(
                serve_in_thread(
                    AgentConfig(
                        name=name, state_dir=tmp_path / name, log_level="warning", turns=(2, 3), delay_s=0.05
                    )
                )
            )
            for name in ("agent-a", "agent-b")
        }


async def settle(coord: RolloutCoordinator, agent: str, timeout_s: float = 30.0) -> None:
    """Until this trainer's own groups are done and its own agent is paid (docs/operations.md, Several
    trainers on one log)."""
    async with asyncio.timeout(timeout_s):
        while coord.open_groups():
            if coord.errors:
                raise coord.errors[0]
            await asyncio.sleep(0.05)
        assert await coord._acks.flush(agent, timeout_s)


def group_events(url: str, group_id: str) -> list[str]:
    store = open_store(url)
    try:
        return [e.type for e in store.read_stream(f"group-{group_id}")]
    finally:
        store.close()


async def test_two_trainers_share_a_log_and_each_recovers_only_its_own_groups(
    sqlite_url: str, agents: dict[str, ThreadAgent]
) -> None:
    upgrade_database(sqlite_url)
    stores = [open_store(sqlite_url) for _ in range(4)]
    kw = {"mode": "sibling", "rollout_timeout_s": 10.0, "prepare_timeout_s": 20.0}
    try:
        async with (
            GymClient(agents["agent-a"].url, "agent-a") as ca,
            GymClient(agents["agent-b"].url, "agent-b") as cb,
        ):
            a = RolloutCoordinator(stores[0], {"agent-a": ca}, trainer_id="A", **kw)  # type: ignore[arg-type]
            b = RolloutCoordinator(stores[1], {"agent-b": cb}, trainer_id="B", **kw)  # type: ignore[arg-type]
            await a.start()
            await b.start()
            await a.submit("A-1", PROMPT, "agent-a", 2, PAYLOAD)
            await b.submit("B-1", PROMPT, "agent-b", 2, PAYLOAD)
            await asyncio.gather(settle(a, "agent-a"), settle(b, "agent-b"))
            # Each checkpoint is a cut across one trainer and its own agent.
            assert (await a.checkpoint("A-ck0")).committed
            assert (await b.checkpoint("B-ck0")).committed
            # A second group each, left in flight when both trainers "crash": the first try of sibling 0
            # hangs at its agent, so neither group can seal before the crash however the threads are
            # scheduled (recovery retires that try and its replacement runs clean).
            for client, group in ((ca, "A-2"), (cb, "B-2")):
                await client.set_faults(
                    AttemptFault(rollout_id=rollout_id_of(group, 0), attempt_index=0, hang=True)
                )
            await a.submit("A-2", PROMPT, "agent-a", 3, PAYLOAD)
            await b.submit("B-2", PROMPT, "agent-b", 3, PAYLOAD)
            await a.close()
            await b.close()

            # A recovers: it takes over its own open group only, and never drives B's.
            a2 = await RolloutCoordinator.recover(stores[2], {"agent-a": ca}, trainer_id="A", **kw)  # type: ignore[arg-type]
            assert a2.open_groups() == ["A-2"]
            assert "GroupTakenOver" not in group_events(sqlite_url, "B-2")
            await settle(a2, "agent-a")
            assert "GroupSealed" in group_events(sqlite_url, "A-2")
            assert "GroupSealed" not in group_events(sqlite_url, "B-2")

            # A trainer cannot claim another trainer's group.
            await a2.catch_up()
            with pytest.raises(UnknownGroup, match="belongs to trainer 'B'"):
                await a2.claim_for_training("B-1", 0)
            await a2.claim_for_training("A-1", 0)

            b2 = await RolloutCoordinator.recover(stores[3], {"agent-b": cb}, trainer_id="B", **kw)  # type: ignore[arg-type]
            await settle(b2, "agent-b")
            assert "GroupSealed" in group_events(sqlite_url, "B-2")
            assert "GroupTakenOver" in group_events(sqlite_url, "B-2")
            assert "GroupTakenOver" not in group_events(sqlite_url, "A-1")
            await b2.catch_up()
            with pytest.raises(UnknownGroup):
                await b2.claim_for_training("A-2", 1)
            await b2.claim_for_training("B-1", 0)
            await b2.claim_for_training("B-2", 1)
            await a2.close()
            await b2.close()
            for client in (ca, cb):
                status = await client.status()
                assert status.completed_unacknowledged == 0 and status.phase == "idle"
                assert all(v == 1 for v in (await client.debug_runs()).values())
        report = audit_log(stores[0])
        assert report.ok, report.as_json()["violations"]
    finally:
        for s in stores:
            s.close()


async def test_a_group_id_another_trainer_reserved_refuses_that_submit_alone(
    sqlite_url: str, agents: dict[str, ThreadAgent]
) -> None:
    """B submits `p0` after A reserved it but before B's fold saw it: the reservation meets a stream
    B never wrote.  That one submit is refused (`GroupConflict`, naming A); B is not fenced off, its
    next submit runs, and A's group is untouched."""
    upgrade_database(sqlite_url)
    stores = [open_store(sqlite_url) for _ in range(2)]
    kw = {"mode": "sibling", "rollout_timeout_s": 10.0, "reconcile_every_s": 0.0}
    try:
        async with (
            GymClient(agents["agent-a"].url, "agent-a") as ca,
            GymClient(agents["agent-b"].url, "agent-b") as cb,
        ):
            a = RolloutCoordinator(stores[0], {"agent-a": ca}, trainer_id="A", **kw)  # type: ignore[arg-type]
            b = RolloutCoordinator(stores[1], {"agent-b": cb}, trainer_id="B", **kw)  # type: ignore[arg-type]
            await b.start()  # B's fold ends here: it appends nothing until its submit
            await a.start()
            await a.submit("p0", PROMPT, "agent-a", 2, PAYLOAD)
            assert not b.ledger.knows_group("p0")  # the gate: B has not folded A's reservation
            with pytest.raises(GroupConflict, match="reserved by trainer 'A'"):
                await b.submit("p0", PROMPT, "agent-b", 2, PAYLOAD)
            assert b.fenced is None
            await b.submit("p1", PROMPT, "agent-b", 2, PAYLOAD)
            # And once B has folded it, the same submit is refused the same way.
            with pytest.raises(GroupConflict, match="reserved by trainer 'A'"):
                await b.submit("p0", PROMPT, "agent-b", 2, PAYLOAD)
            await asyncio.gather(settle(a, "agent-a"), settle(b, "agent-b"))
            assert b.fenced is None and a.fenced is None
            assert "GroupSealed" in group_events(sqlite_url, "p0")
            assert "GroupSealed" in group_events(sqlite_url, "p1")
            await a.close()
            await b.close()
        report = audit_log(stores[0])
        assert report.ok, report.as_json()["violations"]
    finally:
        for s in stores:
            s.close()


@pytest.fixture
def same_named(tmp_path: Path) -> Iterator[tuple[ThreadAgent, ThreadAgent]]:
    """Two agents both called `ag`, one per trainer (each started with a fresh state directory)."""
    with ExitStack() as stack:
        a, b = (
            stack.enter_context(
                serve_in_thread(
                    AgentConfig(name="ag", state_dir=tmp_path / d, log_level="warning", turns=(2, 2))
                )
            )
            for d in ("ag-of-a", "ag-of-b")
        )
        yield a, b


@pytest.mark.parametrize("older", ["A", "B"])
async def test_two_agents_of_one_name_keep_each_trainers_debts_its_own(
    sqlite_url: str, same_named: tuple[ThreadAgent, ThreadAgent], older: str
) -> None:
    """A and B each drive their own agent called `ag`.  A's debt, unpaid, is A's alone: B's relay never
    sends it to B's `ag` (whatever the two agents' generations), nothing of B lands in A's group, B's
    checkpoint is not aborted over it, and A pays it later to its own agent."""
    upgrade_database(sqlite_url)
    stores = [open_store(sqlite_url) for _ in range(2)]
    kw = {"mode": "sibling", "rollout_timeout_s": 10.0, "reconcile_every_s": 0.0}
    agent_a, agent_b = same_named if older == "A" else same_named[::-1]
    try:
        async with GymClient(agent_a.url, "ag") as ca, GymClient(agent_b.url, "ag") as cb:
            a = RolloutCoordinator(stores[0], {"ag": ca}, trainer_id="A", **kw)  # type: ignore[arg-type]
            b = RolloutCoordinator(stores[1], {"ag": cb}, trainer_id="B", **kw)  # type: ignore[arg-type]
            await a.start()
            await b.start()
            await a._acks.stop()  # the gate: A's debts stay owed until A pays them below
            await a.submit("A-1", PROMPT, "ag", 1, PAYLOAD)
            async with asyncio.timeout(30):
                while a.open_groups():
                    await asyncio.sleep(0.02)
            assert len(a.ledger.debts["ag"]) == 1
            await b.catch_up()
            assert b.owed_ack_agents() == []
            assert await b._acks.send("ag")
            assert await b._acks.flush("ag", 0.0)  # nothing of B's is owed: done at once
            outcome = await b.checkpoint("B-ck0")
            assert outcome.committed, outcome.reason
            assert "AckRejected" not in group_events(sqlite_url, "A-1")
            await a.catch_up()
            assert len(a.ledger.debts["ag"]) == 1  # still owed to A's own agent
            assert (await ca.status()).completed_unacknowledged == 1
            assert await a._acks.flush("ag", 10.0)
            assert (await ca.status()).completed_unacknowledged == 0
            assert "AckAccepted" in group_events(sqlite_url, "A-1")
            await a.close()
            await b.close()
        report = audit_log(stores[0])
        assert report.ok, report.as_json()["violations"]
        # Every row of a group's stream names its writer, a process of the trainer that owns the group
        # (what the audit's acts-by-owner judges): A's group holds writes of A's process alone.
        rows = list(stores[0].read_all())
        trainer_of = {e.data["writer"]: e.data["trainer_id"] for e in rows if e.type == "TrainerEpochTaken"}
        in_a = [e for e in rows if e.stream_id == "group-A-1"]
        assert in_a and {trainer_of.get(e.metadata.get("writer", "")) for e in in_a} == {"A"}
    finally:
        for s in stores:
            s.close()
