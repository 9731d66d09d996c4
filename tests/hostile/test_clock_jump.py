"""A wall clock that jumps an hour forwards and backwards during a run breaks nothing.

Deadlines (rollout leases, prepare deadlines, ACK back-off) run on `time.monotonic` / the event loop's
clock; wall time is only written down (event metadata, `recorded_at`, token records).  With a
`time.time` that swings by +-1 h on every call and 30 s leases, a run with dropped replies and
checkpoints ends exactly as with a steady clock: every group sealed, no lease fired (nothing retired,
no replacement), no result stranded, nothing run twice, and the auditor finds nothing.  The leases are
far longer than an attempt takes even on a loaded machine, and far shorter than any jump, so a lease
fires here only if a deadline reads the wall clock.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest

from eventstore import open_store
from gym_agent.server import ThreadAgent, serve_in_thread
from simulation.run import SimConfig, run_simulation
from tests.gates import HeldUntilPrepared
from tests.hostile.conftest import TOKEN, agent_config
from trainer.gym import GymClient

JUMPS = (0.0, 3600.0, -3600.0, 86_400.0, -86_400.0, 1e9)


@pytest.fixture
def agents(tmp_path: Path) -> Iterator[dict[str, ThreadAgent]]:
    with ExitStack() as stack:
        yield {
            name: stack.enter_context(serve_in_thread(agent_config(tmp_path, name, token=None)))
            for name in ("clock-a", "clock-b")
        }


def _jumpy_clock(real: Callable[[], float]) -> Callable[[], float]:
    offsets = itertools.cycle(JUMPS)
    calls = {"n": 0}

    def jumpy() -> float:
        calls["n"] += 1
        return real() + next(offsets)

    jumpy.calls = calls  # type: ignore[attr-defined]
    return jumpy


async def test_a_jumping_wall_clock_changes_nothing(
    agents: dict[str, ThreadAgent], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert TOKEN  # the agents here run without a token: the clock is the only hostile input
    store = open_store(f"sqlite:///{tmp_path / 'clock.db'}", migrate_schema=True)
    clock = _jumpy_clock(time.time)
    monkeypatch.setattr(time, "time", clock)
    config = SimConfig(
        agent_urls={name: agent.url for name, agent in agents.items()},
        groups=30,
        siblings=4,
        mode="prompt_group",
        faults="drop_reply=0.15",
        # A checkpoint inside the run by a gate (HeldUntilPrepared), not by the run outlasting a timer.
        checkpoint_every_s=0.1,
        prepare_timeout_s=10.0,
        rollout_timeout_s=30.0,
        turns=(1, 1),
        agent_delay_s=0.0,
        run_id="clock",
    )
    try:
        HeldUntilPrepared.prepared = asyncio.Event()
        summary = await run_simulation(store, config, client_factory=HeldUntilPrepared)
    finally:
        monkeypatch.undo()
        store.close()
    assert clock.calls["n"] > 100  # type: ignore[attr-defined]
    assert summary["groups_sealed"] == 30
    assert summary["adopted"] > 0  # dropped replies were adopted, not rerun
    assert summary["retired"] == 0 and summary["replacements"] == 0  # no lease fired
    assert summary["checkpoints_committed"] > 0
    assert summary["stranded"] == 0 and summary["duplicate_executions"] == 0
    assert summary["debts_outstanding"] == 0
    assert summary["audit_violations"] == 0


async def test_an_agent_whose_clock_ran_a_day_ahead_restarted_with_its_state_lost_lets_its_debts_go(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first process starts with the wall clock a day ahead and finishes a try; it dies before the
    ACK, and its replacement starts on an empty state directory with the clock right.  The new
    process denies the result (`unknown_execution`) and, being another incarnation, that is the
    evidence the debt drops on: nothing is owed for ever and no checkpoint waits on it (with
    generations ordered by a clock-started counter, the new process looked older and the debt stayed)."""
    from projections.ledger import debt_dropped_by
    from protocol.wire import RunRequest
    from trainer.core.debt import AgentSeen, on_ack

    real_ns, real_s = time.time_ns, time.time
    monkeypatch.setattr(time, "time_ns", lambda: real_ns() + 86_400 * 10**9)
    monkeypatch.setattr(time, "time", lambda: real_s() + 86_400)
    with serve_in_thread(agent_config(tmp_path / "lost", "clock-c", token=None)) as ahead:
        monkeypatch.undo()
        async with GymClient(ahead.url, "clock-c") as client:
            await client.run(RunRequest(rollout_id="ahead_g0", attempt_index=0))
            receipt = await client.completion_receipt("ahead_g0", 0)
    with serve_in_thread(agent_config(tmp_path / "fresh", "clock-c", token=None)) as behind:
        async with GymClient(behind.url, "clock-c") as client:
            [answer] = await client.acknowledge([receipt])
            status = await client.status()
    assert (answer.acknowledged, answer.error) == (False, "unknown_execution")
    assert status.execution_incarnation != receipt.execution_incarnation
    step = on_ack(receipt, answer, AgentSeen(status.execution_incarnation, status.execution_generation))
    (rejected,) = step.events
    assert step.verdict == "dropped" and debt_dropped_by(rejected, receipt)  # type: ignore[arg-type]
