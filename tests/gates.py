"""Gates shared by tests that must see something happen inside a run, instead of hoping the run lasts
long enough for it (a run can end before its first checkpoint timer fires on a fast machine)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from typing import Any, ClassVar

from trainer.gym import GymClient


class HeldUntilPrepared(GymClient):
    """No `/run` leaves the trainer until a `/checkpoint/prepare` has (or `HOLD_S` passed), so the run
    cannot end before its first checkpoint started, and nothing is running at the agents when it
    prepares.  Set `prepared` (on the class the run uses) to a new event in the test's loop first;
    mix it in before another client class to keep that class's behaviour."""

    HOLD_S: ClassVar[float] = 60.0
    prepared: ClassVar[asyncio.Event | None] = None

    async def _send(self, pool: Any, method: str, path: str, **kwargs: Any) -> Any:
        gate = type(self).prepared
        assert gate is not None, f"set {type(self).__name__}.prepared in the test's loop first"
        if path == "/run":
            async with asyncio.timeout(self.HOLD_S):
                await gate.wait()
        try:
            return await super()._send(pool, method, path, **kwargs)
        finally:
            if path == "/checkpoint/prepare":
                gate.set()


def killed_at(script: str, arg: str, kill_at: str) -> list[str]:
    """Runs `python -c script arg`, a writer that prints each step it reaches and waits for a `go` line
    before the next; SIGKILLs it on reaching `kill_at`.  The steps it printed, in order (the gate makes
    where it dies exact, not a matter of timing)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", script, arg], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env={**os.environ}
    )
    assert proc.stdin is not None and proc.stdout is not None
    seen: list[str] = []
    try:
        while True:
            line = proc.stdout.readline().decode().strip()
            assert line, f"the writer ended before {kill_at!r} (steps seen: {seen})"
            seen.append(line)
            if line == kill_at:
                break
            proc.stdin.write(b"go\n")
            proc.stdin.flush()
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    return seen
