"""Checkpoint participation: prepare/commit/resume/abort, parking, admission, readiness."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest

from gym_agent.config import AgentConfig
from gym_agent.server import ThreadAgent, serve_in_thread
from protocol.wire import FEATURE_CARRY_COMPLETED, AttemptFault, AttemptRef
from tests.gym.conftest import MakeAgent, run_request, wait_for
from trainer.gym import (
    CheckpointConflictError,
    GymClient,
    InvalidPhaseError,
    NotReadyError,
    StaleCheckpointError,
)


@asynccontextmanager
async def connect(agent: ThreadAgent) -> AsyncIterator[GymClient]:
    async with GymClient(agent.url, agent.config.name) as c:
        yield c


async def test_prepare_lists_completed_unacknowledged_then_ready_after_ack(make_agent: MakeAgent) -> None:
    async with connect(make_agent()) as c:
        await c.run(run_request("rD"))
        with pytest.raises(NotReadyError) as not_ready:
            await c.prepare("ckpt-A", timeout_s=5)
        assert not_ready.value.attempts == [AttemptRef(rollout_id="rD", attempt_index=0)]
        status = not_ready.value.status
        assert (status.phase, status.ready_to_commit, status.completed_unacknowledged) == (
            "preparing",
            False,
            1,
        )

        # Adopt during prepare: the stored reply comes back before the admission check, without a rerun.
        reply = await asyncio.wait_for(c.run(run_request("rD")), 30)  # not held for admission
        assert (await c.debug_runs())["rD"] == 1
        receipt = await c.completion_receipt("rD", 0)
        assert receipt.result_digest == reply.digest()
        [ack] = await c.acknowledge([receipt])
        assert ack.acknowledged and not ack.idempotent

        ready = await c.prepare("ckpt-A", timeout_s=5)
        assert ready.phase == "prepared"
        s = ready.status
        assert (s.ready_to_commit, s.running, s.parked, s.completed_unacknowledged) == (True, 0, 0, 0)
        assert s.active_checkpoint_id == "ckpt-A"
        await c.abort("ckpt-A")


async def test_a_prepare_that_carries_finished_tries_answers_prepared_and_keeps_them(
    make_agent: MakeAgent,
) -> None:
    """Asked to carry (FEATURE_CARRY_COMPLETED), a prepare with nothing running answers prepared at
    once, naming the finished unACKed try; the try stays as it is across commit and resume, and its
    receipt is still fetched and ACKed after."""
    async with connect(make_agent()) as c:
        seen = await c.connect()
        assert FEATURE_CARRY_COMPLETED in seen.features and c.carries_completed
        reply = await c.run(run_request("rC"))
        ready = await c.prepare("ckpt-C", timeout_s=5, carry=True)
        assert ready.phase == "prepared"
        assert ready.carried == [AttemptRef(rollout_id="rC", attempt_index=0)]
        assert (ready.status.completed_unacknowledged, ready.status.ready_to_commit) == (1, False)
        assert (await c.commit("ckpt-C")).phase == "committed_paused"
        assert (await c.resume("ckpt-C")).phase == "idle"
        receipt = await c.completion_receipt("rC", 0)
        assert receipt.result_digest == reply.digest()
        [ack] = await c.acknowledge([receipt])
        assert ack.acknowledged and not ack.idempotent
        assert (await c.debug_runs())["rC"] == 1
        # Nothing left to carry: the next prepare names none.
        again = await c.prepare("ckpt-D", timeout_s=5, carry=True)
        assert (again.phase, again.carried, again.status.ready_to_commit) == ("prepared", [], True)
        await c.abort("ckpt-D")


async def test_half_done_group_is_ready_once_the_finished_sibling_is_acked(make_agent: MakeAgent) -> None:
    async with connect(make_agent(turns=(3, 3))) as c:
        await c.run(run_request("p7_g0"))
        # 1 s model calls: the prepare reaches the sibling before its last boundary (2 s after it was
        # seen running); the prepare returns as soon as it parked, its bound only guards against a
        # hang (a loaded machine's model call, torch decode included, took 10 s).
        await c.set_faults(AttemptFault(rollout_id="p7_g1", attempt_index=0, delay_s=1.0))
        sibling = asyncio.create_task(c.run(run_request("p7_g1")))
        await wait_for(lambda: _running(c, 1))
        with pytest.raises(NotReadyError) as not_ready:
            await c.prepare("ckpt-A", timeout_s=120)
        s = not_ready.value.status
        assert (s.ready_to_commit, s.running, s.parked, s.completed_unacknowledged) == (False, 0, 1, 1)
        await c.acknowledge([await c.completion_receipt("p7_g0", 0)])
        assert (await c.prepare("ckpt-A", timeout_s=5)).status.ready_to_commit
        await c.abort("ckpt-A")
        await sibling


async def _running(c: GymClient, n: int) -> bool:
    return (await c.status()).running == n


async def test_park_commit_resume_continues_the_runs(make_agent: MakeAgent) -> None:
    agent = make_agent("parker", turns=(3, 3), seed=11)
    ids = [f"p1_g{i}" for i in range(3)]
    async with connect(agent) as c:
        for rid in ids:  # 1 s calls: the prepare comes before their last boundary (see above)
            await c.set_faults(AttemptFault(rollout_id=rid, attempt_index=0, delay_s=1.0))
        runs = [asyncio.create_task(c.run(run_request(rid))) for rid in ids]
        await wait_for(lambda: _running(c, 3))

        prepared = await c.prepare("ckpt-A", timeout_s=120)  # answers once all three parked
        s = prepared.status
        assert (prepared.phase, s.parked, s.running, s.park_requested, s.ready_to_commit) == (
            "prepared",
            3,
            0,
            0,
            True,
        )
        assert not any(t.done() for t in runs)  # parked tries keep their /run call open

        committed = await c.commit("ckpt-A")
        assert committed.phase == "committed_paused"
        artefact = json.loads((agent.config.resolved_state_dir / "checkpoints" / "ckpt-A.json").read_text())
        assert sorted(p["rollout_id"] for p in artefact["parked"]) == ids
        assert all(p["model_calls_done"] >= 1 for p in artefact["parked"])
        assert "reply" not in json.dumps(artefact)  # stored replies are never in the artefact

        late = asyncio.create_task(c.run(run_request("p2_g0")))
        await asyncio.sleep(0.3)
        assert not late.done() and not any(t.done() for t in runs)
        assert "p2_g0" not in await c.debug_runs()

        resumed = await c.resume("ckpt-A")
        assert resumed.phase == "idle" and resumed.status.active_checkpoint_id is None
        replies = await asyncio.wait_for(asyncio.gather(*runs, late), 120)

    # Parking loses nothing: the same episodes, played straight through elsewhere, give the same replies.
    twin = make_agent("twin", turns=(3, 3), seed=11)
    async with connect(twin) as t:
        straight = [await t.run(run_request(rid)) for rid in [*ids, "p2_g0"]]
    assert replies == straight


async def test_new_runs_wait_while_admission_is_closed(make_agent: MakeAgent) -> None:
    async with connect(make_agent()) as c:
        await c.prepare("ckpt-A", timeout_s=5)
        waiting = asyncio.create_task(c.run(run_request("w1")))
        await asyncio.sleep(0.3)
        assert not waiting.done()
        status = await c.status()
        assert (status.running, status.ready_to_commit) == (0, True)
        await c.abort("ckpt-A")
        reply = await asyncio.wait_for(waiting, 60)
        assert reply.rollout_id == "w1"
        assert (await c.debug_runs()) == {"w1": 1}


async def test_abort_resumes_parked_and_park_requested_tries(make_agent: MakeAgent) -> None:
    async with connect(make_agent(turns=(3, 3))) as c:
        # 1 s calls: "slow" is seen running 2 s before its last boundary, so the prepare reaches it
        # in time and it parks at a boundary.
        await c.set_faults(AttemptFault(rollout_id="slow", attempt_index=0, delay_s=1.0))
        await c.set_faults(AttemptFault(rollout_id="stuck", attempt_index=0, hang=True))
        slow = asyncio.create_task(c.run(run_request("slow")))
        stuck = asyncio.create_task(c.run(run_request("stuck")))
        await wait_for(lambda: _running(c, 2))
        # "stuck" never reaches a boundary, so every prepare answers not ready.  The gate: prepare
        # again (the same id: allowed) until "slow" has parked; one 0.5 s prepare was hoped to see it
        # parked, and a loaded machine's model call took 10 s.
        async with asyncio.timeout(120):
            while True:
                with pytest.raises(NotReadyError) as not_ready:
                    await c.prepare("ckpt-A", timeout_s=0.5)
                if not_ready.value.status.parked:
                    break
        s = not_ready.value.status
        assert (s.parked, s.park_requested) == (1, 1)
        assert s.blocking_attempts == [AttemptRef(rollout_id="stuck", attempt_index=0)]
        assert not_ready.value.attempts == []

        aborted = await c.abort("ckpt-A")
        assert aborted.phase == "idle"
        assert (aborted.status.running, aborted.status.parked, aborted.status.park_requested) == (2, 0, 0)
        await asyncio.wait_for(slow, 120)
        assert (await c.retire("stuck", 0)).retired
        with pytest.raises(Exception, match="410"):
            await stuck


async def test_retire_unblocks_a_prepare(make_agent: MakeAgent) -> None:
    async with connect(make_agent()) as c:
        await c.set_faults(AttemptFault(rollout_id="rT", attempt_index=0, hang=True))
        hung = asyncio.create_task(c.run(run_request("rT")))
        await wait_for(lambda: _running(c, 1))
        prepare = asyncio.create_task(c.prepare("ckpt-A", timeout_s=120))  # ends at the retire
        await asyncio.sleep(0.2)
        assert not prepare.done()
        assert (await c.retire("rT", 0, checkpoint_id="ckpt-A")).retired
        ready = await asyncio.wait_for(prepare, 60)
        s = ready.status
        assert (ready.phase, s.ready_to_commit, s.running, s.parked, s.completed_unacknowledged) == (
            "prepared",
            True,
            0,
            0,
            0,
        )
        await c.abort("ckpt-A")
        with pytest.raises(Exception, match="410"):
            await hung


async def test_phase_errors_of_the_checkpoint_calls(make_agent: MakeAgent) -> None:
    async with connect(make_agent()) as c:
        with pytest.raises(InvalidPhaseError, match=r"phase 'idle' \(valid from: \['prepared'\]\)"):
            await c.commit("ckpt-A")
        with pytest.raises(InvalidPhaseError, match="phase 'idle'"):
            await c.resume("ckpt-A")
        await c.prepare("ckpt-A", timeout_s=5)
        assert (await c.prepare("ckpt-A", timeout_s=5)).phase == "prepared"  # same id again: fine
        with pytest.raises(CheckpointConflictError, match="refusing operation for 'ckpt-B'"):
            await c.prepare("ckpt-B", timeout_s=5)
        with pytest.raises(CheckpointConflictError):
            await c.abort("ckpt-B")
        with pytest.raises(InvalidPhaseError, match=r"valid from: \['committed_paused'\]"):
            await c.resume("ckpt-A")
        await c.commit("ckpt-A")
        with pytest.raises(InvalidPhaseError, match=r"valid from: \['prepared', 'preparing'\]"):
            await c.abort("ckpt-A")
        with pytest.raises(InvalidPhaseError):
            await c.prepare("ckpt-A", timeout_s=5)
        with pytest.raises(InvalidPhaseError):
            await c.commit("ckpt-A")
        await c.resume("ckpt-A")
        for call in (c.prepare, c.commit, c.resume, c.abort):
            with pytest.raises(StaleCheckpointError, match="outcome 'resumed'"):
                await call("ckpt-A")
        assert (await c.status()).phase == "idle"


async def test_abort_is_presumed_abort_friendly(make_agent: MakeAgent) -> None:
    async with connect(make_agent()) as c:
        never_seen = await c.abort("ckpt-never")
        assert never_seen.phase == "idle"
        await c.prepare("ckpt-A", timeout_s=5)
        assert (await c.abort("ckpt-A")).phase == "idle"
        assert (await c.abort("ckpt-A")).phase == "idle"  # again: idempotent
        with pytest.raises(StaleCheckpointError, match="outcome 'aborted'"):
            await c.prepare("ckpt-A", timeout_s=5)
        # Admission is open again.
        assert (await asyncio.wait_for(c.run(run_request("after")), 60)).rollout_id == "after"


async def test_an_abort_of_a_checkpoint_never_seen_is_remembered(make_agent: MakeAgent) -> None:
    """Recovery presumed `ckpt-X` aborted before a stale coordinator's prepare of it arrived: the
    agent refuses that prepare (409 stale) and keeps its admission open."""
    async with connect(make_agent()) as c:
        assert (await c.abort("ckpt-X")).phase == "idle"
        with pytest.raises(StaleCheckpointError, match="outcome 'aborted'"):
            await c.prepare("ckpt-X", timeout_s=5)
        status = await c.status()
        assert (status.phase, status.active_checkpoint_id) == ("idle", None)
        assert (await asyncio.wait_for(c.run(run_request("still-open")), 60)).rollout_id == "still-open"
        assert (await c.abort("ckpt-X")).phase == "idle"  # and an abort of it again is a no-op


async def test_execution_generation_rises_on_every_start(tmp_path: object) -> None:
    from pathlib import Path

    assert isinstance(tmp_path, Path)
    config = AgentConfig(name="gen", state_dir=tmp_path / "gen", log_level="warning")
    generations = []
    for _ in range(3):
        with serve_in_thread(config) as agent:
            async with connect(agent) as c:
                generations.append((await c.status()).execution_generation)
                assert (await c.health()).execution_generation == generations[-1]
    first = generations[0]
    assert first >= 1 and generations == [first, first + 1, first + 2]
