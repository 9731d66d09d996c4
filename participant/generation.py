"""`execution_generation`: a per-agent counter that rises on every start of the agent process.

A counter, not the wall clock, because a counter cannot go backwards when the clock is stepped.  But a
counter kept in the state directory would start again at 1 if the directory were lost, repeating a
generation an earlier process already served under: the trainer would then read the new process's
denial of the old results (`unknown_execution` from the same generation) as a lie, not as the restart
it is, and keep their debts owed for ever.  So a fresh state directory starts the counter at the wall
clock's microseconds, above any generation an earlier process with this name can have reached (it
started earlier and counts one per start), and every later start adds one.  The counter lives in
`<state dir>/generation`; an
exclusive `flock` serialises two processes started at once with the same state dir, and the new value
is written to a temporary file and renamed, so a crash mid-write leaves the old value intact.  Only this
number survives a restart: stored replies never touch the disk.
"""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path

GENERATION_FILE = "generation"


def fresh_generation() -> int:
    """The first generation of a state directory: the wall clock in microseconds (at least 1)."""
    return max(1, time.time_ns() // 1000)


def next_generation(state_dir: Path) -> int:
    """Reads, increments and durably stores the counter; returns the new generation (`fresh_generation()`
    on a state directory's first start)."""
    state_dir.mkdir(parents=True, exist_ok=True)
    path = state_dir / GENERATION_FILE
    with open(state_dir / (GENERATION_FILE + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            text = path.read_text().strip() if path.exists() else ""
            try:
                previous = int(text) if text else None
            except ValueError:
                raise RuntimeError(f"corrupt generation file {path}: {text[:40]!r}") from None
            current = previous + 1 if previous is not None else fresh_generation()
            tmp = path.with_suffix(".tmp")
            with open(tmp, "w") as f:
                f.write(f"{current}\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            return current
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def read_generation(state_dir: Path) -> int | None:
    """The newest generation started with `state_dir` (None before the first start), without taking one."""
    try:
        return int((state_dir / GENERATION_FILE).read_text().strip())
    except (FileNotFoundError, ValueError):
        return None
