"""The hand-off protocol's fault cases, each against real agents over loopback and a real log.

Each test failed before the change it guards: a stale owner fenced at the trainer level, a commit
that keeps failing never reported resumed, an abort retried until the agent confirms it.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from eventstore import EventStore, open_store, upgrade_database
from eventstore.events import (
    CheckpointAborted,
    CheckpointParticipantFinished,
    CheckpointParticipantStuck,
    CheckpointPrepareStarted,
    CheckpointResumed,
    GroupClaimedForTraining,
    RunFailed,
)
from projections.audit import audit_log
from projections.base import decode
from protocol.retry import RetryPolicy
from protocol.streams import checkpoint_stream
from protocol.wire import AttemptFault, PhaseResponse
from tests.rollout.conftest import PAYLOAD, PROMPT, MakeAgent, coordinator, gid
from trainer import FencedOff, RolloutCoordinator
from trainer.gym import AgentIdentityError, GymClient
from trainer.gym.errors import AgentServerError


def events_of(store: EventStore, stream: str) -> list[object]:
    return [decode(e) for e in store.read_stream(stream)]


async def test_case1_a_stale_coordinator_cannot_claim_or_checkpoint_after_a_takeover(
    pg_url: str, make_agent: MakeAgent
) -> None:
    """A seals a group; B recovers the same trainer.  A's claim and A's checkpoint are refused (A is
    fenced and stops), and B, the newest owner, claims the group."""
    upgrade_database(pg_url)
    store_a, store_b = open_store(pg_url), open_store(pg_url)
    agent = make_agent("a")
    try:
        async with GymClient(agent.url, "a") as ca, GymClient(agent.url, "a") as cb:
            a = coordinator(store_a, {"a": ca}, mode="sibling")
            await a.start()
            g = gid()
            await a.submit(g, PROMPT, "a", 2, PAYLOAD)
            await a.wait_idle(30)
            assert g in [s.group_id for s in a.sealed_unclaimed()]
            b = await RolloutCoordinator.recover(store_b, {"a": cb}, mode="sibling")
            with pytest.raises(FencedOff):
                await a.claim_for_training(g, 0)
            with pytest.raises(FencedOff):
                await a.checkpoint("stale-ckpt")
            assert not [e for e in store_a.read_all(0) if e.stream_id == checkpoint_stream("stale-ckpt")]
            await b.claim_for_training(g, 0)
            claims = [e for e in events_of(store_b, f"group-{g}") if isinstance(e, GroupClaimedForTraining)]
            assert len(claims) == 1
            outcome = await b.checkpoint("owner-ckpt")
            assert outcome.committed
            await a.close()
            await b.close()
    finally:
        store_a.close()
        store_b.close()


async def test_case3_a_commit_that_keeps_failing_is_stuck_never_resumed(
    sqlite_store: EventStore, make_agent: MakeAgent, tmp_path: Path
) -> None:
    """The agent cannot write its checkpoint (its directory is a file): every commit answers 5xx.
    The checkpoint is committed (decided) but never `CheckpointResumed`; the participant is recorded
    stuck, shows in the checkpoints projection, and is still being retried."""
    agent = make_agent("a", state_dir=tmp_path / "a")
    (tmp_path / "a").mkdir(exist_ok=True)
    (tmp_path / "a" / "checkpoints").write_text("not a directory")
    async with GymClient(agent.url, "a") as client:
        coord = coordinator(sqlite_store, {"a": client})
        await coord.start()
        outcome = await coord.checkpoint("c3")
        assert outcome.committed and outcome.stuck == ["a"]
        stream = events_of(sqlite_store, checkpoint_stream("c3"))
        assert not any(isinstance(e, CheckpointResumed) for e in stream)
        assert not any(isinstance(e, CheckpointParticipantFinished) for e in stream)
        stuck = [e for e in stream if isinstance(e, CheckpointParticipantStuck)]
        assert len(stuck) == 1 and stuck[0].step == "commit" and stuck[0].agent_name == "a"
        assert coord.checkpoints.stuck()[0][:2] == ("c3", "a")
        assert coord._finisher.busy(), "the decided commit is still being retried"
        # The directory can be written again: the retried commit lands, the agent resumes, and
        # only then is the checkpoint resumed in the log.
        (tmp_path / "a" / "checkpoints").unlink()
        await asyncio.wait_for(_until_resumed(coord, "c3"), 30)
        assert (await client.status()).phase == "idle"
        assert coord.checkpoints.stuck() == []
        await coord.close()


async def _until_resumed(coord: RolloutCoordinator, checkpoint_id: str) -> None:
    while coord.checkpoints.checkpoints[checkpoint_id].status != "resumed":
        await asyncio.sleep(0.1)
        await coord.catch_up()


class _AbortFailsOnce(GymClient):
    """A client whose first /checkpoint/abort is answered 503 without reaching the agent."""

    failed = False

    async def abort(self, checkpoint_id: str) -> PhaseResponse:
        if not self.failed:
            self.failed = True
            raise AgentServerError("/checkpoint/abort: HTTP 503", status_code=503)
        return await super().abort(checkpoint_id)


async def test_case4_an_abort_that_fails_once_is_retried_until_the_agent_confirms(
    sqlite_store: EventStore, make_agent: MakeAgent
) -> None:
    """A prepare that cannot finish (the deadline) aborts; the first abort call fails.  The agent is
    idle afterwards and the next checkpoint commits."""
    agent = make_agent("a", delay_s=5.0)
    async with _AbortFailsOnce(agent.url, "a") as client:
        # The try heartbeats (it is not stuck) and no retire is allowed as a last resort: it blocks.
        coord = coordinator(
            sqlite_store, {"a": client}, prepare_timeout_s=0.3, park_grace_s=30.0, max_checkpoint_retires=0
        )
        await coord.start()
        await coord.submit(gid(), PROMPT, "a", 1, PAYLOAD)
        async with asyncio.timeout(30):  # the gate: the try is running, so prepare cannot finish in 0.3 s
            while (await client.status()).running == 0:
                await asyncio.sleep(0.02)
        outcome = await coord.checkpoint("c4a")
        assert outcome.outcome == "aborted" and client.failed
        assert (await client.status()).phase == "idle"
        finished = [
            e
            for e in events_of(sqlite_store, checkpoint_stream("c4a"))
            if isinstance(e, CheckpointParticipantFinished)
        ]
        assert [(e.agent_name, e.outcome) for e in finished] == [("a", "aborted")]
        await coord.close()


async def test_case5_retire_against_an_agent_gone_for_good_dead_letters_the_group(
    sqlite_store: EventStore, make_agent: MakeAgent
) -> None:
    """The agent is stopped for good mid-try: the retire budget runs out, the try is declared lost
    (`RunFailed` agent_lost) and the group dead-lettered, naming why; nothing retries for ever."""
    agent = make_agent("a", delay_s=30.0)
    policy = RetryPolicy(max_calls=4, deadline_s=2.0, base_s=0.05, cap_s=0.2)
    async with GymClient(agent.url, "a", control_timeout_s=1.0) as client:
        coord = coordinator(
            sqlite_store, {"a": client}, max_tries=2, rollout_timeout_s=0.5, retire_policy=policy
        )
        await coord.start()
        g = gid()
        await coord.submit(g, PROMPT, "a", 1, PAYLOAD)
        async with asyncio.timeout(30):  # the gate: a try is running at the agent when it goes away
            while (await client.status()).running == 0:
                await asyncio.sleep(0.02)
        await asyncio.to_thread(agent.stop)
        await coord.wait_idle(30)
        group = coord.ledger.groups.get(g) or coord.ledger.archived[g]
        assert group.status == "dead_lettered"
        lost = [
            e
            for e in events_of(sqlite_store, f"group-{g}")
            if isinstance(e, RunFailed) and e.kind == "agent_lost"
        ]
        assert lost and "declared lost" in lost[-1].reason
        await coord.close()


async def test_case7_a_client_named_for_another_agent_is_refused_at_start(
    sqlite_store: EventStore, make_agent: MakeAgent
) -> None:
    """The agent is "a" but the coordinator calls it "b": refused at start with a clear error,
    before any receipt could be owed to the wrong name (and every ACK answered unknown_execution)."""
    agent = make_agent("a")
    async with GymClient(agent.url, "b") as client:
        coord = coordinator(sqlite_store, {"b": client})
        with pytest.raises(AgentIdentityError, match="is 'a', not 'b'"):
            await coord.start()
        await coord.close()


async def test_case6_another_trainers_cut_does_not_archive_this_trainers_rolled_back_work(
    pg_url: str, make_agent: MakeAgent
) -> None:
    """T1 checkpoints, then claims a group; T2 commits a checkpoint; T1 restores to its own cut.
    The claim rolls back and the group is offered and claimable again."""
    upgrade_database(pg_url)
    stores = [open_store(pg_url) for _ in range(3)]
    a1, a2 = make_agent("a1"), make_agent("a2")
    try:
        async with GymClient(a1.url, "a1") as c1, GymClient(a2.url, "a2") as c2:
            t1 = coordinator(stores[0], {"a1": c1}, trainer_id="T1")
            t2 = coordinator(stores[1], {"a2": c2}, trainer_id="T2")
            await t1.start()
            await t2.start()
            g = gid()
            await t1.submit(g, PROMPT, "a1", 2, PAYLOAD)
            await t1.wait_idle(30)
            assert (await t1.checkpoint("t1-c1")).committed
            await t1.claim_for_training(g, 0)
            await t2.catch_up()
            assert (await t2.checkpoint("t2-c1")).committed
            assert g in t2.ledger.groups, "T2's cut archived T1's group"
            await t1.close()
            await t2.close()
            t1b = await RolloutCoordinator.recover(
                stores[2], {"a1": c1}, trainer_id="T1", rollout_timeout_s=10
            )
            assert g in [s.group_id for s in t1b.sealed_unclaimed()]
            await t1b.claim_for_training(g, 0)
            await t1b.close()
            # The log of two trainers, each restoring to its own cut, audits clean (archived-by-own-cut).
            report = audit_log(stores[2])
            assert report.ok, report.as_json()
    finally:
        for s in stores:
            s.close()


async def test_case2_a_recovery_during_a_live_prepare_aborts_in_the_log_first_and_the_live_one_cannot_commit(
    pg_url: str, make_agent: MakeAgent
) -> None:
    """A prepares (its try is still running, so prepare waits); B recovers the same trainer and
    presumes A's checkpoint aborted: written to the log, then at the agent.  A's decision append is
    refused (fenced), so the log never says committed or resumed for what the agent aborted."""
    upgrade_database(pg_url)
    store_a, store_b = open_store(pg_url), open_store(pg_url)
    agent = make_agent("a")
    try:
        async with GymClient(agent.url, "a") as ca, GymClient(agent.url, "a") as cb:
            a = coordinator(store_a, {"a": ca}, park_grace_s=60.0, prepare_timeout_s=60.0)
            await a.start()
            g = gid()
            # The gates: try 0 hangs (until B's recovery retires it), so A's prepare cannot finish
            # before B fences A, however long B's recovery takes; and it is running before A prepares.
            await ca.set_faults(AttemptFault(rollout_id=f"{g}_g0", attempt_index=0, hang=True))
            await a.submit(g, PROMPT, "a", 1, PAYLOAD)
            async with asyncio.timeout(30):
                while (await ca.status()).running == 0:
                    await asyncio.sleep(0.02)
            live = asyncio.create_task(a.checkpoint("c2"))
            async with asyncio.timeout(60):
                while not list(store_b.read_stream(checkpoint_stream("c2"))):
                    await asyncio.sleep(0.05)
            b = await RolloutCoordinator.recover(store_b, {"a": cb}, rollout_timeout_s=10)
            with pytest.raises(FencedOff):
                await asyncio.wait_for(live, 60)
            types = [type(e).__name__ for e in events_of(store_b, checkpoint_stream("c2"))]
            assert "CheckpointAborted" in types
            assert "CheckpointCommitted" not in types and "CheckpointResumed" not in types
            assert (await cb.status()).phase == "idle"
            await b.wait_idle(30)
            await a.close()
            await b.close()
    finally:
        store_a.close()
        store_b.close()


async def test_an_agent_left_prepared_by_an_aborted_checkpoint_is_reconciled_while_running(
    sqlite_store: EventStore, make_agent: MakeAgent
) -> None:
    """The log says aborted but the abort never reached the agent (it stayed prepared, admission
    closed): the running coordinator notices within its reconcile interval and aborts it there."""
    agent = make_agent("a")
    async with GymClient(agent.url, "a") as client:
        coord = coordinator(sqlite_store, {"a": client}, reconcile_every_s=0.2)
        await coord.start()
        stream = checkpoint_stream("cx")
        await coord._journal.append(
            stream, [CheckpointPrepareStarted(checkpoint_id="cx", participants=["a"])]
        )
        await client.prepare("cx", timeout_s=1.0)
        await coord._journal.append(
            stream, [CheckpointAborted(checkpoint_id="cx", participants=["a"], reason="test: abort lost")]
        )
        assert (await client.status()).phase == "prepared"
        async with asyncio.timeout(20):
            while "a" not in coord.checkpoints.checkpoints["cx"].finished:
                await asyncio.sleep(0.1)
        assert (await client.status()).phase == "idle"
        finished = [
            e for e in events_of(sqlite_store, stream) if isinstance(e, CheckpointParticipantFinished)
        ]
        assert [(e.agent_name, e.outcome) for e in finished] == [("a", "aborted")]
        await coord.close()


async def test_another_agent_behind_the_same_address_after_a_reconnect_is_not_driven(
    sqlite_store: EventStore, make_agent: MakeAgent
) -> None:
    """Agent "a" goes away and agent "z" comes up on its port: the coordinator's periodic check sees
    the other name, records an `AgentIdentityError` the operator gets from `wait_idle`, and stops driving
    it (no reconcile, so nothing of a's checkpoint is done at z)."""
    first = make_agent("a")
    port = first.port
    async with GymClient(first.url, "a") as client:
        coord = coordinator(sqlite_store, {"a": client}, reconcile_every_s=0.1)
        await coord.start()
        await asyncio.to_thread(first.stop)
        make_agent("z", port=port)
        async with asyncio.timeout(20):
            while not any(isinstance(e, AgentIdentityError) for e in coord.errors):
                await asyncio.sleep(0.05)
        with pytest.raises(AgentIdentityError, match="now 'z', not 'a'"):
            await coord.wait_idle(5)
        await coord.close()
