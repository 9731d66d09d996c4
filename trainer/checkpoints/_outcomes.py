"""What a checkpoint's phases hand back: the prepared checkpoint awaiting its decision, and the outcome."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from projections.ledger import debt_key
from protocol.wire import AttemptRef


@dataclass
class CheckpointOutcome:
    checkpoint_id: str
    outcome: Literal["committed", "aborted"]
    cut_position: int | None
    prepare_wait_s: dict[str, float]
    reason: str = ""
    adopted: int = 0
    retired: int = 0
    acked_during_prepare: int = 0
    # Finished, unACKed attempts the agents carried across the checkpoint (paid after the decision).
    carried: int = 0
    # Participants still being driven to the decision in the background (their step is stuck).
    stuck: list[str] = field(default_factory=list)
    # Participants that showed they lost the checkpoint (the log keeps it committed, not resumed).
    lost: list[str] = field(default_factory=list)

    @property
    def committed(self) -> bool:
        return self.outcome == "committed"


@dataclass(frozen=True)
class PreparedCheckpoint:
    """A checkpoint every participant prepared, with no decision in the log yet.

    Each agent is `prepared`: its admission is closed and nothing of it runs or is owed.  The trainer
    saves its own state now and then decides promptly (`commit` or `abort`): until then no rollout
    progresses at the participants.  Never decided, it is presumed aborted (when the coordinator closes,
    or by recovery after a crash).
    """

    checkpoint_id: str
    participants: list[str]
    prepare_wait_s: dict[str, float]
    adopted: int = 0
    retired: int = 0
    acked_during_prepare: int = 0
    # Per participant: the finished, unACKed attempts its prepare carried (CheckpointCommitted.carried).
    carried: dict[str, list[AttemptRef]] = field(default_factory=dict)

    def carried_keys(self) -> dict[str, frozenset[str]]:
        return {
            a: frozenset(debt_key(r.rollout_id, r.attempt_index) for r in refs)
            for a, refs in self.carried.items()
        }

    def outcome(
        self,
        outcome: Literal["committed", "aborted"],
        cut_position: int | None,
        reason: str,
        ends: dict[str, str],
    ) -> CheckpointOutcome:
        return CheckpointOutcome(
            self.checkpoint_id,
            outcome,
            cut_position,
            self.prepare_wait_s,
            reason,
            self.adopted,
            self.retired,
            self.acked_during_prepare,
            sum(len(refs) for refs in self.carried.values()),
            stuck=sorted(a for a, e in ends.items() if e == "stuck"),
            lost=sorted(a for a, e in ends.items() if e == "lost"),
        )
