"""Catch-up subscriptions: read from a position, then follow live appends."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from eventstore.records import RecordedEvent

if TYPE_CHECKING:
    from eventstore.store import EventStore, UnitOfWork


class Subscription:
    """Delivers every event after `position` exactly once per pass, in position order.

    Delivery is at least once across restarts: the subscriber stores its
    position with `commit`, inside its own write transaction when it has one,
    and a restarted subscriber resumes from the stored position.
    """

    def __init__(self, store: EventStore, name: str, position: int, poll_interval_s: float = 0.05) -> None:
        self.store = store
        self.name = name
        self.position = position
        self.poll_interval_s = poll_interval_s
        self._stopped = False
        self._listener: Any = None

    def poll(self, max_events: int = 5000) -> list[RecordedEvent]:
        """The next events already committed (at most `max_events`: one page), without waiting."""
        # One page read, not the whole tail cut to a page: a subscriber catching up on a long log
        # would read everything after its position at every poll.
        batch = next(self.store.read_pages(self.position, batch_size=max_events, read_ahead=False), [])
        if batch:
            self.position = batch[-1].position
        return batch

    def __iter__(self) -> Iterator[RecordedEvent]:
        return self.follow()

    def follow(self, idle_timeout_s: float | None = None) -> Iterator[RecordedEvent]:
        """Yields events as they are appended; stops after `idle_timeout_s` without one, or on `stop()`."""
        idle_since = time.monotonic()
        delay = self.poll_interval_s / 4
        while not self._stopped:
            batch = self.poll()
            if batch:
                yield from batch
                idle_since, delay = time.monotonic(), self.poll_interval_s / 4
                continue
            if idle_timeout_s is not None and time.monotonic() - idle_since >= idle_timeout_s:
                return
            self._wait(delay)
            delay = min(delay * 2, self.poll_interval_s)

    def commit(self, position: int | None = None, tx: UnitOfWork | None = None) -> None:
        """Stores the subscriber's position (the last event it has fully processed)."""
        value = self.position if position is None else position
        if tx is not None:
            tx.save_position(self.name, value)
        else:
            self.store.save_position(self.name, value)

    def stop(self) -> None:
        self._stopped = True
        if self._listener is not None:
            self._listener.close()
            self._listener = None

    def _wait(self, delay: float) -> None:
        """Sleeps until the next poll; with NOTIFY on (PostgreSQL), wakes up as soon as an append commits."""
        if not self.store.notify:
            time.sleep(delay)
            return
        try:
            if self._listener is None:
                # Poll once more after LISTEN: an append committed before it sent no notification to us.
                self._listener = self.store.listen_connection()
                return
            for _ in self._listener.notifies(timeout=self.poll_interval_s, stop_after=1):
                pass
        except Exception:  # a broken listener degrades to polling; the next poll reconnects
            self._listener = None
            time.sleep(delay)
