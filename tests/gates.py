"""Gates shared by tests that must see something happen inside a run, instead of hoping the run lasts
long enough for it (a run can end before its first checkpoint timer fires on a fast machine)."""

from __future__ import annotations

import asyncio
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
