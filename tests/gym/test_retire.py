"""Every row of the retire table and of the phase-fence table (docs/protocol.md, Retire or adopt; Checkpoints)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from gym_agent.server import ThreadAgent
from participant import executions
from participant.checkpoint import AgentCheckpoint, write_checkpoint
from protocol.wire import AttemptFault, RetireResponse
from tests.gym.conftest import MakeAgent, fresh_id, run_request, wait_for
from trainer.gym import (
    CheckpointConflictError,
    GoneError,
    GymClient,
    InvalidPhaseError,
    StaleCheckpointError,
)

ANY = "0" * 32  # the answering process's incarnation, checked and blanked by `_answer`
RETIRED = RetireResponse(
    retired=True, tombstoned=True, completed_unacknowledged=False, execution_incarnation=ANY
)
REFUSED = RetireResponse(
    retired=False, tombstoned=False, completed_unacknowledged=True, execution_incarnation=ANY
)
TOMBSTONED = RetireResponse(
    retired=False, tombstoned=True, completed_unacknowledged=False, execution_incarnation=ANY
)
DONE = RetireResponse(
    retired=False, tombstoned=False, completed_unacknowledged=False, done=True, execution_incarnation=ANY
)


def _answer(answer: RetireResponse) -> RetireResponse:
    """The answer without its identity, after checking it names the answering process's."""
    assert answer.execution_generation is not None and answer.execution_generation >= 1
    # Only a cancelled execution reports the work it had done.
    assert (answer.work is not None) == answer.retired
    assert answer.execution_incarnation != ANY
    return answer.model_copy(
        update={"execution_generation": None, "execution_incarnation": ANY, "work": None}
    )


VALID_FROM = "(valid from: ['idle', 'prepared', 'preparing'])"


@asynccontextmanager
async def connect(agent: ThreadAgent) -> AsyncIterator[GymClient]:
    async with GymClient(agent.url, agent.config.name) as c:
        yield c


async def _running(client: GymClient, *, delay_s: float = 0.0) -> tuple[str, asyncio.Task[object]]:
    """Starts a try that hangs (or, with `delay_s`, holds each model call) and waits until it runs."""
    rid = fresh_id("rT")
    await client.set_faults(AttemptFault(rollout_id=rid, attempt_index=0, hang=not delay_s, delay_s=delay_s))
    task = asyncio.create_task(client.run(run_request(rid)))

    async def started() -> bool:
        return any(a.rollout_id == rid for a in (await client.status()).blocking_attempts)

    await wait_for(started)
    return rid, task


# -- the retire table ---------------------------------------------------------------------------


async def test_retire_running_try_cancels_it(client: GymClient) -> None:
    rid, task = await _running(client)
    assert _answer(await client.retire(rid, 0)) == RETIRED
    with pytest.raises(GoneError):
        await task  # the open /run call ends: the try is cancelled for good
    assert all(a.rollout_id != rid for a in (await client.status()).blocking_attempts)
    with pytest.raises(GoneError):
        await client.run(run_request(rid))
    assert _answer(await client.retire(rid, 0)) == DONE  # already retired


async def test_retire_parked_try_cancels_it(make_agent: MakeAgent) -> None:
    agent = make_agent(turns=(3, 3))
    async with connect(agent) as c:
        rid, task = await _running(c, delay_s=0.3)
        await c.prepare("ckpt-A", timeout_s=10)
        assert (await c.status()).parked == 1
        assert _answer(await c.retire(rid, 0, checkpoint_id="ckpt-A")) == RETIRED
        with pytest.raises(GoneError):
            await task
        status = await c.status()
        assert (status.parked, status.ready_to_commit) == (0, True)


async def test_retire_completed_unacknowledged_is_refused(client: GymClient) -> None:
    rid = fresh_id("rD")
    await client.run(run_request(rid))
    assert _answer(await client.retire(rid, 0)) == REFUSED
    # Adopt it: the re-sent /run replays, the ACK releases it.
    reply = await client.run(run_request(rid))
    assert (await client.debug_runs())[rid] == 1
    receipt = await client.completion_receipt(rid, 0)
    assert receipt.result_identity == reply.id
    [ack] = await client.acknowledge([receipt])
    assert ack.acknowledged and not ack.idempotent
    assert _answer(await client.retire(rid, 0)) == DONE


async def test_retire_never_seen_tombstones(client: GymClient) -> None:
    rid = fresh_id()
    assert _answer(await client.retire(rid, 3)) == TOMBSTONED
    with pytest.raises(GoneError):
        await client.run(run_request(rid, 3))
    assert rid not in await client.debug_runs()
    assert _answer(await client.retire(rid, 3)) == DONE


async def test_retire_acknowledged_is_done(client: GymClient) -> None:
    rid = fresh_id()
    await client.run(run_request(rid))
    await client.acknowledge([await client.completion_receipt(rid, 0)])
    assert _answer(await client.retire(rid, 0)) == DONE


async def test_retire_tombstones_a_try_waiting_for_admission(make_agent: MakeAgent) -> None:
    async with connect(make_agent()) as c:
        await c.prepare("ckpt-A", timeout_s=5)
        waiting = asyncio.create_task(c.run(run_request("late")))
        await asyncio.sleep(0.1)
        assert _answer(await c.retire("late", 0, checkpoint_id="ckpt-A")) == TOMBSTONED
        await c.abort("ckpt-A")
        with pytest.raises(GoneError):
            await waiting
        assert "late" not in await c.debug_runs()


# -- the phase fence --------------------------------------------------------------------------------


async def test_fence_idle(make_agent: MakeAgent) -> None:
    async with connect(make_agent()) as c:
        assert _answer(await c.retire("a", 0)) == TOMBSTONED
        await c.prepare("ckpt-A", timeout_s=5)
        await c.commit("ckpt-A")
        await c.resume("ckpt-A")
        with pytest.raises(StaleCheckpointError) as stale:
            await c.retire("b", 0, checkpoint_id="ckpt-A")
        assert stale.value.message == (
            "checkpoint 'ckpt-A' already finished with outcome 'resumed'; this call is from a stale coordinator"
        )
        assert stale.value.status_code == 409 and stale.value.error == "StaleCheckpointError"
        with pytest.raises(StaleCheckpointError):
            await c.retire("b", 0, checkpoint_id="never-seen")
        assert _answer(await c.retire("b", 0)) == TOMBSTONED  # refused calls changed nothing


@pytest.mark.parametrize("phase", ["preparing", "prepared"])
async def test_fence_preparing_and_prepared(make_agent: MakeAgent, phase: str) -> None:
    async with connect(make_agent(turns=(1, 1))) as c:
        # A finished checkpoint (for the stale column) and, for "preparing", a 409 that leaves the phase.
        await c.prepare("ckpt-old", timeout_s=5)
        await c.abort("ckpt-old")
        if phase == "preparing":
            await c.run(run_request("done"))
            with pytest.raises(Exception, match="not_ready"):
                await c.prepare("ckpt-A", timeout_s=5)
        else:
            await c.prepare("ckpt-A", timeout_s=5)
        assert (await c.status()).phase == phase

        with pytest.raises(CheckpointConflictError) as conflict:
            await c.retire("rl-retire-2", 0)
        assert conflict.value.message == (
            f"checkpoint 'ckpt-A' is active in phase '{phase}'; refusing operation for 'rl-retire-2'"
        )
        with pytest.raises(CheckpointConflictError):
            await c.retire("rl-retire-2", 0, checkpoint_id="ckpt-B")
        with pytest.raises(StaleCheckpointError, match="outcome 'aborted'"):
            await c.retire("rl-retire-2", 0, checkpoint_id="ckpt-old")
        assert _answer(await c.retire("rl-retire-2", 0, checkpoint_id="ckpt-A")) == TOMBSTONED
        await c.abort("ckpt-A")


async def test_fence_committed_paused(make_agent: MakeAgent) -> None:
    async with connect(make_agent()) as c:
        await c.prepare("ckpt-old", timeout_s=5)
        await c.abort("ckpt-old")
        await c.prepare("ckpt-A", timeout_s=5)
        await c.commit("ckpt-A")
        for checkpoint_id in (None, "ckpt-A", "ckpt-B", "ckpt-old"):
            with pytest.raises(InvalidPhaseError) as invalid:
                await c.retire("x", 0, checkpoint_id=checkpoint_id)
            assert invalid.value.message == f"operation not valid in phase 'committed_paused' {VALID_FROM}"
        await c.resume("ckpt-A")
        assert _answer(await c.retire("x", 0)) == TOMBSTONED


async def test_fence_committing(make_agent: MakeAgent, monkeypatch: pytest.MonkeyPatch) -> None:
    # The commit's write waits for the test's gate, so the agent stays `committing` for as long as the
    # retires below take, however slowly they are served.
    release = threading.Event()

    def slow_write(state_dir: Path, checkpoint: AgentCheckpoint) -> Path:
        release.wait(30)
        return write_checkpoint(state_dir, checkpoint)

    monkeypatch.setattr(executions, "write_checkpoint", slow_write)
    async with connect(make_agent()) as c:
        await c.prepare("ckpt-A", timeout_s=5)
        commit = asyncio.create_task(c.commit("ckpt-A"))

        async def committing() -> bool:
            return (await c.status()).phase == "committing"

        await wait_for(committing)
        for checkpoint_id in (None, "ckpt-A", "ckpt-B"):
            with pytest.raises(InvalidPhaseError) as invalid:
                await c.retire("x", 0, checkpoint_id=checkpoint_id)
            assert invalid.value.message == f"operation not valid in phase 'committing' {VALID_FROM}"
        release.set()
        assert (await commit).phase == "committed_paused"
        await c.resume("ckpt-A")
