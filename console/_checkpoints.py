"""The checkpoints page: every checkpoint with its cut and outcome, and one checkpoint in full.

Pure.  The list comes off the checkpoints projection and the generation figures the console keeps
live; one checkpoint's detail also takes the events about it (its own stream, and the retires and
abandoned rounds recorded while its prepare ran: `console._reads.events_between`), to say what
blocked it (the tries it retired, the finished and unacknowledged tries it carried across, the
participants stuck on a decided step) and what it threw away.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Final

from console._overview import Participant, participant_phases
from eventstore import RecordedEvent
from eventstore.events import (
    AttemptRetired,
    CheckpointAborted,
    CheckpointCommitted,
    CheckpointParticipantStuck,
    GroupAbandoned,
)
from projections.base import ReplayRefused, decode
from projections.checkpoints import CheckpointsState, CheckpointState
from projections.generation import GenerationFigures, Work

PER_PAGE: Final = 50
# The events read around one checkpoint's prepare, at most.
WINDOW_EVENTS: Final = 20_000
WINDOW_TYPES: Final = ("AttemptRetired", "GroupAbandoned")


@dataclass(frozen=True, slots=True)
class CheckpointRow:
    checkpoint_id: str
    status: str
    trainer_id: str | None
    cut_position: int | None
    started_position: int | None
    decided_position: int | None
    participants: int
    longest_wait_s: float | None
    thrown: Work | None
    abort_reason: str | None


def _decided(c: CheckpointState) -> int | None:
    return c.committed_position if c.committed_position is not None else c.aborted_position


def row_of(c: CheckpointState, generation: GenerationFigures) -> CheckpointRow:
    return CheckpointRow(
        checkpoint_id=c.checkpoint_id,
        status=c.status,
        trainer_id=c.trainer_id,
        cut_position=c.cut_position,
        started_position=c.started_position,
        decided_position=_decided(c),
        participants=len(c.participants),
        longest_wait_s=max(c.prepare_wait_s.values(), default=None),
        thrown=generation.by_checkpoint.get(c.checkpoint_id),
        abort_reason=c.abort_reason,
    )


def list_checkpoints(
    state: CheckpointsState, generation: GenerationFigures, page: int, status: str | None = None
) -> tuple[list[CheckpointRow], int]:
    """One page (from 1) of the checkpoints, the newest prepare first, and how many there are."""
    found = [c for c in state.checkpoints.values() if status is None or c.status == status]
    found.sort(key=lambda c: c.started_position or _decided(c) or 0, reverse=True)
    start = (max(page, 1) - 1) * PER_PAGE
    return [row_of(c, generation) for c in found[start : start + PER_PAGE]], len(found)


@dataclass(frozen=True, slots=True)
class RetiredTry:
    rollout_id: str
    attempt_index: int
    agent_answer: str
    position: int
    model_s: float | None
    tokens: int | None


@dataclass(slots=True)
class CheckpointDetail:
    row: CheckpointRow
    participants: list[Participant]
    retired: list[RetiredTry] = field(default_factory=list)
    # agent -> the finished, unacknowledged tries its prepare carried across (debts unpaid at the cut)
    carried: dict[str, list[str]] = field(default_factory=dict)
    # rounds its retires took down: (group, position, the tries of the round)
    abandoned: list[tuple[str, int, list[str]]] = field(default_factory=list)
    stuck: list[tuple[str, str, int]] = field(default_factory=list)  # (agent, what, position)
    window_cut: bool = False  # more events than WINDOW_EVENTS were recorded during the prepare


def checkpoint_detail(
    c: CheckpointState,
    generation: GenerationFigures,
    started_at: float | None,
    now: float,
    own_events: Iterable[RecordedEvent],
    window: list[RecordedEvent],
) -> CheckpointDetail:
    detail = CheckpointDetail(row_of(c, generation), participant_phases(c, started_at, now))
    detail.window_cut = len(window) >= WINDOW_EVENTS
    ours: set[tuple[str, int]] = set()
    for event in [*own_events, *window]:
        try:
            decoded = decode(event)
        except ReplayRefused:
            continue
        if isinstance(decoded, CheckpointCommitted) and decoded.checkpoint_id == c.checkpoint_id:
            detail.carried = {
                agent: [f"{a.rollout_id}#{a.attempt_index}" for a in tries]
                for agent, tries in sorted(decoded.carried.items())
            }
        elif isinstance(decoded, CheckpointParticipantStuck) and decoded.checkpoint_id == c.checkpoint_id:
            detail.stuck.append(
                (
                    decoded.agent_name,
                    f"{decoded.step} after {decoded.calls} calls: {decoded.reason}",
                    event.position,
                )
            )
        elif isinstance(decoded, CheckpointAborted):
            continue  # the abort reason is in the row
        elif isinstance(decoded, AttemptRetired) and decoded.checkpoint_id == c.checkpoint_id:
            ours.add((decoded.rollout_id, decoded.attempt_index))
            work = decoded.work
            detail.retired.append(
                RetiredTry(
                    decoded.rollout_id,
                    decoded.attempt_index,
                    decoded.outcome + (f" ({decoded.cause})" if decoded.cause else ""),
                    event.position,
                    None if work is None else work.model_s,
                    None if work is None else work.generated_tokens,
                )
            )
        elif isinstance(decoded, GroupAbandoned):
            tries = [(a.rollout_id, a.attempt_index) for a in decoded.attempts]
            if any(t in ours for t in tries):
                detail.abandoned.append((decoded.group_id, event.position, [f"{r}#{n}" for r, n in tries]))
    return detail


__all__ = [
    "PER_PAGE",
    "WINDOW_EVENTS",
    "WINDOW_TYPES",
    "CheckpointDetail",
    "CheckpointRow",
    "RetiredTry",
    "checkpoint_detail",
    "list_checkpoints",
    "row_of",
]
