"""`ledger simulate --agent-url` on an agent another trainer drives: one line and exit status 2, not a
traceback, with nothing of the run written.  A real subprocess of the CLI against a real agent on
loopback, bound to another trainer through the agent's own route (`POST /driver`)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

from eventstore import open_store
from gym_agent.config import AgentConfig
from gym_agent.server import serve_in_thread
from trainer.gym import GymClient

# Far above what the refusal takes; reached only if the run waits instead of refusing.
RUN_BOUND_S = 120.0


async def _bind(url: str, trainer_id: str) -> None:
    async with GymClient(url, "ag") as client:
        bound = await client.bind_driver(trainer_id)
        assert bound is not None and bound.trainer_id == trainer_id


def test_an_agent_another_trainer_drives_is_refused_in_one_line(tmp_path: Path) -> None:
    config = AgentConfig(name="ag", state_dir=tmp_path / "ag", log_level="warning", turns=(1, 1))
    db = f"sqlite:///{tmp_path / 'ledger.db'}"
    with serve_in_thread(config) as agent:
        asyncio.run(_bind(agent.url, "another-trainer"))
        env = {k: v for k, v in os.environ.items() if k != "LEDGER_DB"}
        argv = [sys.executable, "-m", "cli.main", "simulate", "--db", db, "--agent-url", f"ag={agent.url}"]
        done = subprocess.run(
            [*argv, "--groups", "2", "--checkpoint-every", "0", "--faults", ""],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=RUN_BOUND_S,
            check=False,
        )
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and len(lines) == 1, (done.returncode, done.stderr[-3000:])
    assert lines[0].startswith("error: run s") and agent.url in lines[0], lines
    assert "driven by trainer 'another-trainer'" in lines[0], lines
    store = open_store(db)
    try:
        assert [e.type for e in store.read_all(0)] == []  # refused before its epoch: nothing written
    finally:
        store.close()
