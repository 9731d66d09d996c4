"""SIGTERM (what `timeout` and schedulers send) in the middle of a soak on its own throwaway cluster:
the run winds down, one line says so, the exit status is 143, and the cluster is stopped and removed
(the process used to die at once and leave its PostgreSQL running).  A real subprocess; the signal
goes once the first progress line shows the run under way."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

LINE = "interrupted: the soak stopped before its figures; its throwaway database is removed"


@pytest.fixture
def tmpdir_for_postgres() -> Iterator[Path]:
    """A TMPDIR the `postgres` user can reach (pytest's own tmp_path sits under a root-only 0700 dir)."""
    path = Path(tempfile.mkdtemp(prefix="soak-interrupted-"))
    path.chmod(0o755)
    yield path
    for data in path.glob("ledger-pg-*/data"):  # a cluster the soak left (the failure): stopped here
        if (data / "postmaster.pid").exists():
            stop = ["runuser", "-u", "postgres", "--", "pg_ctl", "-D", str(data), "stop", "-m", "immediate"]
            subprocess.run(stop, capture_output=True, timeout=60, check=False)
    shutil.rmtree(path, ignore_errors=True)


def test_sigterm_mid_soak_stops_it_in_one_line_and_removes_its_cluster(tmpdir_for_postgres: Path) -> None:
    tmp_path = tmpdir_for_postgres
    argv = [sys.executable, "-m", "benchmarks.soak", "--groups", "5000", "--siblings", "2"]
    argv += ["--agents", "1", "--faults", "", "--checkpoint-every", "0.5"]
    env = {**os.environ, "TMPDIR": str(tmp_path)}  # where the throwaway cluster's directory goes
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        seen = []
        for raw in proc.stderr:  # the gate: the run has begun (its agents are up, the log open)
            seen.append(raw)
            if " groups " in raw:
                break
        else:
            raise AssertionError(f"the soak ended before it started: {''.join(seen)}")
        assert any(tmp_path.glob("ledger-pg-*")), "the soak's cluster is not under TMPDIR"
        proc.send_signal(signal.SIGTERM)
        _, rest = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    lines = [line for line in rest.splitlines() if line.strip() and " groups " not in line]
    assert proc.returncode == 128 + signal.SIGTERM, rest
    assert lines == [LINE], rest  # one line, no traceback
    assert not list(tmp_path.glob("ledger-pg-*")), "the throwaway cluster was left behind"
