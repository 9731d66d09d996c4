"""The trainer's payload I/O: puts before the appends that claim them, reads by claim, both off the
event loop and through a store outage within a budget.

A put returns once its payloads are durable; only then does the caller append the events that carry
their claims (the seal is the claim check).  Puts are group-committed as the journal's appends are:
one writer task stores every put queued while the previous store call ran in ONE call of the plane
(one thread hop, one statement of a PostgreSQL store), then answers each caller with its own claims.
Eight siblings finishing together cost one round trip to the store, not eight.  A store that stays
unavailable past the outage budget stops the coordinator as a database outage does
(`CoordinatorStopped`): a result it cannot keep is not sealed, and the agent still holds it for the
next owner.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from payloads import PayloadClaim, PayloadPlane, PayloadStoreError, PayloadStoreUnavailable
from protocol.retry import RetryPolicy, RetryState, next_step
from trainer.errors import CoordinatorStopped
from trainer.private_thread import PrivateThread

log = logging.getLogger("trainer")
_T = TypeVar("_T")

# One store call takes at most this many queued puts, or this many bytes (the first put whole however
# large): a burst never becomes one unbounded statement.  The byte bound is the trainer's memory: a
# batch is copied again on its way to the store (the driver's parameters) and the allocator keeps the
# high-water of those copies; at 9k-token rollouts 4 MiB (about 30 puts) cut the soak's peak RSS by a
# quarter against 64 MiB, and tiny batches (256 puts of a few KB) never reach it.
MAX_BATCH_PUTS = 256
MAX_BATCH_BYTES = 4 * 1024 * 1024


@dataclass
class _Put:
    items: Sequence[tuple[bytes, str]]
    future: asyncio.Future[list[PayloadClaim]]
    # The items' claims where the caller made them (`PayloadIO.claim`); else made by the store call.
    claims: Sequence[PayloadClaim] | None = None

    @property
    def size(self) -> int:
        return sum(len(content) for content, _ in self.items)


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
        # The store's puts and reads, in a thread of their own (one call at a time, in order).
        self._worker = PrivateThread("ledger-payloads")
        self.outage_budget_s = outage_budget_s
        self.on_stop = on_stop
        self.stopped: CoordinatorStopped | None = None
        # Payload store calls that failed as unavailable and were retried.
        self.outage_retries = 0
        self.bytes_put = 0
        # Store calls made for puts, and the puts they carried (puts / calls = the batching).
        self.put_calls = 0
        self.puts = 0
        self._queue: deque[_Put] = deque()
        self._writer: asyncio.Task[None] | None = None

    async def put(
        self, items: Sequence[tuple[bytes, str]], claims: Sequence[PayloadClaim] | None = None
    ) -> list[PayloadClaim]:
        """Stores each `(content, media_type)`; durable on return.  `claims`: the items' own, made by
        `claim` (each payload is hashed once); without them the store call makes them.  A caller
        cancelled while its batch is being stored leaves its payloads stored (unclaimed: `ledger
        payloads collect` finds them)."""
        if self.stopped is not None:
            raise self.stopped
        if not items:
            return []
        if claims is not None and (
            len(claims) != len(items)
            or any(
                c.media_type != media_type or c.size != len(content)
                for c, (content, media_type) in zip(claims, items, strict=False)
            )
        ):
            raise ValueError("put(items, claims): one claim per item, of its media type and size")
        request = _Put(items, asyncio.get_running_loop().create_future(), claims)
        self._queue.append(request)
        if self._writer is None or self._writer.done():
            self._writer = asyncio.create_task(self._write_puts(), name="payload-writer")
        return await request.future

    async def _write_puts(self) -> None:
        """The writer: while puts are queued, stores a batch of them (one plane call) at a time."""
        batch: list[_Put] = []
        try:
            while self._queue:
                batch = self._next_batch()
                if batch:
                    await self._store(batch)
                batch = []
        except BaseException as exc:  # cancelled (the loop is closing), or a bug: nobody waits for ever
            for request in [*batch, *self._queue]:
                if request.future.done():
                    continue
                if isinstance(exc, Exception):
                    request.future.set_exception(exc)
                else:
                    request.future.cancel()
            self._queue.clear()
            if not isinstance(exc, Exception):
                raise

    def _next_batch(self) -> list[_Put]:
        batch: list[_Put] = []
        size = 0
        while self._queue and len(batch) < MAX_BATCH_PUTS:
            request = self._queue[0]
            if request.future.done():  # its caller was cancelled before it was stored
                self._queue.popleft()
                continue
            if batch and size + request.size > MAX_BATCH_BYTES:
                break
            self._queue.popleft()
            batch.append(request)
            size += request.size
        return batch

    async def _store(self, batch: list[_Put]) -> None:
        items = [item for request in batch for item in request.items]

        def store() -> list[PayloadClaim]:
            made = [
                claim
                for request in batch
                for claim in (
                    request.claims
                    if request.claims is not None
                    else [self.plane.claim(content, media_type) for content, media_type in request.items]
                )
            ]
            self.plane.put_claimed(list(zip(made, (content for content, _ in items), strict=True)))
            return made

        try:
            try:
                claims = await self._ride_out(store, "storing payloads")
            except PayloadStoreUnavailable:
                raise
            except PayloadStoreError as exc:  # refused for good (not a directory, read-only, too large)
                raise self._stop(
                    f"the payload store refused to store payloads: {exc}; the coordinator stopped"
                ) from exc
        except Exception as exc:  # the batch's one answer is every caller's
            for request in batch:
                if not request.future.done():
                    request.future.set_exception(exc)
            return
        self.put_calls += 1
        self.puts += len(batch)
        self.bytes_put += sum(len(content) for content, _ in items)
        start = 0
        for request in batch:
            end = start + len(request.items)
            if not request.future.done():
                request.future.set_result(claims[start:end])
            start = end

    def claim(self, content: bytes, media_type: str) -> PayloadClaim:
        """The claim `put` would return for `content` (no I/O): a caller that needs the digest before
        the put hashes once, here, and hands the claim to `put(items, claims=...)`."""
        return self.plane.claim(content, media_type)

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
                return await self._worker.run(fn)
            except PayloadStoreUnavailable as exc:
                self.outage_retries += 1
                now = time.monotonic()
                failures = failures.failed(now, str(exc))
                if failures.calls == 1:
                    log.warning("the payload store is unavailable while %s; retrying: %s", what, exc)
                verdict = next_step(policy, failures, now, random.random())
                if verdict.kind == "give_up":
                    raise self._stop(
                        f"the payload store has been unavailable for more than {self.outage_budget_s:g} s "
                        f"while {what} ({failures.calls} calls); the coordinator stopped: {exc}"
                    ) from exc
                await asyncio.sleep(verdict.delay_s)

    def _stop(self, why: str) -> CoordinatorStopped:
        """Stops for good: every later put and read raises the same `CoordinatorStopped`, and
        `on_stop` hears it once."""
        if self.stopped is None:
            self.stopped = CoordinatorStopped(why)
            if self.on_stop is not None:
                self.on_stop(self.stopped)
        return self.stopped


__all__ = ["PayloadIO"]
