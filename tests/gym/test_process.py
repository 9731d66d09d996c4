"""The agent as its own process: SIGTERM stops it cleanly; crash_after loses replies, not generations."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gym_agent import cli as gym_cli
from gym_agent.faults import CRASH_EXIT_CODE
from gym_agent.launcher import AgentProcess
from protocol.digests import reply_digest
from protocol.wire import AttemptFault, CompletionReceipt, CrashAfter, RunReply
from tests.gym.conftest import TOKEN, run_request, wait_for
from trainer.gym import (
    AgentServerError,
    AgentUnavailableError,
    ConnectionLostError,
    GymClient,
    NotFoundError,
)

pytestmark = pytest.mark.slow


@pytest.fixture
def proc(tmp_path: Path) -> Iterator[AgentProcess]:
    agent = AgentProcess("proc-agent", token=TOKEN, state_dir=tmp_path / "state", turns=(1, 2))
    try:
        yield agent.start()
    finally:
        agent.close()


async def test_crash_after_loses_stored_replies_and_bumps_the_generation(proc: AgentProcess) -> None:
    async with GymClient(proc.url, proc.name, token=TOKEN) as c:
        generation = (await c.status()).execution_generation
        await c.set_faults(CrashAfter(crash_after=2))
        kept = await c.run(run_request("before-crash"))
        assert (await c.completion_receipt("before-crash", 0)).result_identity == kept.id
        with pytest.raises(ConnectionLostError):
            await c.run(run_request("crasher"))
    assert proc.wait_exit(10) == CRASH_EXIT_CODE

    port = proc.port
    proc.restart()  # same port, same state dir
    assert proc.port == port
    async with GymClient(proc.url, proc.name, token=TOKEN) as c:
        status = await c.status()
        assert status.execution_generation > generation
        assert (status.completed_unacknowledged, status.running) == (0, 0)
        assert await c.debug_runs() == {}
        for rid in ("before-crash", "crasher"):
            with pytest.raises(NotFoundError):
                await c.completion_receipt(rid, 0)
        [ack] = await c.acknowledge([_receipt_before_the_crash(kept)])
        assert ack.error == "unknown_execution"
        # A rerun of the same try is a fresh execution with a receipt of the new generation.
        again = await c.run(run_request("before-crash"))
        receipt = await c.completion_receipt("before-crash", 0)
        assert again == kept  # the episode is deterministic...
        assert (
            receipt.execution_generation == status.execution_generation
        )  # ...its receipt is not the old one


def _receipt_before_the_crash(reply: RunReply) -> CompletionReceipt:
    return CompletionReceipt(
        rollout_id=reply.rollout_id,
        attempt_index=reply.attempt_index,
        execution_generation=1,
        result_identity=reply.id,
        result_digest=reply_digest(reply.model_dump(mode="json")),
        manifest_capture_key=reply.rollout_id,
        terminal_model_call_id="call-1",
    )


async def test_sigterm_stops_cleanly_with_a_run_in_flight(proc: AgentProcess) -> None:
    async with GymClient(proc.url, proc.name, token=TOKEN) as c:
        await c.set_faults(AttemptFault(rollout_id="stuck", attempt_index=0, hang=True))
        hung = asyncio.create_task(c.run(run_request("stuck")))

        async def running() -> bool:
            return (await c.status()).running == 1

        await wait_for(running)
        start = time.monotonic()
        assert proc.process is not None
        proc.process.send_signal(signal.SIGTERM)
        code = await asyncio.to_thread(proc.wait_exit, 20)
        assert code == 0
        assert time.monotonic() - start < 10
        # The open /run call ends at once: 503 shutting_down (or a closed connection).
        with pytest.raises((AgentServerError, ConnectionLostError)):
            await hung
        with pytest.raises(AgentUnavailableError):
            await c.status()
    log = proc.log_tail(100_000)
    assert TOKEN not in log
    assert "execution_generation" in log


def test_cli_help_and_bad_options() -> None:
    runner = CliRunner()
    shown = runner.invoke(gym_cli.app, ["serve", "--help"])
    assert shown.exit_code == 0 and "--turns" in shown.output and "--delay-s" in shown.output
    for bad in (["--turns", "3:1"], ["--turns", "x"], ["--name", "bad name"]):
        args = ["serve", "--name", "x", "--port", "1", *bad]
        assert runner.invoke(gym_cli.app, args).exit_code == 2, bad
