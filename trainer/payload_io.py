"""The trainer's payload I/O: puts before the appends that claim them, reads by claim, both off the
event loop and through a store outage within a budget.

A put returns once its payloads are durable; only then does the caller append the events that carry
their claims (the seal is the claim check).  A store that stays unavailable past the outage budget
stops the coordinator as a database outage does (`CoordinatorStopped`): a result it cannot keep is
not sealed, and the agent still holds it for the next owner.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

from payloads import PayloadClaim, PayloadPlane, PayloadStoreUnavailable
from protocol.retry import RetryPolicy, RetryState, next_step
from trainer.errors import CoordinatorStopped

log = logging.getLogger("trainer")
_T = TypeVar("_T")


class PayloadIO:
    def __init__(
        self,
        plane: PayloadPlane,
        outage_budget_s: float,
        on_stop: Callable[[CoordinatorStopped], None] | None = None,
    ) -> None:
        """`on_stop` hears the outage that stopped it: the coordinator stops for good with it, as for
        the log's own (every later append raises it)."""
        self.plane = plane
        self.outage_budget_s = outage_budget_s
        self.on_stop = on_stop
        self.stopped: CoordinatorStopped | None = None
        # Payload store calls that failed as unavailable and were retried.
        self.outage_retries = 0
        self.bytes_put = 0

    async def put(self, items: Sequence[tuple[bytes, str]]) -> list[PayloadClaim]:
        """Stores each `(content, media_type)`; durable on return."""
        claims = await self._ride_out(lambda: self.plane.put(items), "storing payloads")
        self.bytes_put += sum(len(content) for content, _ in items)
        return claims

    async def get_many(self, claims: Iterable[PayloadClaim]) -> dict[str, bytes]:
        """The checked payload of every claim, by digest (PayloadMissing, PayloadCorrupt)."""
        wanted = list(claims)
        if not wanted:
            return {}
        return await self._ride_out(lambda: self.plane.get_many(wanted), "reading payloads")

    async def _ride_out(self, fn: Callable[[], _T], what: str) -> _T:
        if self.stopped is not None:
            raise self.stopped
        failures = RetryState()
        policy = RetryPolicy.within(max(self.outage_budget_s, 1e-6), base_s=0.05, cap_s=1.0)
        while True:
            try:
                return await asyncio.to_thread(fn)
            except PayloadStoreUnavailable as exc:
                self.outage_retries += 1
                now = time.monotonic()
                failures = failures.failed(now, str(exc))
                if failures.calls == 1:
                    log.warning("the payload store is unavailable while %s; retrying: %s", what, exc)
                verdict = next_step(policy, failures, now, random.random())
                if verdict.kind == "give_up":
                    self.stopped = CoordinatorStopped(
                        f"the payload store has been unavailable for more than {self.outage_budget_s:g} s "
                        f"while {what} ({failures.calls} calls); the coordinator stopped: {exc}"
                    )
                    if self.on_stop is not None:
                        self.on_stop(self.stopped)
                    raise self.stopped from exc
                await asyncio.sleep(verdict.delay_s)


__all__ = ["PayloadIO"]
