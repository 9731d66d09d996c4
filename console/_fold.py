"""The console's live state, folded from the log one page at a time and never re-read whole.

The ledger and checkpoints projections (the same folds `ledger status` rebuilds) and the generation
figures (`projections.generation`), plus what the overview shows that those states would only give by
a scan of every group: the groups by status, claimed or not, in play or archived, kept as counts the
fold moves when an event changes a group; the checkpoints by status; the seals of the last
`RATE_WINDOW_S` seconds; and when each unpaid ACK debt was recorded.  Folding an event costs the same
at position 10 as at position 10,000,000, and so does reading the overview off the result.

Pure: `apply` takes pages of events and the state changes; no I/O, no clock.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

from eventstore import RecordedEvent, decode_events
from eventstore.events import (
    AckAccepted,
    AckOwed,
    AckRejected,
    CheckpointCommitted,
    GroupClaimedForTraining,
    GroupSealed,
    SiblingSealed,
    TrainerRestored,
)
from projections.base import Projection, Routes
from projections.checkpoints import CheckpointsProjection, CheckpointsState, CheckpointStatus
from projections.generation import GENERATION_EVENTS, GenerationFigures
from projections.ledger import GroupStatus, LedgerProjection, LedgerState, debt_key
from protocol.streams import group_of_stream

# Seals counted for the rates the overview shows (groups and rollouts sealed per second).
RATE_WINDOW_S: Final = 10.0
GROUP_STATUSES: Final[tuple[GroupStatus, ...]] = ("open", "sealed", "dead_lettered")
CHECKPOINT_STATUSES: Final[tuple[CheckpointStatus, ...]] = ("preparing", "committed", "resumed", "aborted")
# (status, claimed for training, archived): what the overview counts groups by.
GroupKey = tuple[GroupStatus, bool, bool]


def group_key(ledger: LedgerState, group_id: str) -> GroupKey | None:
    group = ledger.groups.get(group_id)
    if group is not None:
        return (group.status, bool(group.claims), False)
    archived = ledger.archived.get(group_id)
    if archived is not None:
        return (archived.status, bool(archived.claims), True)
    return None


def steps_of(ledger: LedgerState, group_id: str) -> set[int | None]:
    """The train steps a group is claimed for (None: a claim that named no step)."""
    group = ledger.groups.get(group_id) or ledger.archived.get(group_id)
    return set() if group is None else {c.train_step for c in group.claims}


def index_steps(ledger: LedgerState) -> dict[int | None, dict[str, None]]:
    """train step -> the groups claimed for it (dicts as ordered sets), by a scan: at start and after
    a trainer restore, as `count_groups`."""
    index: dict[int | None, dict[str, None]] = {}
    for groups in (ledger.groups, ledger.archived):
        for group_id, g in groups.items():
            for claim in g.claims:
                index.setdefault(claim.train_step, {})[group_id] = None
    return index


def count_groups(ledger: LedgerState) -> Counter[GroupKey]:
    """Every group by its key, by a scan: at start, and after a trainer restore (which can unclaim
    any of its groups, archived ones included)."""
    counts: Counter[GroupKey] = Counter()
    for g in ledger.groups.values():
        counts[(g.status, bool(g.claims), False)] += 1
    for a in ledger.archived.values():
        counts[(a.status, bool(a.claims), True)] += 1
    return counts


@dataclass(frozen=True, slots=True)
class FoldStopped:
    """The fold will not go past `position`: an event it cannot decode, or a hole in the positions."""

    position: int
    reason: str


class LiveFold:
    """The state at `position`.  Not thread-safe: the console's follower holds a lock around `apply`
    and readers hold it while they read."""

    def __init__(
        self,
        ledger: LedgerState,
        checkpoints: CheckpointsState,
        generation: GenerationFigures,
        position: int,
    ) -> None:
        self.ledger = ledger
        self.checkpoints = checkpoints
        self.generation = generation
        self.position = position
        self.stopped: FoldStopped | None = None
        self.events_folded = 0
        projections: list[Projection[Any]] = [LedgerProjection(), CheckpointsProjection()]
        self._routes = Routes(projections, [ledger, checkpoints])
        self.groups: Counter[GroupKey] = count_groups(ledger)
        self.steps = index_steps(ledger)
        self.checkpoint_counts: Counter[CheckpointStatus] = Counter(
            c.status for c in checkpoints.checkpoints.values()
        )
        # The checkpoint whose prepare started last (the overview's "current" one).
        newest = max(checkpoints.checkpoints.values(), key=lambda c: c.started_position or 0, default=None)
        self.current_checkpoint: str | None = None if newest is None else newest.checkpoint_id
        # recorded_at of the seals within the window (groups, rollouts), oldest first.
        self.sealed_groups: deque[float] = deque()
        self.sealed_rollouts: deque[float] = deque()
        self.last_recorded_at = 0.0
        # debt key -> when its AckOwed was recorded, for debts recorded since the fold started (the
        # ones it loaded from a projection checkpoint are looked up when shown, `console._live`).
        self.owed_at: dict[str, float] = {}

    def apply(self, batch: Sequence[RecordedEvent]) -> int:
        """Folds a page of consecutive events; stops (and says where, `stopped`) before a hole or an
        event it cannot decode.  Returns the events folded."""
        if self.stopped is not None or not batch:
            return 0
        decoded_page, error = decode_events(batch)
        ledger = self.ledger
        routes = self._routes
        done = 0
        for event, decoded in zip(batch, decoded_page, strict=False):
            if event.position != self.position + 1:
                self.stopped = FoldStopped(
                    event.position, f"positions {self.position + 1}..{event.position - 1} are missing"
                )
                break
            kind = decoded.__class__
            group_id = group_of_stream(event.stream_id)
            before = group_key(ledger, group_id) if group_id is not None else None
            checkpoint_id: str | None = getattr(decoded, "checkpoint_id", None)
            checkpoint_before = self._checkpoint_status(checkpoint_id)
            archived = len(ledger.archived)
            claimed = kind is GroupClaimedForTraining and group_id is not None
            steps_before = steps_of(ledger, group_id) if claimed and group_id is not None else set()
            for apply, state in routes.get(decoded):
                apply(state, event, decoded)
            if claimed and group_id is not None:
                for step in steps_of(ledger, group_id) - steps_before:
                    self.steps.setdefault(step, {})[group_id] = None
            if group_id is not None:
                after = group_key(ledger, group_id)
                if after != before:
                    self._move(before, after)
            if kind is CheckpointCommitted and len(ledger.archived) > archived:
                self._archived(len(ledger.archived) - archived)
            elif kind is TrainerRestored:
                self.groups = count_groups(ledger)
                self.steps = index_steps(ledger)
            if checkpoint_id is not None:
                after_status = self._checkpoint_status(checkpoint_id)
                if after_status != checkpoint_before:
                    if checkpoint_before is not None:
                        self.checkpoint_counts[checkpoint_before] -= 1
                    if after_status is not None:
                        self.checkpoint_counts[after_status] += 1
                if checkpoint_before is None and after_status == "preparing":
                    self.current_checkpoint = checkpoint_id
            if event.type in GENERATION_EVENTS:
                self.generation.apply(event.type, event.data)
            self._debts(event, decoded)
            if kind is GroupSealed:
                self.sealed_groups.append(event.recorded_at)
            elif kind is SiblingSealed:
                self.sealed_rollouts.append(event.recorded_at)
            self.position = event.position
            self.last_recorded_at = event.recorded_at
            done += 1
        else:
            if error is not None:
                bad = batch[len(decoded_page)].position
                self.stopped = FoldStopped(bad, str(error))
        self.events_folded += done
        self._trim(self.last_recorded_at)
        return done

    def sealed_per_s(self, now: float) -> tuple[float, float]:
        """(groups, rollouts) sealed per second over the last RATE_WINDOW_S seconds before `now`."""
        self._trim(now)
        return len(self.sealed_groups) / RATE_WINDOW_S, len(self.sealed_rollouts) / RATE_WINDOW_S

    def status_counts(self) -> dict[GroupStatus, tuple[int, int]]:
        """status -> (in play, archived)."""
        out: dict[GroupStatus, tuple[int, int]] = {}
        for status in GROUP_STATUSES:
            out[status] = (
                self.groups[(status, False, False)] + self.groups[(status, True, False)],
                self.groups[(status, False, True)] + self.groups[(status, True, True)],
            )
        return out

    def claimed_counts(self) -> tuple[int, int]:
        """Groups claimed for training: (in play, archived)."""
        return (
            sum(self.groups[(s, True, False)] for s in GROUP_STATUSES),
            sum(self.groups[(s, True, True)] for s in GROUP_STATUSES),
        )

    # --- internals -------------------------------------------------------------------------

    def _move(self, before: GroupKey | None, after: GroupKey | None) -> None:
        if before is not None:
            self.groups[before] -= 1
        if after is not None:
            self.groups[after] += 1

    def _archived(self, n: int) -> None:
        # A commit archives groups as they are (status and claims unchanged), appending each to the
        # end of `archived`: the newest n entries are the ones it moved.
        for group_id in _last(self.ledger.archived, n):
            a = self.ledger.archived[group_id]
            self._move((a.status, bool(a.claims), False), (a.status, bool(a.claims), True))

    def _checkpoint_status(self, checkpoint_id: str | None) -> CheckpointStatus | None:
        if checkpoint_id is None:
            return None
        c = self.checkpoints.checkpoints.get(checkpoint_id)
        return None if c is None else c.status

    def _debts(self, event: RecordedEvent, decoded: object) -> None:
        if isinstance(decoded, AckOwed):
            self.owed_at[debt_key(decoded.receipt.rollout_id, decoded.receipt.attempt_index)] = (
                event.recorded_at
            )
        elif isinstance(decoded, AckAccepted | AckRejected):
            key = debt_key(decoded.rollout_id, decoded.attempt_index)
            if key in self.owed_at and not any(key in owed for owed in self.ledger.debts.values()):
                del self.owed_at[key]

    def _trim(self, now: float) -> None:
        horizon = now - RATE_WINDOW_S
        for window in (self.sealed_groups, self.sealed_rollouts):
            while window and window[0] < horizon:
                window.popleft()


def _last(mapping: dict[str, Any], n: int) -> list[str]:
    """The last `n` keys of a dict in insertion order, without walking the rest."""
    out: list[str] = []
    for key in reversed(mapping):
        if len(out) == n:
            break
        out.append(key)
    return out


__all__ = [
    "CHECKPOINT_STATUSES",
    "GROUP_STATUSES",
    "RATE_WINDOW_S",
    "FoldStopped",
    "GroupKey",
    "LiveFold",
    "count_groups",
    "group_key",
    "index_steps",
    "steps_of",
]
