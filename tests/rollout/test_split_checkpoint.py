"""Split-phase checkpoints against real agents: prepare, the trainer saves, then commit or abort."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from eventstore import EventStore, open_store, upgrade_database
from projections.audit import audit_log
from protocol.streams import checkpoint_stream
from protocol.wire import AttemptFault
from tests.rollout.conftest import PAYLOAD, PROMPT, MakeAgent, coordinator, gid
from trainer import (
    CheckpointBusy,
    CheckpointDecided,
    ClaimWhilePrepared,
    PreparedCheckpoint,
    RolloutCoordinator,
    UnknownCheckpoint,
)
from trainer.errors import FencedOff
from trainer.gym import GymClient


def types(store: EventStore, checkpoint_id: str) -> list[str]:
    return [e.type for e in store.read_stream(checkpoint_stream(checkpoint_id))]


async def _prepared(coord: RolloutCoordinator, checkpoint_id: str) -> PreparedCheckpoint:
    prepared = await coord.prepare_checkpoint(checkpoint_id)
    assert isinstance(prepared, PreparedCheckpoint), prepared
    return prepared


async def test_prepare_save_commit(store: EventStore, make_agent: MakeAgent, tmp_path: Path) -> None:
    """Prepare parks the tries in flight and closes admission at every agent; the trainer saves while
    nothing runs; commit resumes them and the work goes on."""
    a, b = make_agent("a", turns=(3, 3)), make_agent("b")
    async with GymClient(a.url, "a") as ca, GymClient(b.url, "b") as cb:
        coord = coordinator(store, {"a": ca, "b": cb}, mode="sibling")
        async with coord:
            g = gid()
            await ca.set_faults(AttemptFault(rollout_id=f"{g}_g0", attempt_index=0, delay_s=0.2))
            await coord.submit(g, PROMPT, "a", 2, PAYLOAD)
            ck = gid("ck")
            prepared = await _prepared(coord, ck)
            assert prepared.participants == ["a", "b"]
            assert set(prepared.prepare_wait_s) == {"a", "b"}
            for client in (ca, cb):
                status = await client.status()
                assert (status.phase, status.active_checkpoint_id) == ("prepared", ck)
                assert status.running == 0 and status.ready_to_commit
            assert types(store, ck) == ["CheckpointPrepareStarted"]

            # A group submitted now reaches the agent but cannot start there: admission is closed.
            late = gid()
            await coord.submit(late, PROMPT, "b", 1, PAYLOAD)
            saved = tmp_path / "trainer-state.txt"
            saved.write_text(prepared.checkpoint_id)  # the trainer's own save
            assert f"{late}_g0" not in await cb.debug_runs()
            assert (await cb.status()).phase == "prepared"

            outcome = await coord.commit_checkpoint(ck)
            assert outcome.committed and outcome.cut_position is not None, outcome.reason
            assert outcome.prepare_wait_s == prepared.prepare_wait_s
            for client in (ca, cb):
                status = await client.status()
                assert (status.phase, status.active_checkpoint_id) == ("idle", None)
            await coord.wait_idle(30)
            assert {g, late} <= {s.group_id for s in coord.sealed_unclaimed()}
        assert saved.read_text() == ck
        assert types(store, ck)[:2] == ["CheckpointPrepareStarted", "CheckpointCommitted"]
        assert "CheckpointResumed" in types(store, ck) and "CheckpointAborted" not in types(store, ck)
        report = audit_log(store)
        assert report.ok, report.as_json()["violations"]


async def test_prepare_then_abort(store: EventStore, make_agent: MakeAgent) -> None:
    """An abort after prepare reopens admission at every agent; the next checkpoint commits."""
    agent = make_agent("a")
    async with GymClient(agent.url, "a") as client:
        coord = coordinator(store, {"a": client}, mode="sibling")
        async with coord:
            g = gid()
            await coord.submit(g, PROMPT, "a", 2, PAYLOAD)
            ck = gid("ck")
            await _prepared(coord, ck)
            assert (await client.status()).phase == "prepared"
            outcome = await coord.abort_checkpoint(ck, "the trainer's save failed")
            assert not outcome.committed and outcome.cut_position is None
            assert outcome.reason == "the trainer's save failed"
            status = await client.status()
            assert (status.phase, status.active_checkpoint_id) == ("idle", None)
            await coord.wait_idle(30)
            assert g in {s.group_id for s in coord.sealed_unclaimed()}
            assert (await coord.checkpoint(gid("ck"))).committed
        seq = types(store, ck)
        assert seq[:2] == ["CheckpointPrepareStarted", "CheckpointAborted"]
        assert "CheckpointCommitted" not in seq and "CheckpointResumed" not in seq
        aborted = next(e for e in store.read_stream(checkpoint_stream(ck)) if e.type == "CheckpointAborted")
        assert aborted.data["reason"] == "the trainer's save failed"
        report = audit_log(store)
        assert report.ok, report.as_json()["violations"]


async def test_a_claim_while_prepared_is_refused_and_a_restore_offers_the_group_again(
    store: EventStore, make_agent: MakeAgent
) -> None:
    """A claim between prepare and commit would land inside the cut without being in what the trainer
    saved (trained zero times after a restore to it): it is refused, made after the commit, and a
    restore to that checkpoint rolls it back and offers the group again."""
    agent = make_agent("a")
    async with GymClient(agent.url, "a") as client:
        coord = coordinator(store, {"a": client}, mode="sibling")
        async with coord:
            g = gid()
            await coord.submit(g, PROMPT, "a", 1, PAYLOAD)
            await coord.wait_idle(30)
            ck = gid("ck")
            await _prepared(coord, ck)
            assert not await coord.wait_checkpoint_decided(0.05)
            with pytest.raises(ClaimWhilePrepared, match=f"checkpoint '{ck}' is prepared"):
                await coord.claim_for_training(g, 3)
            outcome = await coord.commit_checkpoint(ck)
            assert outcome.committed and outcome.cut_position is not None
            assert await coord.wait_checkpoint_decided(0.05)
            await coord.claim_for_training(g, 3)
        [claim] = [e for e in store.read_all(0) if e.type == "GroupClaimedForTraining"]
        assert claim.position > outcome.cut_position and claim.data["train_step"] == 3
        restored = await RolloutCoordinator.recover(store, {"a": client}, rollout_timeout_s=10.0)
        async with restored:
            assert g in {s.group_id for s in restored.sealed_unclaimed()}
            await restored.claim_for_training(g, 3)
    report = audit_log(store)
    assert report.ok, report.as_json()["violations"]


async def test_calls_that_do_not_fit_the_prepared_checkpoint_are_refused(
    store: EventStore, make_agent: MakeAgent
) -> None:
    """While one checkpoint is prepared no other starts; commit/abort must name the prepared one;
    a decided checkpoint cannot be decided again nor its id reused.  Refusals write nothing."""
    agent = make_agent("a")
    async with GymClient(agent.url, "a") as client:
        coord = coordinator(store, {"a": client})
        async with coord:
            ck, other = gid("ck"), gid("ck")
            await _prepared(coord, ck)
            with pytest.raises(CheckpointBusy, match=ck):
                await coord.prepare_checkpoint(other)
            with pytest.raises(CheckpointBusy):
                await coord.checkpoint(other)
            assert types(store, other) == []
            with pytest.raises(UnknownCheckpoint):
                await coord.commit_checkpoint(other)
            with pytest.raises(UnknownCheckpoint):
                await coord.abort_checkpoint(other, "not mine")
            # Still prepared, and still decidable after the refusals.
            assert (await client.status()).active_checkpoint_id == ck
            assert (await coord.commit_checkpoint(ck)).committed
            with pytest.raises(CheckpointDecided):
                await coord.commit_checkpoint(ck)
            with pytest.raises(CheckpointDecided):
                await coord.abort_checkpoint(ck, "too late")
            with pytest.raises(CheckpointDecided):
                await coord.prepare_checkpoint(ck)
            with pytest.raises(UnknownCheckpoint):
                await coord.commit_checkpoint(gid("never"))
        assert types(store, other) == []
        seq = types(store, ck)
        assert seq.count("CheckpointPrepareStarted") == 1 and seq.count("CheckpointCommitted") == 1
        assert "CheckpointAborted" not in seq


async def test_closing_without_deciding_aborts(store: EventStore, make_agent: MakeAgent) -> None:
    agent = make_agent("a")
    async with GymClient(agent.url, "a") as client:
        coord = coordinator(store, {"a": client})
        await coord.start()
        ck = gid("ck")
        await _prepared(coord, ck)
        await coord.close()
        status = await client.status()
        assert (status.phase, status.active_checkpoint_id) == ("idle", None)
    seq = types(store, ck)
    assert "CheckpointAborted" in seq and "CheckpointCommitted" not in seq


TRAINER = textwrap.dedent(
    """
    import asyncio, sys

    from eventstore import open_store
    from trainer import PreparedCheckpoint, RolloutCoordinator
    from trainer.gym import GymClient

    async def main(url, agent_url, checkpoint_id):
        coord = RolloutCoordinator(open_store(url), {"a": GymClient(agent_url, "a")}, reconcile_every_s=0)
        await coord.start()
        prepared = await coord.prepare_checkpoint(checkpoint_id)
        assert isinstance(prepared, PreparedCheckpoint), prepared
        print("PREPARED", flush=True)
        await asyncio.Event().wait()  # saving its state when it is killed

    asyncio.run(main(*sys.argv[1:4]))
    """
)


async def test_a_trainer_killed_while_prepared_is_presumed_aborted(
    sqlite_url: str, make_agent: MakeAgent, tmp_path: Path
) -> None:
    """SIGKILL after prepare: the agent stays prepared (nobody can decide); recovery presumes the
    abort, writes it, and reopens the agent's admission."""
    upgrade_database(sqlite_url)
    agent = make_agent("a")
    script = tmp_path / "trainer_process.py"
    script.write_text(TRAINER)
    ck = gid("ck")
    proc = subprocess.Popen(
        [sys.executable, str(script), sqlite_url, agent.url, ck],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=Path(__file__).parents[2],
    )  # fmt: skip
    assert proc.stdout is not None
    try:
        async with asyncio.timeout(60):
            line = await asyncio.to_thread(proc.stdout.readline)
        assert line.strip() == b"PREPARED", line + proc.stdout.read()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    store = open_store(sqlite_url)
    try:
        async with GymClient(agent.url, "a") as client:
            status = await client.status()
            assert (status.phase, status.active_checkpoint_id) == ("prepared", ck)
            assert types(store, ck) == ["CheckpointPrepareStarted"]
            coord = await RolloutCoordinator.recover(store, {"a": client})
            status = await client.status()
            assert (status.phase, status.active_checkpoint_id) == ("idle", None)
            await coord.close()
        seq = types(store, ck)
        assert "CheckpointAborted" in seq and "CheckpointCommitted" not in seq
    finally:
        store.close()


async def test_a_fenced_process_aborts_what_it_prepared_before_it_stops(
    sqlite_store: EventStore, make_agent: MakeAgent
) -> None:
    """Prepared, then another process of the same trainer recovers and presumes the checkpoint aborted
    without reaching the agents (it drives none of them).  The stale process's commit is fenced: it
    undoes its prepare at every agent before it stops, so none stays prepared on a checkpoint the log
    says aborted."""
    a, b = make_agent("a"), make_agent("b")
    async with GymClient(a.url, "a") as ca, GymClient(b.url, "b") as cb:
        stale = coordinator(sqlite_store, {"a": ca, "b": cb}, reconcile_every_s=0.0)
        await stale.start()
        ck = gid("ck")
        await _prepared(stale, ck)
        assert [(await c.status()).phase for c in (ca, cb)] == ["prepared", "prepared"]
        fresh = await RolloutCoordinator.recover(sqlite_store, {}, reconcile_every_s=0.0)
        assert "CheckpointAborted" in types(sqlite_store, ck)
        with pytest.raises(FencedOff):
            await stale.commit_checkpoint(ck)
        for client in (ca, cb):
            status = await client.status()
            assert (status.phase, status.active_checkpoint_id) == ("idle", None)
        await stale.close()
        await fresh.close()
    assert "CheckpointCommitted" not in types(sqlite_store, ck)
    report = audit_log(sqlite_store)
    assert report.ok, report.as_json()["violations"]


async def test_a_stale_prepare_after_a_presumed_abort_closes_no_agent(
    sqlite_store: EventStore, make_agent: MakeAgent
) -> None:
    """The stale process is held (the gate) right after its `CheckpointPrepareStarted`; a new process
    recovers: presumed abort in the log and at the agent, which has never seen the checkpoint.  Let
    go, the stale prepare is refused by the agent (it remembers that abort): its admission stays open."""
    agent = make_agent("a")
    async with GymClient(agent.url, "a") as client:
        stale = coordinator(sqlite_store, {"a": client}, reconcile_every_s=0.0)
        await stale.start()
        reached, release = asyncio.Event(), asyncio.Event()
        real_prepare = client.prepare

        async def gated_prepare(checkpoint_id: str, timeout_s: float = 30.0, carry: bool = False) -> Any:
            reached.set()
            await release.wait()
            return await real_prepare(checkpoint_id, timeout_s=timeout_s, carry=carry)

        client.prepare = gated_prepare  # type: ignore[method-assign]
        ck = gid("ck")
        preparing = asyncio.create_task(stale.prepare_checkpoint(ck))
        await asyncio.wait_for(reached.wait(), 30)
        assert types(sqlite_store, ck) == ["CheckpointPrepareStarted"]
        async with GymClient(agent.url, "a") as own:
            fresh = await RolloutCoordinator.recover(sqlite_store, {"a": own}, reconcile_every_s=0.0)
            assert types(sqlite_store, ck)[1:] == ["CheckpointAborted", "CheckpointParticipantFinished"]
            await fresh.close()
        release.set()
        with pytest.raises(FencedOff):
            await asyncio.wait_for(preparing, 30)
        status = await client.status()
        assert (status.phase, status.active_checkpoint_id) == ("idle", None)
        await stale.close()
    assert "CheckpointCommitted" not in types(sqlite_store, ck)
    report = audit_log(sqlite_store)
    assert report.ok, report.as_json()["violations"]


async def test_a_debt_recorded_after_the_prepare_aborts_the_commit(
    store: EventStore, make_agent: MakeAgent, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The prepare found no debt, but by the decision the fold holds one to a participant (an agent
    restarted after answering prepared, and the reply it had held was adopted): the cut would hold it
    unpaid, so the checkpoint is aborted, not committed, and the agents are let go."""
    agent = make_agent("a")
    async with GymClient(agent.url, "a") as client:
        coord = coordinator(store, {"a": client}, mode="sibling")
        async with coord:
            await coord.submit(gid(), PROMPT, "a", 1, PAYLOAD)
            await coord.wait_idle(30)
            ck = gid("ck")
            await _prepared(coord, ck)
            driver = type(coord._agents.driver)
            real = driver.unpaid

            def unpaid_since(self: Any, ledger: Any, names: list[str], **kw: Any) -> dict[str, int]:
                # The debt the fold now holds (its prepare carried nothing).
                return {**real(self, ledger, names, **kw), "a": 1}

            monkeypatch.setattr(driver, "unpaid", unpaid_since)
            outcome = await coord.commit_checkpoint(ck)
            monkeypatch.undo()
            assert not outcome.committed and outcome.cut_position is None
            assert outcome.reason.startswith("after the prepare: a: 1 debts still unpaid"), outcome.reason
            status = await client.status()
            assert (status.phase, status.active_checkpoint_id) == ("idle", None)
            assert (await coord.checkpoint(gid("ck"))).committed  # the next one, with no debt, commits
        seq = types(store, ck)
        assert (
            seq[:2] == ["CheckpointPrepareStarted", "CheckpointAborted"] and "CheckpointCommitted" not in seq
        )
