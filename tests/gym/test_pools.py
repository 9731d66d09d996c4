"""Control calls have their own connection pool (docs/protocol.md, Connection pools)."""

from __future__ import annotations

import asyncio

import pytest

from protocol.wire import FaultRates, RateFaults
from tests.gym.conftest import MakeAgent, run_request, wait_for
from trainer.gym import GoneError, GymClient, NotFoundError

RUNS = 200


async def test_control_call_answers_while_the_run_pool_is_full(make_agent: MakeAgent) -> None:
    agent = make_agent("busy")
    async with GymClient(agent.url, "busy", max_run_connections=RUNS, control_timeout_s=5) as c:
        await c.set_faults(RateFaults(rates=FaultRates(hang=1.0)))  # every new try hangs
        runs = [asyncio.create_task(c.run(run_request(f"h{i}"))) for i in range(RUNS)]
        extra = asyncio.create_task(c.run(run_request("queued")))  # waits for a run-pool connection

        async def all_running() -> bool:
            return (await c.status()).running == RUNS

        await wait_for(all_running, timeout_s=30)
        # Every run connection is held by a hung run: a control call that queued behind them would
        # never be answered and would end in a timeout after control_timeout_s.  Both are answered.
        status = await c.status()
        assert status.running == RUNS
        with pytest.raises(NotFoundError):  # the agent's answer for a running try, not a pool timeout
            await c.completion_receipt("h0", 0)
        assert "queued" not in await c.debug_runs()  # the 201st run really is queued in the client

        # Retiring one hung run (its call ends with 410) frees a connection for the queued run.
        await c.set_faults(RateFaults(rates=FaultRates()))
        assert (await c.retire("h0", 0)).retired
        with pytest.raises(GoneError):
            await runs[0]
        assert (await asyncio.wait_for(extra, 10)).rollout_id == "queued"
        for task in runs[1:]:
            task.cancel()  # the agent's shutdown ends the rest
        await asyncio.gather(*runs[1:], return_exceptions=True)
