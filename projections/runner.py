"""Keeps projections live from the log and stores their checkpoints; rebuilds them up to any position.

One pass decodes each event once and feeds it to every projection, while it
refuses to go past an event it cannot decode or a hole in the positions, and
keeps the running digest of the log (`projections.digest`) that each stored
checkpoint records.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from eventstore import EventStore, RecordedEvent, decode_events
from eventstore.bulk_reads import fewer_collections
from eventstore.read_ahead import PAGE_SIZE
from projections.base import Projection, ReplayRefused, Routes, sha256_text
from projections.checkpoints import CheckpointsProjection
from projections.digest import BLOCK, LogDigest, StoredDigest
from projections.ledger import LedgerProjection
from projections.sql import list_checkpoints, load_checkpoint_state, read_hashes, save_checkpoints

RUNNER_NAME = "projections"
BLOCK_MASK = BLOCK - 1  # BLOCK is a power of two: `position & BLOCK_MASK == 0` closes a block
Progress = Callable[[int], None]


def default_projections() -> list[Projection[Any]]:
    """The projections a trainer restores from: the ledger and the checkpoints (the recovery view derives from them)."""
    return [LedgerProjection(), CheckpointsProjection()]


@dataclass(slots=True)
class Replay:
    """Projection states at `position`, with the log digest up to it."""

    projections: list[Projection[Any]]
    states: list[Any]
    position: int = 0
    digest: LogDigest = field(default_factory=LogDigest)
    events: int = 0  # applied by this replay (not counting what a checkpoint brought)
    from_checkpoint: int | None = None
    routes: Routes = field(init=False)

    def __post_init__(self) -> None:
        self.routes = Routes(self.projections, self.states)

    def state(self, name: str) -> Any:
        for projection, state in zip(self.projections, self.states, strict=True):
            if projection.name == name:
                return state
        raise KeyError(name)

    def hashes(self) -> dict[str, str]:
        return {p.name: p.state_hash(s) for p, s in zip(self.projections, self.states, strict=True)}

    def apply_batches(self, batches: Iterable[list[RecordedEvent]], progress: Progress | None = None) -> None:
        """Folds batches of consecutive events; stops (ReplayRefused) before a hole or an undecodable event."""
        # The hot loop of every replay: each page decoded in one pass (`decode_events`, the store's
        # typed read path), `Routes.get` inlined for its fast path.
        routes = self.routes
        by_type = routes.by_type
        digest = self.digest
        pending = digest.pending
        expected = self.position + 1
        for batch in batches:
            first = expected
            try:
                decoded_page, error = decode_events(batch)
                for event, decoded in zip(batch, decoded_page, strict=False):
                    position = event.position
                    if position != expected:
                        raise _hole(position, expected)
                    pairs = by_type.get(decoded.__class__)
                    if pairs is None:
                        pairs = routes.get(decoded)
                    for apply, state in pairs:
                        apply(state, event, decoded)
                    pending.append(event.hash)
                    if not position & BLOCK_MASK:
                        digest.close_block(position)
                    expected = position + 1
                if error is not None:
                    bad = batch[len(decoded_page)].position
                    raise _hole(bad, expected) if bad != expected else ReplayRefused(bad, str(error))
            finally:
                self.position = expected - 1
                self.events += expected - first
                if progress is not None:
                    progress(expected - first)


def _hole(position: int, expected: int) -> ReplayRefused:
    return ReplayRefused(
        position,
        f"positions {expected}..{position - 1} are missing from the log"
        if position > expected
        else f"position {position} is out of order after {expected - 1}",
    )


def read_batches(
    store: EventStore, after: int = 0, to: int | None = None, batch_size: int = PAGE_SIZE
) -> Iterator[list[RecordedEvent]]:
    """Events with `after < position <= to` in lists of `batch_size` (the store's raw-driver read)."""
    return store.read_pages(after, to, batch_size=batch_size)


def _fresh(projections: Sequence[Projection[Any]]) -> Replay:
    return Replay(list(projections), [p.initial() for p in projections])


def latest_common_checkpoint(
    store: EventStore, projections: Sequence[Projection[Any]], at_or_before: int | None = None
) -> int | None:
    """The highest position at which every one of `projections` (at its current version) has a checkpoint."""
    wanted = {(p.name, p.version) for p in projections}
    seen: dict[int, set[tuple[str, int]]] = {}
    for c in list_checkpoints(store):
        if (c.projection, c.version) in wanted and (at_or_before is None or c.position <= at_or_before):
            seen.setdefault(c.position, set()).add((c.projection, c.version))
    complete = [p for p, names in seen.items() if names == wanted]
    return max(complete) if complete else None


def load_replay(store: EventStore, projections: Sequence[Projection[Any]], position: int) -> Replay:
    """The states stored at `position`, each checked against its state hash and the log against its digest."""
    stored = {c.projection: c for c in list_checkpoints(store) if c.position == position}
    states = []
    digest_text = ""
    for p in projections:
        row = stored.get(p.name)
        text = load_checkpoint_state(store, p.name, p.version, position)
        if row is None or text is None:
            raise ReplayRefused(position, f"no {p.name} v{p.version} checkpoint at position {position}")
        # The stored text is the canonical dump, so its sha256 is the state hash without re-dumping.
        if sha256_text(text) != row.state_hash:
            raise ReplayRefused(
                position, f"the stored {p.name} checkpoint at {position} does not match its state hash"
            )
        states.append(p.loads(text))
        digest_text = row.log_digest
    stored_digest = StoredDigest.decode(digest_text)
    try:
        digest = LogDigest.resume(stored_digest, read_hashes(store, stored_digest.block_position, position))
    except ValueError as exc:
        raise ReplayRefused(position, f"checkpoint at {position}: {exc}") from None
    return Replay(list(projections), states, position=position, digest=digest, from_checkpoint=position)


def rebuild(
    store: EventStore,
    projections: Sequence[Projection[Any]] | None = None,
    to_position: int | None = None,
    from_checkpoint: bool = True,
    progress: Progress | None = None,
    batch_size: int = PAGE_SIZE,
) -> Replay:
    """The projections as of `to_position` (default: the head), from the nearest checkpoint at or below it."""
    chosen = list(projections) if projections is not None else default_projections()
    start = latest_common_checkpoint(store, chosen, to_position) if from_checkpoint else None
    replay = load_replay(store, chosen, start) if start is not None else _fresh(chosen)
    if progress is not None and replay.position:
        progress(0)
    with fewer_collections():
        replay.apply_batches(read_batches(store, replay.position, to_position, batch_size), progress)
    if to_position is not None and replay.position < to_position and store.head() >= to_position:
        raise ReplayRefused(replay.position + 1, f"the log ends at {replay.position}, before {to_position}")
    return replay


def store_checkpoint(
    store: EventStore, replay: Replay, subscriber: str | None = None, keep: int | None = None
) -> None:
    rows = []
    for p, s in zip(replay.projections, replay.states, strict=True):
        text = p.dumps(s)
        rows.append((p.name, p.version, text, sha256_text(text)))
    save_checkpoints(store, rows, replay.position, replay.digest.stored().encode(), subscriber, keep)


class ProjectionRunner:
    """Follows the log and keeps `projections` live, storing a checkpoint every `checkpoint_every` events.

    It resumes from the newest checkpoint common to its projections (stored
    together with its subscription position), so a runner killed at any
    point comes back to the same states as a rebuild from scratch.
    """

    def __init__(
        self,
        store: EventStore,
        projections: Sequence[Projection[Any]] | None = None,
        checkpoint_every: int = 10_000,
        name: str = RUNNER_NAME,
        keep: int | None = 20,
    ) -> None:
        self.store = store
        self.projections = list(projections) if projections is not None else default_projections()
        self.checkpoint_every = checkpoint_every
        self.name = name
        self.keep = keep
        self._stopped = False
        start = latest_common_checkpoint(store, self.projections)
        self.replay = (
            load_replay(store, self.projections, start) if start is not None else _fresh(self.projections)
        )
        self.last_checkpoint = self.replay.position

    @property
    def position(self) -> int:
        return self.replay.position

    def state(self, name: str) -> Any:
        return self.replay.state(name)

    def catch_up(self, progress: Progress | None = None) -> int:
        """Applies everything committed so far (checkpointing on the way); returns the events applied."""
        before = self.replay.events
        for batch in read_batches(self.store, self.replay.position):
            self._apply([batch], progress)
        return self.replay.events - before

    def run(self, idle_exit_s: float | None = None, poll_interval_s: float = 0.05) -> None:
        """Catches up, then follows live appends until `stop()` or `idle_exit_s` without a new event."""
        self.catch_up()
        subscription = self.store.subscribe(
            self.name, from_position=self.replay.position, poll_interval_s=poll_interval_s
        )
        idle_since = time.monotonic()
        while not self._stopped:
            batch = subscription.poll()
            if batch:
                self._apply([batch], None)
                idle_since = time.monotonic()
                continue
            if idle_exit_s is not None and time.monotonic() - idle_since >= idle_exit_s:
                break
            time.sleep(poll_interval_s)
        if self.replay.position > self.last_checkpoint:
            self.checkpoint()

    def stop(self) -> None:
        self._stopped = True

    def checkpoint(self) -> None:
        store_checkpoint(self.store, self.replay, subscriber=self.name, keep=self.keep)
        self.last_checkpoint = self.replay.position

    def _apply(self, batches: list[list[RecordedEvent]], progress: Progress | None) -> None:
        for batch in batches:
            # Checkpoints fall on the event where the count is reached, not at batch ends, so a
            # runner stores them at the same positions however its reads were cut into batches.
            start = 0
            while start < len(batch):
                room = self.checkpoint_every - (self.replay.position - self.last_checkpoint)
                chunk = batch[start : start + max(room, 1)]
                self.replay.apply_batches([chunk], progress)
                start += len(chunk)
                if self.replay.position - self.last_checkpoint >= self.checkpoint_every:
                    self.checkpoint()
