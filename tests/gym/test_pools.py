"""Control calls have their own connection pool (protocol.md §8)."""

from __future__ import annotations

import asyncio
import time

from gym_agent.wire import FaultRates, RateFaults
from tests.gym.conftest import MakeAgent, run_request, wait_for
from workers.gym import GymClient

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
        assert elapsed < 1.0, f"control calls took {elapsed:.2f} s behind {RUNS} open runs"
        assert "queued" not in await c.debug_runs()  # the 201st run really is queued in the client

        # Clean up: retiring ends every hung run (410) and frees the pool for the queued one.
        await c.set_faults(RateFaults(rates=FaultRates()))
        await asyncio.gather(*(c.retire(f"h{i}", 0) for i in range(RUNS)))
        results = await asyncio.gather(*runs, return_exceptions=True)
        assert all(type(r).__name__ == "GoneError" for r in results)
        assert (await asyncio.wait_for(extra, 10)).rollout_id == "queued"
