"""A trainer SIGKILLed right after committing a checkpoint that carried debts (finished, unACKed tries:
CheckpointCommitted.carried), and a new trainer recovering from the log: every carried debt is paid
exactly once (adopted, not run again), every group seals, nothing strands, the log audits clean."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from eventstore import open_store, upgrade_database
from projections.audit import audit_log
from protocol.ids import capture_key
from protocol.wire import AttemptFault
from tests.rollout.conftest import MakeAgent
from trainer import RolloutCoordinator
from trainer.gym import GymClient

# Group k0 (three siblings) and k1 (two): the replies of these tries are dropped, so each finishes at
# the agent unACKed, and the trainer holds their tasks back (their locks) until it is killed: the
# checkpoint meets them finished and carries them.
GROUPS = {"k0": 3, "k1": 2}
CARRIED = ["k0_g0", "k0_g1", "k1_g1"]

TRAINER = textwrap.dedent(
    """
    import asyncio, sys
    from contextlib import AsyncExitStack
    from eventstore import open_store
    from eventstore.events import PromptRef
    from trainer import RolloutCoordinator
    from trainer.gym import GymClient

    async def main(url, agent_url, run, carried, groups, hold_resume):
        store = open_store(url)
        client = GymClient(agent_url, "a")
        if run == "recover":
            coord = await RolloutCoordinator.recover(store, {"a": client}, mode="sibling", rollout_timeout_s=30)
            await coord.wait_idle(120)
            await coord.close()
            await client.aclose()
            store.close()
            print("DONE", flush=True)
            return
        if hold_resume == "1":
            async def never(*args, **kwargs):  # the agents stay committed, not resumed, until the kill
                await asyncio.Event().wait()
            client.resume = never
        coord = RolloutCoordinator(store, {"a": client}, mode="sibling", rollout_timeout_s=30)
        await coord.start()
        carried = carried.split(",")
        async with AsyncExitStack() as held:
            for rid in carried:
                await held.enter_async_context(coord._attempts.live(rid, 0).lock)
            for spec in groups.split(","):
                gid, n = spec.split(":")
                await coord.submit(gid, PromptRef(sample_id="s", task_name="t"), "a", int(n), {})
            # Nothing runs at the agent and only the held tries are unACKed: the prepare meets them
            # finished (carried), and has nothing to wait for or retire.
            async with asyncio.timeout(60):
                while True:
                    status = await client.status()
                    if status.running == 0 and status.completed_unacknowledged == len(carried):
                        break
                    await asyncio.sleep(0.02)
            checkpoint = asyncio.create_task(coord.checkpoint("ck-carry"))
            print("CHECKPOINTING", flush=True)
            await asyncio.Event().wait()  # SIGKILLed here, the carried tries still held
            await checkpoint

    asyncio.run(main(*sys.argv[1:7]))
    """
)


def _events(url: str, *types: str) -> list[dict[str, object]]:
    store = open_store(url)
    try:
        return [dict(e.data, type=e.type) for e in store.read_all(0, types=list(types))]
    finally:
        store.close()


def _start(script: Path, url: str, agent_url: str, run: str, hold_resume: bool) -> subprocess.Popen[bytes]:
    groups = ",".join(f"{g}:{n}" for g, n in GROUPS.items())
    args = [url, agent_url, run, ",".join(CARRIED), groups, str(int(hold_resume))]
    return subprocess.Popen(
        [sys.executable, str(script), *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=Path(__file__).parents[2],
    )  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("hold_resume", [True, False], ids=["killed-before-resume", "killed-after-resume"])
async def test_carried_debts_are_paid_once_by_the_trainer_recovering_after_a_kill(
    sqlite_url: str, make_agent: MakeAgent, tmp_path: Path, hold_resume: bool
) -> None:
    """The kill's gate is the log: the commit naming the carried tries is in it (and, killed after the
    resume, the agent's `CheckpointResumed` too), while the agent still holds those tries unACKed.
    The recovered trainer finishes the commit if it must, adopts each carried try once and ACKs it."""
    agent = make_agent("a", delay_s=0.02)
    script = tmp_path / "trainer_process.py"
    script.write_text(TRAINER)
    upgrade_database(sqlite_url)
    gate = "CheckpointCommitted" if hold_resume else "CheckpointResumed"
    async with GymClient(agent.url, "a") as client:
        for rid in CARRIED:
            await client.set_faults(AttemptFault(rollout_id=rid, attempt_index=0, drop_reply=True))
        proc = _start(script, sqlite_url, agent.url, "first", hold_resume)
        try:
            async with asyncio.timeout(120):
                # Killed before the resume: the commit is in the log and has reached the agent (the
                # trainer appends it, then tells the agent: the gate is both, not whichever is first).
                while not await asyncio.to_thread(_events, sqlite_url, gate) or (
                    hold_resume and (await client.status()).phase != "committed_paused"
                ):
                    assert proc.poll() is None, proc.communicate()[0].decode()[-3000:]
                    await asyncio.sleep(0.05)
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
        [committed] = await asyncio.to_thread(_events, sqlite_url, "CheckpointCommitted")
        assert committed["carried"] == {"a": [{"rollout_id": r, "attempt_index": 0} for r in CARRIED]}
        # Killed with every carried debt unpaid: the agent holds them, the log has no adoption.
        status = await client.status()
        assert status.completed_unacknowledged == len(CARRIED)
        assert status.phase == ("committed_paused" if hold_resume else "idle")
        assert not await asyncio.to_thread(_events, sqlite_url, "AttemptAdopted")

        proc = _start(script, sqlite_url, agent.url, "recover", hold_resume)
        out, _ = await asyncio.to_thread(proc.communicate, timeout=120)
        assert b"DONE" in out, out.decode()[-3000:]

        status = await client.status()
        assert (status.completed_unacknowledged, status.phase) == (0, "idle")
        # Each try ran once: the carried ones were adopted, not run again under a new try.
        runs = await client.debug_runs()
        every = [f"{g}_g{i}" for g, n in GROUPS.items() for i in range(n)]
        assert runs == {capture_key(rid, 0): 1 for rid in every}
    adopted = await asyncio.to_thread(_events, sqlite_url, "AttemptAdopted")
    assert sorted(str(e["rollout_id"]) for e in adopted) == sorted(CARRIED)
    assert not await asyncio.to_thread(_events, sqlite_url, "ReplacementMinted", "GroupDeadLettered")
    acked = await asyncio.to_thread(_events, sqlite_url, "AckAccepted")
    assert sorted(str(e["rollout_id"]) for e in acked) == sorted(every)
    sealed = await asyncio.to_thread(_events, sqlite_url, "GroupSealed")
    assert sorted(str(e["group_id"]) for e in sealed) == sorted(GROUPS)
    assert len(await asyncio.to_thread(_events, sqlite_url, "TrainerRestored")) == 1

    store = open_store(sqlite_url)
    try:
        coord = RolloutCoordinator(store, {})
        await coord.start()
        assert not coord.open_groups()
        assert not coord.ledger.unpaid_debts()
        await coord.close()
        report = audit_log(store)
        assert report.ok, report.as_json()
    finally:
        store.close()
