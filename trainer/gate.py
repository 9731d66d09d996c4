"""The checkpoint gate and an attempt's lease: the little state the coordinator's parts share.

While a checkpoint of this coordinator is prepared and undecided no claim is accepted, no owed retire
is called and no attempt's deadline runs; `closing` says the coordinator is shutting down.  Only the
checkpoint's phases open and close the gate; everyone else reads it.
"""

from __future__ import annotations

import asyncio
import time

from trainer.eventloop import wait_at_most


class Gate:
    def __init__(self) -> None:
        # The checkpoint prepared here and not yet decided, if any.
        self.checkpoint: str | None = None
        self._idle = asyncio.Event()
        self._idle.set()
        self.closing = False

    @property
    def in_flight(self) -> bool:
        return self.checkpoint is not None

    def hold(self, checkpoint_id: str) -> None:
        """Raised before the checkpoint's `CheckpointPrepareStarted` is queued."""
        self.checkpoint = checkpoint_id
        self._idle.clear()

    def release(self) -> None:
        """Lowered once the checkpoint is decided (or its prepare failed)."""
        self.checkpoint = None
        self._idle.set()

    async def wait_decided(self, timeout_s: float) -> bool:
        """Waits (at most `timeout_s`) until no checkpoint is prepared and undecided; True when none is."""
        await wait_at_most(self._idle.wait(), timeout_s)
        return self.checkpoint is None


class Lease:
    """An attempt's deadline: a clock that does not run while a checkpoint is in flight (docs/protocol.md,
    Deadlines and fencing)."""

    def __init__(self, gate: Gate, budget_s: float) -> None:
        self.gate = gate
        self.remaining = budget_s
        self._last = time.monotonic()

    def tick(self) -> float:
        now = time.monotonic()
        if not self.gate.in_flight:
            self.remaining -= now - self._last
        self._last = now
        return self.remaining
