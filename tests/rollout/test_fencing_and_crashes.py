"""(f) an agent crash, (g) a trainer SIGKILLed and recovered, (h) two coordinators on one PostgreSQL log."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest

from eventstore import EventStore, open_store, upgrade_database
from eventstore.events import TrainerEpochTaken
from gym_agent.launcher import AgentProcess
from projections.audit import audit_log
from protocol.streams import trainer_stream
from protocol.wire import AttemptFault, CrashAfter, FaultRates, RateFaults
from tests.rollout.conftest import PAYLOAD, PROMPT, MakeAgent, coordinator, gid
from tests.rollout.hostile_agent import Rule, serve_hostile
from tests.rollout.test_bad_input import _config
from trainer import CoordinatorStopped, FencedOff, PreparedCheckpoint, RolloutCoordinator
from trainer.gym import GymClient


async def test_a_stale_coordinator_is_fenced_off(pg_url: str, make_agent: MakeAgent) -> None:
    """(h) B recovers the same log while A still runs: both act on the same group, and the one whose
    append comes second is fenced off and stops (usually A; A wins when its own next append, e.g.
    the failure of a run B just retired, reaches the log first).  Never both: the survivor finishes
    the group, nothing strands, and the log audits clean."""
    upgrade_database(pg_url)
    store_a, store_b = open_store(pg_url), open_store(pg_url)
    agent = make_agent("a", delay_s=0.2)
    try:
        async with GymClient(agent.url, "a") as ca, GymClient(agent.url, "a") as cb:
            a = coordinator(store_a, {"a": ca}, mode="sibling")
            await a.start()
            g = gid()
            # A try that hangs keeps the group in flight at A when B recovers, however the threads run.
            await ca.set_faults(AttemptFault(rollout_id=f"{g}_g0", attempt_index=0, hang=True))
            await a.submit(g, PROMPT, "a", 2, PAYLOAD)
            b = await RolloutCoordinator.recover(store_b, {"a": cb}, mode="sibling", rollout_timeout_s=10)
            outcomes = await asyncio.gather(a.wait_idle(30), b.wait_idle(30), return_exceptions=True)
            fenced = [c for c, o in zip((a, b), outcomes, strict=True) if isinstance(o, FencedOff)]
            assert len(fenced) == 1, outcomes
            survivor = b if fenced[0] is a else a
            assert outcomes[(a, b).index(survivor)] is None
            with pytest.raises(FencedOff):
                await fenced[0].claim_for_training(g, 0)
            await survivor.catch_up()
            assert g not in survivor.open_groups()
            assert (await cb.status()).completed_unacknowledged == 0
            await a.close()
            await b.close()
        report = audit_log(store_b)
        assert report.ok, report.as_json()["violations"]
    finally:
        store_a.close()
        store_b.close()


async def test_an_agent_crash_reruns_the_lost_siblings_under_new_tries(
    sqlite_url: str, tmp_path: Path
) -> None:
    """(f) the agent dies after one completion: ACKs of lost results answer unknown_execution; new tries run."""
    store = open_store(sqlite_url, migrate_schema=True)
    with AgentProcess("crashy", turns=(2, 3), delay_s=0.05, state_dir=tmp_path / "agent") as proc:
        async with GymClient(proc.url, "crashy") as client:
            await client.set_faults(CrashAfter(crash_after=2))
            coord = coordinator(store, {"crashy": client}, mode="sibling", rollout_timeout_s=10)
            await coord.start()
            g = gid()
            await coord.submit(g, PROMPT, "crashy", 4, PAYLOAD)

            async def restart() -> None:
                while proc.is_running():
                    await asyncio.sleep(0.05)
                await asyncio.to_thread(proc.start)

            await asyncio.wait_for(restart(), 30)
            await coord.wait_idle(60)
            await coord.close()
            assert (await client.status()).completed_unacknowledged == 0
    types = [e.type for e in store.read_stream(f"group-{g}")]
    assert "GroupSealed" in types and "ReplacementMinted" in types
    store.close()


TRAINER = textwrap.dedent(
    """
    import asyncio, os, sys
    from eventstore import open_store
    from eventstore.events import PromptRef
    from simulation.run import CheckpointLoop
    from trainer.gym import GymClient
    from trainer import RolloutCoordinator

    async def main(url, agent_url, run, mode, stop_file):
        store = open_store(url, migrate_schema=True)
        client = GymClient(agent_url, "a")
        if run == "0":
            coord = RolloutCoordinator(store, {"a": client}, mode=mode, rollout_timeout_s=5)
            await coord.start()
        else:
            coord = await RolloutCoordinator.recover(store, {"a": client}, mode=mode, rollout_timeout_s=5)

        checkpointing = CheckpointLoop(coord, 0.2, lambda k: f"ck-{run}-{k}", [])
        # Feeds groups k0, k1, ... (two open at a time) until the stop file exists, so a kill always
        # lands mid-work; a recovered run skips the groups the log already knows.
        i = 0
        while not os.path.exists(stop_file):
            if coord.ledger.knows_group(f"k{i}"):
                i += 1
            elif len(coord.open_groups()) < 2:
                await coord.submit(f"k{i}", PromptRef(sample_id="s", task_name="t"), "a", 3, {})
                i += 1
            else:
                await asyncio.sleep(0.02)
        while coord.open_groups():
            await asyncio.sleep(0.05)
        await checkpointing.finish()
        await coord.wait_idle(60)
        await coord.close()
        await client.aclose()
        store.close()
        print("DONE", flush=True)

    asyncio.run(main(*sys.argv[1:6]))
    """
)


def _count(url: str, *event_types: str) -> int:
    store = open_store(url)
    try:
        return sum(1 for _ in store.read_all(0, types=list(event_types)))
    finally:
        store.close()


def _mid_work(url: str, sealed_before: int) -> bool:
    """The run sealed siblings of its own, and a group is open (reserved, not yet ended)."""
    ended = _count(url, "GroupSealed", "GroupDeadLettered")
    return _count(url, "SiblingSealed") >= sealed_before + 2 and _count(url, "GroupReserved") > ended


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sibling", "prompt_group"])
async def test_a_trainer_killed_at_random_points_recovers(
    sqlite_url: str, make_agent: MakeAgent, tmp_path: Path, mode: str
) -> None:
    """(g) SIGKILL the trainer process mid-work, twice, then recover: all groups end, nothing strands.

    Each kill waits for a gate, not a time: the run has sealed siblings of its own and holds an open
    group; it feeds groups until the stop file exists, so it never runs out of work first."""
    agent = make_agent("a", delay_s=0.03)
    script = tmp_path / "trainer_process.py"
    script.write_text(TRAINER)
    stop_file = tmp_path / "stop"
    upgrade_database(sqlite_url)
    async with GymClient(agent.url, "a") as client:
        await client.set_faults(RateFaults(rates=FaultRates(drop_reply=0.1, fail=0.1), seed=5))
        env = dict(os.environ)
        for run, kill in enumerate([True, True, False]):
            if not kill:
                stop_file.touch()
            sealed_before = await asyncio.to_thread(_count, sqlite_url, "SiblingSealed")
            proc = subprocess.Popen(
                [sys.executable, str(script), sqlite_url, agent.url, str(run), mode, str(stop_file)],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=Path(__file__).parents[2],
            )  # fmt: skip
            if kill:
                async with asyncio.timeout(120):
                    while not await asyncio.to_thread(_mid_work, sqlite_url, sealed_before):
                        assert proc.poll() is None, proc.communicate()[0].decode()[-3000:]
                        await asyncio.sleep(0.05)
                proc.send_signal(signal.SIGKILL)
                proc.wait(10)
            else:
                out, _ = await asyncio.to_thread(proc.communicate, timeout=120)
                assert b"DONE" in out, out.decode()[-3000:]
        assert await asyncio.to_thread(_count, sqlite_url, "TrainerRestored") == 2
        assert await asyncio.to_thread(_count, sqlite_url, "GroupTakenOver") >= 1
        status = await client.status()
        assert status.completed_unacknowledged == 0 and status.phase == "idle"
        assert all(v == 1 for v in (await client.debug_runs()).values())
    store = open_store(sqlite_url)
    coord = RolloutCoordinator(store, {})
    await coord.start()
    assert not coord.open_groups()
    assert not coord.ledger.unpaid_debts()
    from projections.audit import audit_log

    report = audit_log(store)
    assert report.ok, report.as_json()
    await coord.close()
    store.close()


async def test_a_coordinator_fenced_off_while_it_resumes_a_commit_says_so_once(
    sqlite_store: EventStore, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A newer coordinator takes the trainer over while this one's commit is being resumed at the
    agent (gated: the agent's commit answer is held until the takeover is in the log).  This one
    stops with `FencedOff`, and says nothing more: before, it also logged an ERROR that the commit's
    participants had not resumed, a second line beside its stop (seen in a busy CI run of
    `ledger simulate`); resuming them is the newer coordinator's."""
    entered, release = threading.Event(), threading.Event()

    def hold(answer: Any) -> Any:
        entered.set()
        assert release.wait(30), "the test never released the commit's answer"
        return answer

    held = Rule("/checkpoint/commit", lambda _path, _body: True, hold, times=1)
    with serve_hostile(_config(tmp_path), [held]) as agent:
        async with GymClient(agent.url, "h") as client:
            coord = coordinator(sqlite_store, {"h": client}, mode="sibling")
            await coord.submit(gid(), PROMPT, "h", 1, PAYLOAD)
            await coord.wait_idle(30)
            prepared = await coord.prepare_checkpoint("c1")
            assert isinstance(prepared, PreparedCheckpoint)
            commit = asyncio.create_task(coord.commit_checkpoint("c1"))
            assert await asyncio.to_thread(entered.wait, 30)
            trainer = coord.settings.trainer_id
            sqlite_store.append(
                trainer_stream(trainer),
                [TrainerEpochTaken(trainer_id=trainer, reason="recovery", writer="newer")],
            )
            release.set()
            with pytest.raises(FencedOff):
                await commit
            async with asyncio.timeout(30):  # a bound: the gate is the resume's own task finishing
                while coord._finisher._completions:
                    await asyncio.sleep(0.02)
            with contextlib.suppress(FencedOff, CoordinatorStopped):
                await coord.close()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR and "resumed" in r.getMessage()]
