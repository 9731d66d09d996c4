"""The follower: loads the console's state once, then folds the log's new pages as they are appended.

One thread.  It starts from the newest projection checkpoint the runner stored (else from position
0), folds the rest a page at a time as a rebuild reads it (`_catch_up`; pages are served meanwhile:
they show the state as far as it got, and say so), then follows the log through a subscription,
polling every `poll_interval_s`.  Each page folded bumps `changes`, which wakes the pages that push
the overview (server-sent events).

A database that goes away is retried with a growing, jittered delay for `outage_budget_s`; after
that the follower gives up and says so on every page (the console keeps serving what it has).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import random
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Final, TypeVar

from console._fold import LiveFold
from eventstore import EventStore
from eventstore.bulk_reads import fewer_collections
from eventstore.errors import DatabaseUnavailable, EventStoreError
from projections.base import ReplayRefused
from projections.checkpoints import CheckpointsState
from projections.generation import GENERATION_EVENTS, generation_figures
from projections.ledger import LedgerState
from projections.runner import default_projections, latest_common_checkpoint, load_replay

log = logging.getLogger("console")
T = TypeVar("T")

# Events folded per page (and at most per poll): the lock is held for one page at a time.
PAGE: Final = 2000
# While it follows the log, the follower freezes what it folded (`gc.freeze`) every this many events.
REFREEZE_EVENTS: Final = 100_000


class Changes:
    """A version number any thread bumps and any event loop awaits (the overview's pushes)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiters: set[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = set()
        self.version = 0

    def bump(self) -> None:
        with self._lock:
            self.version += 1
            waiters = list(self._waiters)
        for loop, event in waiters:
            # A closed loop raises: its waiter is gone with it.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(event.set)

    async def wait(self, seen: int, timeout_s: float) -> int:
        """The version once it differs from `seen`, or after `timeout_s` whatever it is."""
        entry = (asyncio.get_running_loop(), asyncio.Event())
        with self._lock:
            if self.version != seen:
                return self.version
            self._waiters.add(entry)
        try:
            await asyncio.wait_for(entry[1].wait(), timeout_s)
        except TimeoutError:
            pass
        finally:
            with self._lock:
                self._waiters.discard(entry)
        return self.version


@dataclass(frozen=True, slots=True)
class Progress:
    """Where the follower is: loading (no state yet), catching up to `target`, or live."""

    phase: str  # "loading", "catching up", "live", "stopped"
    position: int
    target: int
    note: str = ""


class Live:
    def __init__(
        self, store: EventStore, poll_interval_s: float = 0.1, outage_budget_s: float = 60.0, page: int = PAGE
    ) -> None:
        self.store = store
        self.poll_interval_s = poll_interval_s
        self.outage_budget_s = outage_budget_s
        self.page = page
        self.changes = Changes()
        self.lock = threading.RLock()
        self.fold: LiveFold | None = None
        self.target = 0
        self.note = ""  # what the follower wants an operator to know (a refused checkpoint, an outage)
        self.gave_up = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="console-follower", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    @contextmanager
    def state(self) -> Iterator[LiveFold | None]:
        """The fold, held still while the caller reads it (None while it loads)."""
        with self.lock:
            yield self.fold

    def progress(self) -> Progress:
        with self.lock:
            fold = self.fold
            if fold is None:
                return Progress("loading", 0, self.target, self.note)
            if fold.stopped is not None or self.gave_up:
                return Progress("stopped", fold.position, self.target, self.note)
            phase = "catching up" if fold.position < self.target else "live"
            return Progress(phase, fold.position, self.target, self.note)

    # --- the thread ----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._load()
            self._catch_up()
            self._follow()
        except Exception as exc:  # the console keeps serving what it has; every page says why it stopped
            log.exception("the console's follower stopped")
            with self.lock:
                self.gave_up = True
                self.note = f"stopped following the log: {exc}"
            self.changes.bump()

    def _load(self) -> None:
        projections = default_projections()
        self.target = self._retrying(self.store.head)
        start = self._retrying(lambda: latest_common_checkpoint(self.store, projections))
        ledger: LedgerState
        checkpoints: CheckpointsState
        position = 0
        if start is not None:
            at = start
            try:
                replay = self._retrying(lambda: load_replay(self.store, projections, at))
                ledger, checkpoints = replay.state("ledger"), replay.state("checkpoints")
                position = replay.position
            except ReplayRefused as exc:  # a stored checkpoint that does not verify: fold from 0
                self.note = f"the stored projection checkpoint was refused ({exc}); folded from position 0"
                start = None
        if start is None:
            ledger, checkpoints = projections[0].initial(), projections[1].initial()
        generation = self._retrying(
            lambda: generation_figures(self.store.read_all(0, position, types=GENERATION_EVENTS))
        )
        with self.lock:
            self.fold = LiveFold(ledger, checkpoints, generation, position)
        self.changes.bump()

    def _catch_up(self) -> None:
        """Folds what the log held when the console started, as a rebuild reads it: the next page
        read while this one is folded, the collector run less often (`fewer_collections`).  A page is
        folded under the lock, so pages are served between two.  A database that goes away here
        leaves the rest to `_follow`, which retries."""
        assert self.fold is not None
        try:
            with fewer_collections():
                for page in self.store.read_pages(self.fold.position, self.target, batch_size=self.page):
                    with self.lock:
                        self.fold.apply(page)
                        stopped = self.fold.stopped
                    self.changes.bump()
                    if stopped is not None or self._stop.is_set():
                        return
        except DatabaseUnavailable:
            return
        finally:
            # What the catch-up built lives as long as the console: the collector's full passes leave
            # it alone from here (`gc.freeze`), or each would walk every group of the log, and a
            # page that happens to start one would wait for it (hundreds of milliseconds at a
            # million events).  Acyclic, as the states are, frozen objects are still freed when
            # dropped.
            gc.freeze()

    def _follow(self) -> None:
        assert self.fold is not None
        if self.fold.stopped is not None:
            return
        subscription = self.store.subscribe("console", from_position=self.fold.position)
        while not self._stop.is_set():
            batch = self._retrying(lambda: subscription.poll(self.page))
            if self._stop.is_set():
                return
            if batch:
                with self.lock:
                    before = self.fold.events_folded
                    self.fold.apply(batch)
                    stopped = self.fold.stopped
                    if self.fold.events_folded // REFREEZE_EVENTS > before // REFREEZE_EVENTS:
                        gc.freeze()  # what was folded since the last freeze (see `_catch_up`)
                self.changes.bump()
                if stopped is not None:
                    log.error(
                        "the console's fold stopped before position %d: %s", stopped.position, stopped.reason
                    )
                    return
                if len(batch) == self.page:
                    continue  # catching up: the next page at once
            self._stop.wait(self.poll_interval_s)

    def _retrying(self, call: Callable[[], T]) -> T:
        """`call()`, retried while the database is unavailable, for at most `outage_budget_s`."""
        started = time.monotonic()
        delay = 0.1
        while True:
            try:
                result = call()
                if self.note.startswith("the log is unreachable"):
                    with self.lock:
                        self.note = ""
                return result
            except DatabaseUnavailable as exc:
                waited = time.monotonic() - started
                if waited >= self.outage_budget_s or self._stop.is_set():
                    raise EventStoreError(
                        f"the log stayed unreachable for {waited:.0f} s (budget {self.outage_budget_s:.0f} s): {exc}"
                    ) from None
                with self.lock:
                    self.note = f"the log is unreachable, retrying: {exc}"
                self.changes.bump()
                self._stop.wait(delay * random.uniform(0.5, 1.5))
                delay = min(delay * 2, 5.0)
