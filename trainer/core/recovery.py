"""The restore plan: what a restarted trainer must do, in order, before it goes on (docs/protocol.md,
Recovery), derived purely from the ledger and checkpoints projections:

1. flush every unpaid ACK debt (the receipts are in the log);
2. settle each unsealed attempt the Gym agent may still hold: retire it, adopt it if it finished,
   dispatch it if it never left the trainer;
3. mint replacements for siblings whose attempt is settled without a result, rerun prompt groups
   whose round is given up, or dead-letter what has spent its retry budget: what the group drivers'
   own decision says (`trainer.core.group.sibling_next`, `round_next`), so a plan and what a driver
   does cannot disagree;
4. presume abort for checkpoints that never committed, finish (resume) those that did;
5. roll back the claims made after the restore point's cut (`TrainerRestored`).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from eventstore.events import ReplacementMinted
from projections.checkpoints import CheckpointsState
from projections.ledger import ArchivedGroup, AttemptState, GroupState, LedgerState
from projections.ownership import trainer_debts
from projections.recovery import restore_point
from protocol.ids import rollout_id_of
from protocol.wire import CompletionReceipt, ContinuationRef
from trainer.core.budget import AttemptAction, round_exhausted
from trainer.core.group import Decision, round_next, sibling_next


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


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
    """A sibling to mint an attempt for: a replacement of `replaces`, or (None) its first attempt, never minted."""

    group_id: str
    rollout_id: str
    generation_index: int
    replaces: int | None
    next_attempt: int
    # At target level turn: the boundary the replacement resumes (the replaced attempt's offer, by the
    # drivers' own rule `continuation_to_resume`); None: it plays from its prompt.
    continues: ContinuationRef | None = None


class ClaimToRollBack(_Model):
    group_id: str
    train_step: int | None
    position: int


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
            _plan_prompt_group(group, settle, replace, rerun, dead)

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
    exhausted = False
    for index in sorted(group.siblings):
        decision = sibling_next(group, index)
        exhausted = exhausted or decision.move == "dead_letter"
        _planned(group, decision, settle, replace)
    if exhausted:
        dead.append(group.group_id)


def _plan_prompt_group(
    group: GroupState,
    settle: list[AttemptToSettle],
    replace: list[SiblingToReplace],
    rerun: list[str],
    dead: list[str],
) -> None:
    decision = round_next(group)
    _planned(group, decision, settle, replace)
    if decision.move == "give_up":
        # Given up: its attempts still out are settled first, then it is rerun whole, or dead-lettered
        # when the rounds so far spent a budget.
        (dead if round_exhausted(group) is not None else rerun).append(group.group_id)


def _planned(
    group: GroupState, decision: Decision, settle: list[AttemptToSettle], replace: list[SiblingToReplace]
) -> None:
    """A driver's decision as the plan lists it: the attempts it settles, the replacements it mints."""
    # A replacement's own attempt is settled once minted: the plan lists the replacement.
    for index, action in decision.settle if decision.move in ("settle", "give_up") else ():
        attempt = group.siblings[index].current
        if attempt is not None and not (decision.move == "give_up" and action == "dispatch"):
            settle.append(_attempt_to_settle(group, index, attempt, action))
    for event in decision.events:
        if isinstance(event, ReplacementMinted):
            replace.append(
                SiblingToReplace(
                    group_id=group.group_id,
                    rollout_id=event.rollout_id,
                    generation_index=event.generation_index,
                    replaces=event.replaces,
                    next_attempt=event.attempt_index,
                    continues=event.continues,
                )
            )
