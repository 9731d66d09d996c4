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


async def test_checkpoint_phase_calls_answer_while_the_control_pool_is_held(make_agent: MakeAgent) -> None:
    """The phase calls have a pool of their own: with every control call held at a gate (as behind
    the receipts, token records and ACKs of a burst of results), prepare, commit and resume answer."""
    agent = make_agent("phases")
    async with GymClient(agent.url, "phases", control_timeout_s=5) as c:
        await c.connect()
        held, release = asyncio.Event(), asyncio.Event()
        exchange = c._control.exchange

        async def at_the_gate(*args: object, **kwargs: object) -> object:
            held.set()
            await release.wait()
            return await exchange(*args, **kwargs)  # type: ignore[arg-type]

        c._control.exchange = at_the_gate  # type: ignore[method-assign,assignment]
        status = asyncio.create_task(c.status())
        await asyncio.wait_for(held.wait(), 10)
        prepared = await asyncio.wait_for(c.prepare("ck-p", timeout_s=1, carry=True), 10)
        assert prepared.phase == "prepared"
        assert (await asyncio.wait_for(c.commit("ck-p"), 10)).phase == "committed_paused"
        assert (await asyncio.wait_for(c.resume("ck-p"), 10)).phase == "idle"
        assert not status.done()  # the control call is still held
        release.set()
        assert (await asyncio.wait_for(status, 10)).phase == "idle"
