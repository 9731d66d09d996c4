"""Checkpoints: each one's outcome, cut position and how long prepare waited, plus trainer restores."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from pydantic import ConfigDict, with_config

from eventstore import RecordedEvent
from eventstore.events import (
    CheckpointAborted,
    CheckpointCommitted,
    CheckpointParticipantFinished,
    CheckpointParticipantStuck,
    CheckpointPrepareStarted,
    CheckpointResumed,
    Event,
    TrainerRestored,
)
from projections.base import TypedProjection

ANY_TRAINER = object()
CheckpointStatus = Literal["preparing", "committed", "resumed", "aborted"]
_FORBID = ConfigDict(extra="forbid")


@with_config(_FORBID)
@dataclass(slots=True, kw_only=True)
class CheckpointState:
    checkpoint_id: str
    status: CheckpointStatus = "preparing"
    participants: list[str] = field(default_factory=list)
    trainer_id: str | None = None
    cut_position: int | None = None
    prepare_wait_s: dict[str, float] = field(default_factory=dict)
    abort_reason: str | None = None
    started_position: int | None = None
    committed_position: int | None = None
    resumed_position: int | None = None
    aborted_position: int | None = None
    # Each participant's confirmed outcome of the decision (resumed, aborted, lost).
    finished: dict[str, str] = field(default_factory=dict)
    # Participants whose decided step spent its retry budget, with the reason (until they finish).
    stuck: dict[str, str] = field(default_factory=dict)


@with_config(_FORBID)
@dataclass(slots=True, kw_only=True)
class RestoreRecord:
    position: int
    cut_position: int | None
    checkpoint_id: str | None
    plan: dict[str, int]
    trainer_id: str | None = None
    # Only the trainer's coordinator process restarted (its state kept): nothing rolled back.
    claims_kept: bool = False


@with_config(_FORBID)
@dataclass(slots=True, kw_only=True)
class CheckpointsState:
    checkpoints: dict[str, CheckpointState] = field(default_factory=dict)
    restores: list[RestoreRecord] = field(default_factory=list)

    def last_committed(
        self, at_or_before: int | None = None, trainer_id: str | object | None = ANY_TRAINER
    ) -> CheckpointState | None:
        """The committed (or resumed) checkpoint with the highest cut, optionally no later than a position
        and of one trainer only."""
        best: CheckpointState | None = None
        for c in self.checkpoints.values():
            if c.cut_position is None or c.status not in ("committed", "resumed"):
                continue
            if trainer_id is not ANY_TRAINER and c.trainer_id != trainer_id:
                continue
            if at_or_before is not None and (c.committed_position or 0) > at_or_before:
                continue
            if best is None or c.cut_position > (best.cut_position or 0):
                best = c
        return best

    def abandoned_by(self, checkpoint: CheckpointState) -> RestoreRecord | None:
        """The restore that abandoned `checkpoint`'s branch, if one did: a later restore of its trainer
        to an earlier cut (or to none).  It rolled back the claims made between that cut and itself,
        some of them inside `checkpoint`'s cut, and the trainer went on from the earlier state: the
        state `checkpoint` saved holds groups the log has since let go of (and maybe delivered again).
        A restore that kept every claim (`claims_kept`) abandons nothing."""
        cut = checkpoint.cut_position
        if cut is None:
            return None
        for r in self.restores:
            if r.claims_kept or r.trainer_id != checkpoint.trainer_id:
                continue
            if r.position > cut and (r.cut_position or 0) < cut:
                return r
        return None

    def newest_kept(self, trainer_id: str | None) -> CheckpointState | None:
        """`trainer_id`'s committed checkpoint with the highest cut on the branch it goes on from: none
        a restore abandoned since (a higher cut on an abandoned branch is not where the trainer is)."""
        best: CheckpointState | None = None
        for c in self.checkpoints.values():
            if (
                c.cut_position is None
                or c.status not in ("committed", "resumed")
                or c.trainer_id != trainer_id
            ):
                continue
            if (best is None or c.cut_position > (best.cut_position or 0)) and self.abandoned_by(c) is None:
                best = c
        return best

    def in_doubt(self) -> list[CheckpointState]:
        """Prepare started, no decision recorded: presumed abort."""
        return [c for c in self.checkpoints.values() if c.status == "preparing"]

    def stuck(self) -> list[tuple[str, str, str]]:
        """(checkpoint, agent, reason) of every participant whose decided step is stuck."""
        return [
            (c.checkpoint_id, agent, reason)
            for c in self.checkpoints.values()
            for agent, reason in sorted(c.stuck.items())
        ]

    def to_resume(self) -> list[CheckpointState]:
        """Committed, agents maybe still paused: recovery finishes the commit and resumes them."""
        return [c for c in self.checkpoints.values() if c.status == "committed"]


class CheckpointsProjection(TypedProjection[CheckpointsState]):
    name: ClassVar[str] = "checkpoints"
    # 2: each restore's trainer and `claims_kept` (`RestoreRecord`), to tell an abandoned branch.
    version: ClassVar[int] = 2
    state_type: ClassVar[Any] = CheckpointsState
    handles: ClassVar[frozenset[type[Event]] | None] = frozenset(
        {
            CheckpointPrepareStarted,
            CheckpointCommitted,
            CheckpointResumed,
            CheckpointAborted,
            CheckpointParticipantFinished,
            CheckpointParticipantStuck,
            TrainerRestored,
        }
    )

    def initial(self) -> CheckpointsState:
        return CheckpointsState()

    def apply(self, state: CheckpointsState, event: RecordedEvent, decoded: Event) -> None:
        kind = type(decoded)
        if kind is CheckpointPrepareStarted:
            assert isinstance(decoded, CheckpointPrepareStarted)
            if decoded.checkpoint_id not in state.checkpoints:
                state.checkpoints[decoded.checkpoint_id] = CheckpointState(
                    checkpoint_id=decoded.checkpoint_id,
                    participants=list(decoded.participants),
                    trainer_id=decoded.trainer_id,
                    started_position=event.position,
                )
        elif kind is CheckpointCommitted:
            assert isinstance(decoded, CheckpointCommitted)
            c = _get(state, decoded.checkpoint_id, decoded.participants)
            if c.status == "preparing":
                c.status = "committed"
                c.cut_position = decoded.cut_position
                c.prepare_wait_s = dict(decoded.prepare_wait_s)
                c.committed_position = event.position
        elif kind is CheckpointResumed:
            assert isinstance(decoded, CheckpointResumed)
            c = _get(state, decoded.checkpoint_id, decoded.participants)
            if c.status == "committed":
                c.status = "resumed"
                c.resumed_position = event.position
        elif kind is CheckpointAborted:
            assert isinstance(decoded, CheckpointAborted)
            c = _get(state, decoded.checkpoint_id, decoded.participants)
            if c.status == "preparing":
                c.status = "aborted"
                c.abort_reason = decoded.reason
                c.prepare_wait_s = dict(decoded.prepare_wait_s)
                c.aborted_position = event.position
        elif kind is CheckpointParticipantFinished:
            assert isinstance(decoded, CheckpointParticipantFinished)
            c = _get(state, decoded.checkpoint_id, [])
            c.finished[decoded.agent_name] = decoded.outcome
            c.stuck.pop(decoded.agent_name, None)
        elif kind is CheckpointParticipantStuck:
            assert isinstance(decoded, CheckpointParticipantStuck)
            c = _get(state, decoded.checkpoint_id, [])
            if decoded.agent_name not in c.finished:
                c.stuck[decoded.agent_name] = f"{decoded.step}: {decoded.reason}"
        elif kind is TrainerRestored:
            assert isinstance(decoded, TrainerRestored)
            state.restores.append(
                RestoreRecord(
                    position=event.position,
                    cut_position=decoded.cut_position,
                    checkpoint_id=decoded.checkpoint_id,
                    plan=dict(decoded.plan),
                    trainer_id=decoded.trainer_id,
                    claims_kept=decoded.claims_kept,
                )
            )


def _get(state: CheckpointsState, checkpoint_id: str, participants: list[str]) -> CheckpointState:
    # A decision without a prepare in the log is kept (the auditor flags it) rather than dropped.
    found = state.checkpoints.get(checkpoint_id)
    if found is None:
        found = state.checkpoints[checkpoint_id] = CheckpointState(
            checkpoint_id=checkpoint_id, participants=list(participants)
        )
    return found
