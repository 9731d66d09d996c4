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
from protocol.wire import AttemptFault, CrashAfter
from tests.gym.conftest import TOKEN, run_request, wait_for
from trainer.gym import (
    AgentServerError,
    AgentUnavailableError,
    ConnectionLostError,
    GoneError,
    GymClient,
)

pytestmark = pytest.mark.slow


@pytest.fixture
def proc(tmp_path: Path) -> Iterator[AgentProcess]:
    agent = AgentProcess("proc-agent", token=TOKEN, state_dir=tmp_path / "state", turns=(1, 2))
    try:
        yield agent.start()
    finally:
        agent.close()


async def test_crash_after_loses_stored_replies_and_the_restart_refuses_the_tries_it_started(
    proc: AgentProcess,
) -> None:
    async with GymClient(proc.url, proc.name, token=TOKEN) as c:
        generation = (await c.status()).execution_generation
        await c.set_faults(CrashAfter(crash_after=2))
        kept = await c.run(run_request("before-crash"))
        receipt_before = await c.completion_receipt("before-crash", 0)
        assert receipt_before.result_identity == kept.id
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
        assert status.execution_incarnation != receipt_before.execution_incarnation
        # The new process refuses both tries its predecessor started: the finished one's result went
        # with it, and the other must not run twice; the trainer retires them (`done`) and replaces them.
        for rid in ("before-crash", "crasher"):
            with pytest.raises(GoneError):
                await c.completion_receipt(rid, 0)
            with pytest.raises(GoneError):
                await c.run(run_request(rid))
            assert (await c.retire(rid, 0)).done
        [ack] = await c.acknowledge([receipt_before])
        assert ack.error == "unknown_execution"
        assert await c.debug_runs() == {}
        # A try never seen runs, with a receipt of the new process.
        await c.run(run_request("after-crash"))
        receipt = await c.completion_receipt("after-crash", 0)
        assert (receipt.execution_generation, receipt.execution_incarnation) == (
            status.execution_generation,
            status.execution_incarnation,
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
