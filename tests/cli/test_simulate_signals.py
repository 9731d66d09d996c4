"""`ledger simulate` as its own process, stopped the ways a shell, `timeout`, Slurm or Kubernetes stop it.

SIGTERM is Ctrl-C: the run winds down (its checkpoint in flight decided, its agent stopped), says in one
line what it left, and exits 143 (128 + SIGTERM).  SIGKILL leaves no wind-down, yet the agent it started
stops by itself: its stdin is a pipe only the parent held, and its end of file is the agent's cue.
Each signal is sent at a gate (the run has sealed a sibling of its own and its agent is up), and the
run is far too long to end first.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from eventstore import open_store, upgrade_database
from eventstore.events import TrainerEpochTaken
from projections.runner import rebuild
from protocol.streams import trainer_stream

REPO = Path(__file__).parents[2]
# Far more groups than the run gets through before its signal: it is always mid-work when stopped.
GROUPS = 2000
# Bounds on waits that end as soon as what they wait for happens; reached only if it never does.
GATE_S = 120.0
EXIT_S = 90.0


def _children(pid: int) -> set[int]:
    found: set[int] = set()
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found |= {int(c) for c in (task / "children").read_text().split()}
        except OSError:
            continue
    return found


def _agent_pids(pid: int) -> set[int]:
    """The simulate process's children that are reference agents (`python -m gym_agent serve`)."""
    agents = set()
    for child in _children(pid):
        try:
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"gym_agent" in cmdline and b"serve" in cmdline:
            agents.add(child)
    return agents


def _alive(pid: int) -> bool:
    """Running (a zombie no one has reaped yet has ended)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _count(url: str, event_type: str) -> int:
    store = open_store(url, read_only=True)
    try:
        return sum(1 for _ in store.read_all(0, types=[event_type]))
    finally:
        store.close()


class Run:
    def __init__(self, tmp_path: Path) -> None:
        self.db = tmp_path / "ledger.db"
        self.url = f"sqlite:///{self.db}"
        self.err_path = tmp_path / "simulate.err"
        upgrade_database(self.url)  # the gate reads the log from the first poll on
        env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "cache"), PYTHONUNBUFFERED="1", COLUMNS="200")
        with open(self.err_path, "wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "cli.main", "simulate", "--db", self.url, "--agents", "1",
                 "--groups", str(GROUPS), "--siblings", "2", "--faults", "", "--checkpoint-every", "0.2"],
                stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL, env=env, cwd=REPO,
            )  # fmt: skip
        self.agents: set[int] = set()

    def wait_mid_work(self) -> None:
        """The gate: a sibling of the run sealed (so its agent answers) and a checkpoint decided."""
        deadline = time.monotonic() + GATE_S
        while not (
            _count(self.url, "SiblingSealed") >= 1
            and _count(self.url, "CheckpointCommitted") + _count(self.url, "CheckpointAborted") >= 1
            and _agent_pids(self.proc.pid)
        ):
            assert self.proc.poll() is None, self.stderr()
            assert time.monotonic() < deadline, (
                f"no sibling sealed and checkpoint decided in {GATE_S} s: {self.stderr()}"
            )
            time.sleep(0.1)
        self.agents = _agent_pids(self.proc.pid)

    def stderr(self) -> str:
        return self.err_path.read_text(errors="replace")

    def close(self) -> None:
        for pid in [self.proc.pid, *self.agents]:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait(EXIT_S)


@pytest.fixture
def run(tmp_path: Path) -> Iterator[Run]:
    r = Run(tmp_path)
    try:
        yield r
    finally:
        r.close()


@pytest.mark.slow
def test_sigterm_winds_the_run_down_in_one_line_and_takes_its_agent(run: Run) -> None:
    run.wait_mid_work()
    run.proc.send_signal(signal.SIGTERM)
    out, _ = run.proc.communicate(timeout=EXIT_S)
    err = run.stderr()
    assert run.proc.returncode == 128 + signal.SIGTERM, err
    # One line says what was left and how to carry on; no traceback, no flood of asyncio noise.
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("groups ")]
    assert len(lines) == 1, err
    assert lines[0].startswith("interrupted: run s") and "ledger simulate --resume s" in lines[0], err
    assert "Traceback" not in err and "Task exception" not in err
    assert out == b""  # no summary: the run did not end
    # stderr is a file, not a terminal: progress comes as lines.
    assert re.search(r"^groups \d+/\d+ decided \(\d+ s\)$", err, re.M), err
    assert run.agents and not any(_alive(pid) for pid in run.agents), run.agents
    # Nothing of the run's is left undecided: no checkpoint in doubt, none committed and not resumed.
    store = open_store(run.url, read_only=True)
    try:
        checkpoints = rebuild(store).state("checkpoints")
    finally:
        store.close()
    assert checkpoints.checkpoints, "the gate saw checkpoints run"
    assert not checkpoints.in_doubt() and not checkpoints.to_resume()
    assert all(c.status in ("resumed", "aborted") for c in checkpoints.checkpoints.values())


@pytest.mark.slow
def test_an_agent_outlives_a_killed_run_only_briefly(run: Run) -> None:
    run.wait_mid_work()
    run.proc.send_signal(signal.SIGKILL)
    run.proc.wait(EXIT_S)
    # The agent reads end of file on its stdin and stops itself (SIGTERM to itself, then for good
    # after its grace): no agent outlives the run that started it.
    deadline = time.monotonic() + EXIT_S
    while any(_alive(pid) for pid in run.agents):
        assert time.monotonic() < deadline, f"agents {run.agents} still running {EXIT_S} s after the run died"
        time.sleep(0.1)
    assert run.agents


@pytest.mark.slow
def test_a_run_fenced_off_by_a_newer_coordinator_stops_in_one_line(run: Run) -> None:
    """Another coordinator takes the run's trainer over (a `--resume` started while this run still
    ran): this one's next append is fenced off, and it says so in one line, exit 2, no traceback."""
    run.wait_mid_work()
    store = open_store(run.url)
    try:
        [epoch] = store.read_all(0, types=["TrainerEpochTaken"])
        run_id = epoch.data["trainer_id"]
        # What a newer coordinator's start appends: its owner epoch on the trainer's stream.
        store.append(
            trainer_stream(run_id), [TrainerEpochTaken(trainer_id=run_id, reason="recovery", writer="newer")]
        )
    finally:
        store.close()
    out, _ = run.proc.communicate(timeout=EXIT_S)
    err = run.stderr()
    assert run.proc.returncode == 2, err
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("groups ")]
    assert len(lines) == 1, err
    assert lines[0].startswith(f"error: run {run_id} stopped: another coordinator took over"), err
    assert f"ledger simulate --resume {run_id}" in lines[0], err
    assert "Traceback" not in err and "Task exception" not in err
    assert out == b""
