"""A try's own progress and work as the registry reports them: what a prepare judges a try by.

The runner is driven by gates (asyncio events the test sets), so every reading is taken at a known
point of the try: inside a model call, after a heartbeat, in a tool after its token record, parked.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from participant.errors import GoneError, NotFoundError, NotReadyError
from participant.executions import ExecutionRegistry, Runner, RunSession
from protocol.wire import RetireRequest, RunReply, RunRequest, TokenEntry

KEY = "p1_g0"


def _record_call(request: RunRequest, session: RunSession) -> None:
    """The one model call's token record: 7 generated tokens (a replacement's record names its try)."""
    session.record(
        TokenEntry(
            rollout_id=f"{request.rollout_id}-a{request.attempt_index}"
            if request.attempt_index
            else request.rollout_id,
            model_call_id="call-1",
            model="m",
            prompt_token_ids=[1],
            generation_token_ids=list(range(7)),
            generation_log_probs=[-1.0] * 7,
            output_items=[{"type": "message"}],
            token_item_index=0,
            created_at=0.0,
        )
    )


def _reply(request: RunRequest) -> RunReply:
    return RunReply(
        rollout_id=request.rollout_id,
        attempt_index=request.attempt_index,
        id=f"r-{request.rollout_id}",
        response={"output": []},
        reward=1.0,
    )


class GatedRunner:
    """boundary -> model call (heartbeat of 5 tokens) -> record of 7 tokens -> tool -> boundary -> reply."""

    def __init__(self) -> None:
        self.in_call = asyncio.Event()
        self.beat = asyncio.Event()
        self.beaten = asyncio.Event()
        self.finish_call = asyncio.Event()
        self.in_tool = asyncio.Event()
        self.finish_tool = asyncio.Event()

    async def __call__(self, request: RunRequest, session: RunSession) -> RunReply:
        await session.at_boundary()
        self.in_call.set()
        await self.beat.wait()
        session.heartbeat(generated_tokens=5)
        self.beaten.set()
        await self.finish_call.wait()
        _record_call(request, session)
        self.in_tool.set()
        await self.finish_tool.wait()
        await session.at_boundary()
        return _reply(request)


def registry(tmp_path: Path, runner: Runner, heartbeat_s: float | None = 0.5) -> ExecutionRegistry:
    return ExecutionRegistry(
        agent_name="a", generation=1, runner=runner, state_dir=tmp_path, heartbeat_s=heartbeat_s
    )


async def _prepare(reg: ExecutionRegistry) -> None:
    """A prepare that finds the try running: it is asked to park, and the agent is not ready."""
    with pytest.raises(NotReadyError):
        await reg.prepare("ck", timeout_s=0.01)


async def test_a_try_in_a_model_call_reports_its_own_progress(tmp_path: Path) -> None:
    runner = GatedRunner()
    reg = registry(tmp_path, runner)
    run = asyncio.create_task(reg.run(RunRequest(rollout_id=KEY, attempt_index=0)))
    await runner.in_call.wait()
    await _prepare(reg)
    status = reg.status()
    assert status.heartbeat_s == 0.5
    [p] = status.progress
    assert (p.rollout_id, p.attempt_index, p.in_model_call, p.model_calls_done) == (KEY, 0, True, 0)
    assert p.work.generated_tokens == 0
    quiet = p.since_progress_s

    await asyncio.sleep(0.05)
    [later] = reg.status().progress
    assert later.since_progress_s > quiet  # nothing reported in between: the silence grows
    assert later.work.model_s > p.work.model_s  # and the model call's time runs

    runner.beat.set()
    await runner.beaten.wait()
    [beaten] = reg.status().progress
    assert beaten.since_progress_s < later.since_progress_s
    assert beaten.work.generated_tokens == 5

    runner.finish_call.set()
    await runner.in_tool.wait()
    [tool] = reg.status().progress
    assert (tool.in_model_call, tool.model_calls_done, tool.work.generated_tokens) == (False, 1, 7)
    await asyncio.sleep(0.05)
    [still] = reg.status().progress
    assert still.work.model_s == tool.work.model_s  # a tool's time is not model time

    runner.finish_tool.set()
    await asyncio.sleep(0)  # to the boundary: parked, no longer blocking nor listed
    async with asyncio.timeout(5):
        while reg.status().park_requested:
            await asyncio.sleep(0.001)
    assert reg.status().progress == [] and reg.status().parked == 1
    reg.abort("ck")
    await run
    receipt = reg.completion_receipt(KEY, 0)
    assert receipt.work is not None
    assert receipt.work.generated_tokens == 7
    assert receipt.work.model_s == pytest.approx(still.work.model_s, abs=1e-3)
    reg.evidence.close()


async def test_a_cancelled_try_reports_the_work_it_threw_away(tmp_path: Path) -> None:
    runner = GatedRunner()
    reg = registry(tmp_path, runner, heartbeat_s=None)
    run = asyncio.create_task(reg.run(RunRequest(rollout_id=KEY, attempt_index=0)))
    runner.beat.set()
    await runner.beaten.wait()
    assert reg.status().heartbeat_s is None
    answer = await reg.retire(RetireRequest(rollout_id=KEY, attempt_index=0))
    assert answer.retired and answer.work is not None
    assert answer.work.generated_tokens == 5 and answer.work.model_s > 0
    with pytest.raises(GoneError):
        await run  # the open /run ends: the try is done for good
    reg.evidence.close()


def test_a_heartbeat_promise_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="heartbeat_s"):
        registry(tmp_path, GatedRunner(), heartbeat_s=0.0)


class LastCallRunner:
    """boundary -> the try's last model call (gated) -> record -> reply: no boundary after the call."""

    def __init__(self) -> None:
        self.in_call = asyncio.Event()
        self.finish_call = asyncio.Event()

    async def __call__(self, request: RunRequest, session: RunSession) -> RunReply:
        await session.at_boundary()
        self.in_call.set()
        await self.finish_call.wait()
        _record_call(request, session)
        return _reply(request)


async def test_a_try_whose_last_call_ends_during_a_prepare_parks_at_its_end_holding_its_reply(
    tmp_path: Path,
) -> None:
    """The end of a run is a boundary: the prepare then waits for the call alone, and has no result to
    take in (record and ACK) before the agent is ready; the reply goes out after the decision."""
    runner = LastCallRunner()
    reg = registry(tmp_path, runner)
    run = asyncio.create_task(reg.run(RunRequest(rollout_id=KEY, attempt_index=0)))
    await runner.in_call.wait()
    await _prepare(reg)  # asked to park inside its last call
    runner.finish_call.set()
    prepared = await reg.prepare("ck", timeout_s=5)  # returns once nothing blocks
    s = prepared.status
    assert (prepared.phase, s.ready_to_commit, s.parked, s.completed_unacknowledged) == (
        "prepared",
        True,
        1,
        0,
    )
    assert not run.done()  # its reply is held, not recorded, until the decision
    with pytest.raises(NotFoundError):
        reg.completion_receipt(KEY, 0)
    assert (await reg.commit("ck")).phase == "committed_paused"
    reg.resume("ck")
    outcome = await asyncio.wait_for(run, 5)
    assert outcome.live and outcome.reply["id"] == f"r-{KEY}"
    receipt = reg.completion_receipt(KEY, 0)
    assert receipt.work is not None and receipt.work.generated_tokens == 7
    reg.evidence.close()
