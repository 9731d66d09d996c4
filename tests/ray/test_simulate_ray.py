"""`ledger simulate --ray`: the README's job with the coordinator in a Ray actor, killed once mid-run.

The command runs as a user runs it: the `ledger` script, in the environment a user's shell has (no
loopback setting for Ray: on a machine with an outward interface the command itself must keep Ray on
loopback; it once imported Ray to check the extra first and died with `RayNotLoopback`).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.userenv import ledger_command, user_env

pytestmark = pytest.mark.slow


# 6: mid-run; 23: after the last group's claim, with its items still on their way (a retry must
# replay the claimed groups, not run the rows again: it once sealed 14 groups for 8).
@pytest.mark.parametrize("kill_after", [6, 23])
def test_simulate_through_the_ray_actor_loses_nothing_when_it_is_killed(
    tmp_path: Path, kill_after: int
) -> None:
    db = f"sqlite:///{tmp_path / 'sim.db'}"
    done = subprocess.run(
        [
            ledger_command(),
            "simulate",
            "--db",
            db,
            "--groups",
            "8",
            "--siblings",
            "3",
            "--ray",
            "--ray-kill-after",
            str(kill_after),
            "--json",
        ],
        capture_output=True,
        text=True,
        env=user_env(),
        cwd=tmp_path,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads(done.stdout)
    assert summary["ray"] is True and summary["actor_kills"] == 1
    assert summary["groups_sealed"] == 8 and summary["groups_claimed"] == 8
    assert summary["rows_delivered"] == summary["rows"] == 24 and summary["rows_delivered_twice"] == 0
    assert summary["stranded"] == 0 and summary["duplicate_executions"] == 0
    assert summary["audit_violations"] == 0 and summary["debts_outstanding"] == 0
