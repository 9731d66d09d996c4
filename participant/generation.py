"""`execution_generation`: a per-agent counter that rises on every start of the agent process.

Chosen over wall-clock milliseconds because it cannot go backwards when the clock is stepped, and it
stays small and readable (`3`).  The counter lives in `<state dir>/generation`; an
exclusive `flock` serialises two processes started at once with the same state dir, and the new value
is written to a temporary file and renamed, so a crash mid-write leaves the old value intact.  Only this
number survives a restart: stored replies never touch the disk.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

GENERATION_FILE = "generation"


def next_generation(state_dir: Path) -> int:
    """Reads, increments and durably stores the counter; returns the new generation (1 on first start)."""
    state_dir.mkdir(parents=True, exist_ok=True)
    path = state_dir / GENERATION_FILE
    with open(state_dir / (GENERATION_FILE + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            text = path.read_text().strip() if path.exists() else ""
            try:
                previous = int(text) if text else 0
            except ValueError:
                raise RuntimeError(f"corrupt generation file {path}: {text[:40]!r}") from None
            current = previous + 1
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
