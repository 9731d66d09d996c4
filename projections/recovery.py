"""The recovery view of the log (docs/protocol.md, Recovery): `RolloutRecoveryState`, the snapshot (the
ledger's state in one pydantic model, derived purely from the ledger and checkpoints projections), and
the checkpoint a restarted trainer restores to (`restore_point`).  The plan a restarted trainer carries
out is `trainer.core.recovery.plan_recovery`, which asks the group drivers' own decisions."""

from __future__ import annotations

from typing import Final, Literal

from pydantic import BaseModel, ConfigDict, Field

from projections.base import canonical, sha256_text
from projections.checkpoints import CheckpointsState, CheckpointState
from projections.ledger import ArchivedGroup, GroupState, LedgerState, restorable_cut
from protocol.wire import AcknowledgeItem

RECOVERY_SCHEMA_VERSION: Final = 1
RecoverySchemaVersion = Literal[1]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RolloutRecoveryState(_Model):
    """The saved rollout state as of `position`: what the trainer owns, holds and owes."""

    schema_version: RecoverySchemaVersion = Field(default=RECOVERY_SCHEMA_VERSION, validate_default=True)
    position: int
    groups: dict[str, GroupState]
    archived_groups: dict[str, ArchivedGroup]
    pending_acks: list[AcknowledgeItem]
    last_checkpoint: CheckpointState | None

    @classmethod
    def of(cls, ledger: LedgerState, checkpoints: CheckpointsState | None = None) -> RolloutRecoveryState:
        # Nested values are the ledger's own dataclasses, already of the right shape: no re-validation.
        return cls.model_construct(
            schema_version=RECOVERY_SCHEMA_VERSION,
            position=ledger.position,
            groups=ledger.groups,
            archived_groups=ledger.archived,
            pending_acks=[
                AcknowledgeItem.model_construct(agent_name=a, receipt=r) for a, r in ledger.unpaid_debts()
            ],
            last_checkpoint=checkpoints.last_committed() if checkpoints is not None else None,
        )

    def state_hash(self) -> str:
        return sha256_text(canonical(self.model_dump(mode="json")))


# --- the restore plan ----------------------------------------------------------------


class RestoreRefused(ValueError):
    """The checkpoint a trainer says it restored to is not one the log can restore it to (one line)."""


def restore_point(
    ledger: LedgerState,
    checkpoints: CheckpointsState,
    trainer_id: str | None,
    restore_to: str | None,
) -> CheckpointState | None:
    """The checkpoint a trainer restores to: `restore_to` (the one it loaded), checked, or (None) its
    newest committed one on the branch it went on from (none a restore abandoned).  `RestoreRefused`
    when the log cannot restore it there."""
    newest = checkpoints.newest_kept(trainer_id)
    if restore_to is None:
        return newest
    named = checkpoints.checkpoints.get(restore_to)
    who = f"trainer {trainer_id!r}" if trainer_id is not None else "the unnamed trainer"
    if named is None:
        raise RestoreRefused(
            f"checkpoint {restore_to!r} is not in the log: the trainer's checkpoint was saved without "
            f"this log (newest of {who} here: {newest.checkpoint_id if newest else 'none'})"
        )
    if named.trainer_id != trainer_id:
        raise RestoreRefused(
            f"checkpoint {restore_to!r} belongs to trainer {named.trainer_id!r}, not to {who}"
        )
    if named.status not in ("committed", "resumed") or named.cut_position is None:
        raise RestoreRefused(
            f"checkpoint {restore_to!r} is {named.status} in the log, not committed: the trainer "
            "restored to a save the log never decided"
        )
    abandoned = checkpoints.abandoned_by(named)
    if abandoned is not None:
        # Its state trained groups whose claims that restore rolled back (and the run may have handed
        # them out again since): restoring it would train them twice.  NeMo RL's own checkpoints are
        # one line, each `step_N` the newest save of step N; this one is a save the run left behind.
        back_to = abandoned.checkpoint_id or "no checkpoint"
        raise RestoreRefused(
            f"checkpoint {restore_to!r} (cut {named.cut_position}) is on a branch the trainer abandoned: "
            f"its restore to {back_to} (cut {abandoned.cut_position or 0}, log position "
            f"{abandoned.position}) rolled back claims this state trained on, and the run went on from "
            f"there; load the trainer's newest checkpoint ({newest.checkpoint_id if newest else 'none'}) "
            "or one at or before that restore's cut"
        )
    if not restorable_cut(ledger, trainer_id, named.cut_position):
        raise RestoreRefused(
            f"checkpoint {restore_to!r} (cut {named.cut_position}) is older than the log can restore "
            f"{who} to: groups claimed after it are archived by its later checkpoints "
            f"(newest {newest.checkpoint_id if newest else 'none'}); load one of the two newest"
        )
    return named
