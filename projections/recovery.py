"""The recovery view of the log: `RolloutRecoveryState` (the snapshot) and the restore plan (docs/protocol.md, Recovery).

Both are derived, purely, from the ledger and checkpoints projections: the
snapshot is the ledger's state in one pydantic model, and the plan is what a
restarted trainer must do, in order, before it goes on:

1. flush every unpaid ACK debt (the receipts are in the log);
2. settle each unsealed try the Gym agent may still hold: retire it, adopt it
   if it finished, dispatch it if it never left the trainer;
3. mint replacements for siblings whose try is settled without a result
   (sibling mode) and rerun unsealed groups whole (prompt_group mode), or
   dead-letter what has spent its retry budget;
4. presume abort for checkpoints that never committed, finish (resume) those
   that did;
5. roll back the claims made after the last committed cut (`TrainerRestored`).
"""

from __future__ import annotations

from typing import Final, Literal

from pydantic import BaseModel, ConfigDict, Field

from projections.base import canonical, sha256_text
from projections.checkpoints import CheckpointsState, CheckpointState
from projections.group_core import (
    AttemptAction,
    attempt_action,
    continuation_to_resume,
    round_step,
    sibling_exhausted,
)
from projections.ledger import ArchivedGroup, AttemptState, GroupState, LedgerState, restorable_cut
from projections.ownership import trainer_debts
from protocol.ids import rollout_id_of
from protocol.wire import AcknowledgeItem, CompletionReceipt, ContinuationRef

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


class AttemptToSettle(_Model):
    """A try the agent may still run or hold.  `adopt`: it finished (a reply or a
    `completed_unacknowledged` answer is in the log); `retire_or_adopt`: ask the
    agent with retire first; `dispatch`: minted but never sent, so send it as is."""

    group_id: str
    rollout_id: str
    generation_index: int
    attempt_index: int
    agent_name: str
    capture_key: str | None
    status: str
    action: AttemptAction


class SiblingToReplace(_Model):
    """A sibling to mint a try for: a replacement of `replaces`, or (None) its first try, never minted."""

    group_id: str
    rollout_id: str
    generation_index: int
    replaces: int | None
    next_attempt: int
    # At target level turn: the boundary the replacement resumes (the replaced try's offer, by the
    # drivers' own rule `continuation_to_resume`); None: it plays from its prompt.
    continues: ContinuationRef | None = None


class ClaimToRollBack(_Model):
    group_id: str
    train_step: int | None
    position: int


class RestoreRefused(ValueError):
    """The checkpoint a trainer says it restored to is not one the log can restore it to (one line)."""


class RecoveryPlan(_Model):
    position: int
    debts_to_flush: dict[str, list[CompletionReceipt]]
    attempts_to_settle: list[AttemptToSettle]
    siblings_to_replace: list[SiblingToReplace]
    groups_to_rerun: list[str]
    groups_to_dead_letter: list[str]
    sealed_kept: list[str]
    checkpoints_to_abort: list[str]
    checkpoints_to_resume: list[str]
    claims_to_roll_back: list[ClaimToRollBack]
    cut_position: int | None
    checkpoint_id: str | None
    # The trainer kept its state (only its coordinator's process restarted): no claim rolls back.
    claims_kept: bool = False

    def summary(self) -> dict[str, int]:
        """Counts for the `TrainerRestored.plan` field."""
        return {
            # The log position the plan was made at: other writers may append before it is recorded.
            "as_of_position": self.position,
            "debts_to_flush": sum(len(v) for v in self.debts_to_flush.values()),
            "attempts_to_settle": len(self.attempts_to_settle),
            "siblings_to_replace": len(self.siblings_to_replace),
            # Of those, the replacements that resume a committed turn boundary, and the turns they keep.
            "replacements_resuming": sum(1 for s in self.siblings_to_replace if s.continues is not None),
            "turns_kept": sum(s.continues.turn for s in self.siblings_to_replace if s.continues is not None),
            "groups_to_rerun": len(self.groups_to_rerun),
            "groups_to_dead_letter": len(self.groups_to_dead_letter),
            "sealed_kept": len(self.sealed_kept),
            "checkpoints_to_abort": len(self.checkpoints_to_abort),
            "checkpoints_to_resume": len(self.checkpoints_to_resume),
            "claims_to_roll_back": len(self.claims_to_roll_back),
        }


def _settle_action(attempt: AttemptState) -> AttemptAction | None:
    return attempt_action(attempt)


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


def plan_recovery(
    ledger: LedgerState,
    checkpoints: CheckpointsState,
    trainer_id: str | None = None,
    *,
    restore_to: str | None = None,
    claims_kept: bool = False,
) -> RecoveryPlan:
    """The restore plan of one trainer: only its own groups and checkpoints (`trainer_id`).

    `restore_to`: the checkpoint the trainer loaded (None: its newest committed one); the claims
    after its cut roll back.  `claims_kept`: the trainer kept its state (only the process of its
    coordinator restarted), so no claim rolls back.  `RestoreRefused` for a checkpoint the log
    cannot restore it to."""
    settle: list[AttemptToSettle] = []
    replace: list[SiblingToReplace] = []
    rerun: list[str] = []
    dead: list[str] = []
    sealed: list[str] = []
    for group in ledger.groups.values():
        if group.trainer_id != trainer_id:
            continue
        if group.status == "sealed":
            sealed.append(group.group_id)
            continue
        if group.status != "open":
            continue
        if group.mode == "sibling":
            _plan_sibling_group(group, settle, replace, dead)
        else:
            _plan_prompt_group(group, settle, rerun, dead)

    last = None if claims_kept else restore_point(ledger, checkpoints, trainer_id, restore_to)
    cut = last.cut_position if last is not None else None
    bound = cut if cut is not None else 0
    every: list[GroupState | ArchivedGroup] = [*ledger.groups.values(), *ledger.archived.values()]
    holders = [g for g in every if g.trainer_id == trainer_id]
    rollback = [
        ClaimToRollBack(group_id=g.group_id, train_step=c.train_step, position=c.position)
        for g in holders
        for c in g.claims
        if c.position > bound and not claims_kept
    ]
    return RecoveryPlan(
        position=ledger.position,
        # Only this trainer's: another trainer's debt to an agent of the same name is not its to pay.
        debts_to_flush=trainer_debts(ledger, trainer_id),
        attempts_to_settle=settle,
        siblings_to_replace=replace,
        groups_to_rerun=rerun,
        groups_to_dead_letter=dead,
        sealed_kept=sealed,
        checkpoints_to_abort=[c.checkpoint_id for c in checkpoints.in_doubt() if c.trainer_id == trainer_id],
        checkpoints_to_resume=[
            c.checkpoint_id for c in checkpoints.to_resume() if c.trainer_id == trainer_id
        ],
        claims_to_roll_back=sorted(rollback, key=lambda c: c.position),
        cut_position=cut,
        checkpoint_id=last.checkpoint_id if last is not None else None,
        claims_kept=claims_kept,
    )


def _attempt_to_settle(
    group: GroupState, generation_index: int, attempt: AttemptState, action: AttemptAction
) -> AttemptToSettle:
    return AttemptToSettle(
        group_id=group.group_id,
        rollout_id=attempt.rollout_id,
        generation_index=generation_index,
        attempt_index=attempt.attempt_index,
        agent_name=attempt.agent_name or group.agent_name,
        capture_key=attempt.capture_key,
        status=attempt.status,
        action=action,
    )


def _plan_sibling_group(
    group: GroupState, settle: list[AttemptToSettle], replace: list[SiblingToReplace], dead: list[str]
) -> None:
    exhausted = False
    for index in range(group.expected_generations):
        if index not in group.siblings:
            replace.append(
                SiblingToReplace(
                    group_id=group.group_id,
                    rollout_id=rollout_id_of(group.group_id, index),
                    generation_index=index,
                    replaces=None,
                    next_attempt=0,
                )
            )
    for index in sorted(group.siblings):
        sibling = group.siblings[index]
        attempt = sibling.current
        if sibling.status == "sealed" or attempt is None:
            continue
        action = _settle_action(attempt)
        if action is not None:
            settle.append(_attempt_to_settle(group, index, attempt, action))
        elif attempt.status in ("retired", "discarded"):
            if sibling_exhausted(group, sibling) is not None:
                exhausted = True
            else:
                replace.append(
                    SiblingToReplace(
                        group_id=group.group_id,
                        rollout_id=sibling.rollout_id,
                        generation_index=index,
                        replaces=attempt.attempt_index,
                        next_attempt=attempt.attempt_index + 1,
                        continues=continuation_to_resume(group, attempt),
                    )
                )
    if exhausted:
        dead.append(group.group_id)


def _plan_prompt_group(
    group: GroupState, settle: list[AttemptToSettle], rerun: list[str], dead: list[str]
) -> None:
    # The driver's own rule (projections.group_core.round_step): a round a crash interrupted is
    # continued (its tries settled, adopted when finished); it is rerun whole only once one of its
    # siblings settled without a result, or dead-lettered when a budget is spent.
    step = round_step(group)
    for index, attempt, action in step.settle:
        settle.append(_attempt_to_settle(group, index, attempt, action))
    if step.verdict == "dead_letter":
        dead.append(group.group_id)
    elif step.verdict == "rerun":
        rerun.append(group.group_id)
