"""Control calls have their own connection pool (docs/protocol.md, Connection pools)."""

from __future__ import annotations

import asyncio
import time

import pytest

from protocol.wire import FaultRates, RateFaults
from tests.gym.conftest import MakeAgent, run_request, wait_for
from trainer.gym import GoneError, GymClient

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
        start = time.perf_counter()
        status = await c.status()
        receipt_miss = c.completion_receipt("h0", 0)
        await asyncio.gather(receipt_miss, return_exceptions=True)
        elapsed = time.perf_counter() - start
        assert status.running == RUNS
        assert elapsed < 2.0, f"control calls took {elapsed:.2f} s behind {RUNS} open runs"
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
