"""The log as this process knows it: the projections folded from it (ledger, checkpoints), kept current
by reading the log in pages, and every read of the store ridden out through a database outage within
a budget.  `Journal` writes through it (group commit, fencing); everything else only reads it.

Threads do the I/O, the event loop folds: the store's calls run in a worker thread; the rows they hand
back are folded into the projections on the event loop, between two of its steps, so a coroutine that
reads the ledger without awaiting (iterating its groups or debts) never sees it change half way, and
none has to copy it first.  A fold of the rows in hand runs to its end without yielding; a catch-up
folds a page at a time (each a prefix of the log).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from eventstore import (
    DatabaseRefused,
    DatabaseUnavailable,
    EventStore,
    ExpectedVersion,
    RecordedEvent,
)
from eventstore.events import Event
from eventstore.read_ahead import PAGE_SIZE
from projections.base import decode
from projections.checkpoints import CheckpointsProjection, CheckpointsState
from projections.ledger import LedgerProjection, LedgerState
from protocol.retry import RetryPolicy, RetryState, next_step
from protocol.streams import group_stream, is_group_stream
from trainer.errors import CoordinatorStopped, FencedOff
from trainer.eventloop import wait_at_most
from trainer.private_thread import PrivateThread
from trainer.settings import log

_T = TypeVar("_T")

# How long a database outage is ridden out (appends and reads retried) before the coordinator stops.
OUTAGE_BUDGET_S = 30.0
# Events a catch-up reads (in a thread) and then folds (on the event loop) at a time: the longest
# the loop is held by one fold is one page's.
CATCH_UP_PAGE = PAGE_SIZE


@dataclass
class LogView:
    store: EventStore
    ledger_projection: LedgerProjection = field(default_factory=LedgerProjection)
    checkpoints_projection: CheckpointsProjection = field(default_factory=CheckpointsProjection)
    ledger: LedgerState = field(init=False)
    checkpoints: CheckpointsState = field(init=False)
    position: int = 0
    fenced: FencedOff | None = None
    # Set when the database stayed away longer than `outage_budget_s`: every later append raises it.
    stopped: CoordinatorStopped | None = None
    outage_budget_s: float = OUTAGE_BUDGET_S
    # Database calls that failed with DatabaseUnavailable and were retried.
    outage_retries: int = 0
    # Stream -> the version this process last saw (its fencing token).
    versions: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.ledger = self.ledger_projection.initial()
        self.checkpoints = self.checkpoints_projection.initial()
        self._lock = asyncio.Lock()
        self.changed = asyncio.Condition()
        # The log's reads and writes, in a thread of their own (one call at a time, in order).
        self._worker = PrivateThread("ledger-log")
        # Until `load`: the version of every group stream the folds have seen (its last event's), so
        # that archived groups, whose version the ledger does not keep, cost no read of their own.
        self._folded_versions: dict[str, int] | None = {}

    def _read_page(self, after: int) -> tuple[list[tuple[RecordedEvent, Event]], Exception | None]:
        """In a worker thread: the log's next page after `after`, decoded; touches no state of the
        journal.  An event that cannot be decoded ends the page, its error handed back beside the rows
        before it (they are folded, then it is raised: the fold stops where the log cannot be read)."""
        rows: list[tuple[RecordedEvent, Event]] = []
        # One page: `islice` stops before the reader would ask for the next.
        for event in itertools.islice(self.store.read_all(after, batch_size=CATCH_UP_PAGE), CATCH_UP_PAGE):
            try:
                rows.append((event, decode(event)))
            except Exception as exc:
                return rows, exc
        return rows, None

    def _fold(self, rows: Sequence[tuple[RecordedEvent, Event]]) -> None:
        """On the event loop: folds `rows` (in log order) into the projections, skipping any the fold
        holds already (a page read before a write it raced with)."""
        folded = self._folded_versions
        for event, decoded in rows:
            if event.position <= self.position:
                continue
            self.ledger_projection.apply(self.ledger, event, decoded)
            self.checkpoints_projection.apply(self.checkpoints, event, decoded)
            # The position moves with every event folded, so a read that breaks off half way (the
            # database went away) resumes after the last event applied instead of folding it twice.
            self.position = event.position
            if folded is not None and is_group_stream(event.stream_id):
                folded[event.stream_id] = event.stream_version

    async def _catch_up(self, what: str) -> None:
        """Folds what the log holds past the fold's position: pages read in a thread, each ridden out
        through an outage, each folded on the loop.  The caller holds `_lock`."""
        while True:
            rows, error = await self._ride_out(functools.partial(self._read_page, self.position), what)
            self._fold(rows)
            if error is not None:
                raise error
            if len(rows) < CATCH_UP_PAGE:
                return

    async def catch_up(self) -> None:
        async with self._lock:
            await self._catch_up("reading the log")
        await self._notify()

    async def read(self, fn: Callable[[], _T], what: str) -> _T:
        """A read of the store (e.g. its head), retried through a database outage."""
        return await self._ride_out(fn, what)

    async def _ride_out(self, fn: Callable[[], _T], what: str) -> _T:
        """Runs `fn` in a thread, retrying `DatabaseUnavailable` for up to `outage_budget_s`.

        Past the budget the journal stops for good (`CoordinatorStopped`): a coordinator that cannot
        record its decisions must not make any; its debts stay in the log for the next one.  A
        connection the database refused (`DatabaseRefused`) stops it at the first attempt.
        """
        if self.stopped is not None:
            raise self.stopped
        failures = RetryState()
        while True:
            try:
                result = await self._worker.run(fn)
                if failures.calls:
                    log.warning("the log is reachable again after %d retries while %s", failures.calls, what)
                return result
            except DatabaseRefused as exc:
                # A wrong password or a database gone (dropped): no outage, so no budget to wait out.
                self.stopped = CoordinatorStopped(
                    f"the log refused the connection while {what}; the coordinator stopped (nothing it "
                    f"decided is lost: recover from the log once the connection is mended): {exc}"
                )
                raise self.stopped from exc
            except DatabaseUnavailable as exc:
                self.outage_retries += 1
                now = time.monotonic()
                failures = failures.failed(now, str(exc))
                if failures.calls == 1:
                    log.warning("the log is unavailable while %s; reconnecting with backoff: %s", what, exc)
                # The outage budget as a retry budget: jittered backoff, no call past the deadline.
                budget = max(self.outage_budget_s, 1e-6)  # 0: give up at the first failure
                policy = RetryPolicy.within(budget, base_s=0.05, cap_s=1.0)
                verdict = next_step(policy, failures, now, random.random())
                if verdict.kind == "give_up":
                    self.stopped = CoordinatorStopped(
                        f"the log has been unavailable for more than {self.outage_budget_s:g} s while "
                        f"{what}; the coordinator stopped (nothing it decided is lost: recover from the "
                        f"log once the database is back): {exc}"
                    )
                    raise self.stopped from exc
                await asyncio.sleep(verdict.delay_s)

    async def load(self) -> None:
        """Folds the whole log and adopts every group stream's current version as this process's own.

        The versions come from the fold itself (an archived group's from the last event of its stream,
        which the ledger does not keep): no read per stream, so the whole load is reads of the log
        in pages, each ridden out through an outage like any other."""
        await self.catch_up()
        folded, self._folded_versions = self._folded_versions, None
        if folded is not None:  # the first load: later ones keep what it adopted
            for gid in self.ledger.archived:
                stream = group_stream(gid)
                self.versions[stream] = folded.get(stream, ExpectedVersion.NO_STREAM)
        for group in [*self.ledger.groups.values()]:
            self.versions[group_stream(group.group_id)] = group.stream_version

    async def _notify(self) -> None:
        async with self.changed:
            self.changed.notify_all()

    async def wait_changed(self, timeout_s: float) -> None:
        """Until the next batch is recorded, or `timeout_s` has passed."""
        async with self.changed:
            await wait_at_most(self.changed.wait(), timeout_s)
