"""The coordinator against real agents over HTTP, on both log backends: the seeds' cases (a)-(f)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest

import trainer.sealed as sealed_module
from eventstore import EventStore
from projections.audit import audit_log
from projections.ledger import GroupState
from protocol.wire import AttemptFault
from tests.rollout.conftest import PAYLOAD, PROMPT, MakeAgent, coordinator, gid, set_setting
from trainer.gym import GymClient, NotReadyError, StaleCheckpointError
from trainer.sealed import SealedGroup, sealed_of


def types(store: EventStore, stream: str) -> list[str]:
    return [e.type for e in store.read_stream(stream)]


async def _all_done(coord, timeout_s: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    await coord.wait_idle(timeout_s)


async def test_sibling_mode_seals_and_acks(store: EventStore, make_agent: MakeAgent) -> None:
    agent = make_agent("a")
    async with GymClient(agent.url, "a") as client:
        coord = coordinator(store, {"a": client}, mode="sibling")
        async with coord:
            g = gid()
            await coord.submit(g, PROMPT, "a", 3, PAYLOAD)
            sealed = [s async for s in coord.sealed_groups()]
            assert [s.group_id for s in sealed] == [g]
            await coord.claim_for_training(g, 0)
            await _all_done(coord)
            assert (await client.status()).completed_unacknowledged == 0
        seq = types(store, f"group-{g}")
        assert seq.count("SiblingSealed") == 3 and seq.count("AckAccepted") == 3
        assert seq.count("GroupClaimedForTraining") == 1


async def test_a_checkpoint_during_a_half_done_prompt_group_commits_at_once(
    store: EventStore, make_agent: MakeAgent
) -> None:
    """(a) g0 finished (and is ACKed at once), g1 is slow: the checkpoint does not wait its deadline."""
    agent = make_agent("a", turns=(3, 3))
    async with GymClient(agent.url, "a") as client:
        g = gid()
        await client.set_faults(AttemptFault(rollout_id=f"{g}_g1", attempt_index=0, delay_s=0.3))
        coord = coordinator(store, {"a": client}, mode="prompt_group", prepare_timeout_s=30)
        async with coord:
            await coord.submit(g, PROMPT, "a", 2, PAYLOAD)
            async with asyncio.timeout(30):  # g0 is ACKed: the gate, whatever the machine's load
                while not any(e.type == "AckAccepted" for e in store.read_stream(f"group-{g}")):
                    await asyncio.sleep(0.01)
            outcome = await coord.checkpoint(gid("ck"))
            assert outcome.committed, outcome.reason
            # g1 parks at its next model call (0.3 s each): far below the 30 s the deadline would take.
            assert max(outcome.prepare_wait_s.values()) < 10.0
            await _all_done(coord)
        assert "GroupSealed" in types(store, f"group-{g}")


async def test_a_group_failing_after_one_sibling_finished_blocks_no_checkpoint(
    store: EventStore, make_agent: MakeAgent
) -> None:
    """(b) g1 fails (masked, and masked replies are retried) after g0 finished: the group is abandoned,
    nothing strands."""
    agent = make_agent("a")
    async with GymClient(agent.url, "a") as client:
        g = gid()
        await client.set_faults(AttemptFault(rollout_id=f"{g}_g1", attempt_index=0, fail=True, delay_s=0.1))
        coord = coordinator(store, {"a": client}, mode="prompt_group", mask_sample_retries=True)
        async with coord:
            await coord.submit(g, PROMPT, "a", 2, PAYLOAD)
            await _all_done(coord)
            for _ in range(2):
                outcome = await coord.checkpoint(gid("ck"))
                assert outcome.committed, outcome.reason
            assert (await client.status()).completed_unacknowledged == 0
        seq = types(store, f"group-{g}")
        assert "GroupAbandoned" in seq and seq.count("ReplacementMinted") == 2 and "GroupSealed" in seq


async def test_a_masked_reply_is_a_result_sealed_with_its_mask(
    store: EventStore, make_agent: MakeAgent
) -> None:
    """The environment failed on g1 (`mask_sample`, a `failure_kind`): by default the reply is kept as
    the try's result, as NeMo RL uses it (trained with no loss, counted for advantages), not retried."""
    agent = make_agent("a")
    async with GymClient(agent.url, "a") as client:
        g = gid()
        await client.set_faults(AttemptFault(rollout_id=f"{g}_g1", attempt_index=0, fail=True))
        coord = coordinator(store, {"a": client}, mode="prompt_group")
        async with coord:
            await coord.submit(g, PROMPT, "a", 2, PAYLOAD)
            await _all_done(coord)
        events = list(store.read_stream(f"group-{g}"))
        assert not [e for e in events if e.type in ("ReplacementMinted", "GroupAbandoned", "RunFailed")]
        replied = {e.data["rollout_id"]: e.data for e in events if e.type == "RunReplied"}
        assert replied[f"{g}_g1"]["mask_sample"] is True and replied[f"{g}_g0"]["mask_sample"] is False
        assert replied[f"{g}_g1"]["failure_kind"] == "reference_agent:environment_failed"
        sealed = {e.data["rollout_id"]: e.data["receipt"] for e in events if e.type == "SiblingSealed"}
        assert sealed[f"{g}_g1"]["mask_sample"] is True and sealed[f"{g}_g0"]["mask_sample"] is False
        assert "GroupSealed" in [e.type for e in events]


async def test_a_lost_reply_is_adopted_not_rerun(store: EventStore, make_agent: MakeAgent) -> None:
    """(c) the reply is dropped: retire answers completed_unacknowledged, the try is adopted; no try 1."""
    agent = make_agent("a")
    async with GymClient(agent.url, "a") as client:
        g = gid()
        await client.set_faults(AttemptFault(rollout_id=f"{g}_g0", attempt_index=0, drop_reply=True))
        coord = coordinator(store, {"a": client}, mode="sibling")
        async with coord:
            await coord.submit(g, PROMPT, "a", 1, PAYLOAD)
            await _all_done(coord)
            assert (await client.debug_runs())[f"{g}_g0"] == 1
        seq = types(store, f"group-{g}")
        assert "AttemptAdopted" in seq and "ReplacementMinted" not in seq and "GroupSealed" in seq


async def test_a_try_running_past_its_deadline_is_retired_and_replaced(
    store: EventStore, make_agent: MakeAgent
) -> None:
    """(d) a hung try: retired at its deadline (cancelled), try 1 minted and sealed.

    Only try 0 runs under the short deadline: its retire (which comes before try 1 is minted) gives
    the coordinator a long one first, so try 1 is never retired by a deadline however slow the
    machine is."""
    agent = make_agent("a")
    async with GymClient(agent.url, "a") as client:
        g = gid()
        await client.set_faults(AttemptFault(rollout_id=f"{g}_g0", attempt_index=0, hang=True))
        coord = coordinator(store, {"a": client}, mode="sibling", rollout_timeout_s=1.0)
        retire = client.retire

        async def retire_then_lengthen(
            rollout_id: str, attempt_index: int, checkpoint_id: str | None = None
        ) -> Any:
            set_setting(coord, rollout_timeout_s=600.0)
            return await retire(rollout_id, attempt_index, checkpoint_id)

        client.retire = retire_then_lengthen  # type: ignore[method-assign]
        async with coord:
            await coord.submit(g, PROMPT, "a", 1, PAYLOAD)
            await _all_done(coord)
        events = list(store.read_stream(f"group-{g}"))
        retired = [e.data for e in events if e.type == "AttemptRetired"]
        work = retired[0].pop("work")
        assert retired[0] == {
            "rollout_id": f"{g}_g0",
            "attempt_index": 0,
            "outcome": "cancelled",
            "checkpoint_id": None,
            "execution_generation": agent.generation,  # the agent process that answered the retire
            "execution_incarnation": agent.registry.incarnation,
            "cause": None,  # its own deadline, not a checkpoint's
            "continuation": None,  # hung inside its first turn: no boundary committed
        }
        # What the agent had spent on it: inside its (hung) first model call, nothing generated.
        assert work["model_s"] > 0 and work["generated_tokens"] == 0
        sealed = [e.data["attempt_index"] for e in events if e.type == "SiblingSealed"]
        assert sealed == [1]
        dispatched = [e.data["deadline_s"] for e in events if e.type == "RunDispatched"]
        assert dispatched == [1.0, 600.0]


async def test_a_retire_that_overtakes_its_checkpoints_prepare_still_retires(
    store: EventStore, make_agent: MakeAgent
) -> None:
    """The retire names the checkpoint before the agent has its prepare: called unknown, the retire
    goes out without it and meets the prepare.  It must name the checkpoint again, not loop until the
    checkpoint's deadline (seen in the soak as aborted checkpoints and 30 s stalls)."""
    agent = make_agent("a")
    async with GymClient(agent.url, "a") as client:
        g = gid()
        await client.set_faults(AttemptFault(rollout_id=f"{g}_g0", attempt_index=0, hang=True))
        coord = coordinator(store, {"a": client}, mode="sibling", rollout_timeout_s=60)
        async with coord:
            await coord.submit(g, PROMPT, "a", 1, PAYLOAD)
            while (await client.status()).running == 0:
                await asyncio.sleep(0.02)
            retire = client.retire

            async def overtaken(rollout_id: str, attempt_index: int, checkpoint_id: str | None = None) -> Any:
                try:
                    return await retire(rollout_id, attempt_index, checkpoint_id)
                except StaleCheckpointError:
                    with contextlib.suppress(NotReadyError):  # the prepare lands right after
                        await client.prepare("ck-race", timeout_s=0.05)
                    raise

            client.retire = overtaken  # type: ignore[method-assign]
            coord._gate.hold("ck-race")
            outcome = await asyncio.wait_for(coord._attempts.resolve(g, f"{g}_g0", 0), 10)
            assert (outcome.kind, outcome.retire_outcome) == ("retired", "cancelled")
            status = await client.status()
            assert (status.phase, status.running, status.park_requested) == ("preparing", 0, 0)
            coord._gate.release()
            await client.abort("ck-race")


async def _checkpoint_meeting_a_finished_try(
    store: EventStore, make_agent: MakeAgent, carry_completed: bool
) -> tuple[Any, str]:
    """A checkpoint that meets a finished try the trainer never heard of (its reply was dropped and
    its lease is long).  The try's own task would adopt it too; it is held back so the checkpoint is
    the one to find it.  The gate: the lock is let go only once the agent's prepare answered naming
    the try, 409 not_ready or prepared carrying it (a fixed sleep let the try's task adopt it first on
    a loaded machine, and prepare found nothing)."""
    agent = make_agent("a")
    async with GymClient(agent.url, "a") as client:
        g = gid()
        await client.set_faults(AttemptFault(rollout_id=f"{g}_g0", attempt_index=0, drop_reply=True))
        coord = coordinator(
            store, {"a": client}, mode="sibling", rollout_timeout_s=60, carry_completed=carry_completed
        )
        named = asyncio.Event()
        prepare = client.prepare

        async def prepare_seen(checkpoint_id: str, timeout_s: float = 300.0, carry: bool = False) -> Any:
            try:
                answer = await prepare(checkpoint_id, timeout_s, carry)
            except NotReadyError as exc:
                if any(a.rollout_id == f"{g}_g0" for a in exc.attempts):
                    named.set()
                raise
            if any(a.rollout_id == f"{g}_g0" for a in answer.carried):
                named.set()
            return answer

        client.prepare = prepare_seen  # type: ignore[method-assign]
        coord._attempts.live(f"{g}_g0", 0)
        async with coord:
            live = coord._attempts.live(f"{g}_g0", 0)
            async with live.lock:
                await coord.submit(g, PROMPT, "a", 1, PAYLOAD)
                async with asyncio.timeout(30):
                    while not (await client.status()).completed_unacknowledged:
                        await asyncio.sleep(0.01)
                task = asyncio.create_task(coord.checkpoint(gid("ck")))
                await asyncio.wait_for(named.wait(), 60)
                if carry_completed:
                    # Carried: the checkpoint is decided while the try is still unACKed (its adoption
                    # waits on this lock), and only then is it taken in.
                    outcome = await asyncio.wait_for(task, 60)
            if not carry_completed:
                outcome = await task
            await _all_done(coord)
            assert not coord.ledger.debts.get("a")
        return outcome, g


async def test_prepare_adopts_a_finished_try_the_trainer_never_heard_of(
    store: EventStore, make_agent: MakeAgent
) -> None:
    """(e) without carrying: prepare's 409 names the finished try, it is adopted, prepare succeeds."""
    outcome, g = await _checkpoint_meeting_a_finished_try(store, make_agent, carry_completed=False)
    assert outcome.committed, outcome.reason
    assert (outcome.adopted, outcome.carried) == (1, 0)
    seq = types(store, f"group-{g}")
    assert "AttemptAdopted" in seq and "ReplacementMinted" not in seq


async def test_a_checkpoint_carries_a_finished_try_and_it_is_taken_in_after_the_decision(
    store: EventStore, make_agent: MakeAgent
) -> None:
    """(e) carrying (the default): the agent answers prepared naming the finished, unACKed try, the
    checkpoint commits without taking it in (nothing waits for its intake), the commit names it, and
    the try is adopted and ACKed after the decision; the auditor finds the cut clean."""
    outcome, g = await _checkpoint_meeting_a_finished_try(store, make_agent, carry_completed=True)
    assert outcome.committed, outcome.reason
    assert (outcome.adopted, outcome.carried) == (0, 1)
    committed = next(
        e
        for e in store.read_all()
        if e.type == "CheckpointCommitted" and e.data["checkpoint_id"] == outcome.checkpoint_id
    )
    assert committed.data["carried"] == {"a": [{"rollout_id": f"{g}_g0", "attempt_index": 0}]}
    seq = types(store, f"group-{g}")
    # Taken in after the decision: the adoption follows the commit in the log.
    assert "AttemptAdopted" in seq and "ReplacementMinted" not in seq
    positions = {
        e.type: e.position for e in store.read_all() if e.type in ("CheckpointCommitted", "AttemptAdopted")
    }
    assert positions["AttemptAdopted"] > positions["CheckpointCommitted"]
    report = audit_log(store)
    assert not report.violations, report.violations


async def test_groups_handed_out_and_not_yet_claimed_are_built_once(
    store: EventStore, make_agent: MakeAgent, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A consumer collecting a batch holds what `sealed_groups` handed out unclaimed while the rest
    seal: each group's SealedGroup is built once, when handed out, not again at every batch after."""
    built: list[str] = []
    build = sealed_of

    def counted(group: GroupState) -> SealedGroup:
        built.append(group.group_id)
        return build(group)

    monkeypatch.setattr(sealed_module, "sealed_of", counted)
    agent = make_agent("a")
    async with GymClient(agent.url, "a") as client:
        coord = coordinator(store, {"a": client}, mode="sibling")
        async with coord:
            groups = [gid() for _ in range(6)]
            for g in groups:
                await coord.submit(g, PROMPT, "a", 2, PAYLOAD)
            batch = [s.group_id async for s in coord.sealed_groups()]  # none claimed
            assert sorted(batch) == sorted(groups)
            assert coord.journal_figures()["batches"] > len(groups)  # the loop woke at many batches meanwhile
            assert sorted(built) == sorted(groups), built
            assert {s.group_id for s in coord.sealed_unclaimed()} == set(groups)
