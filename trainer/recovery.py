"""Rebuilding a coordinator from the log and carrying on (docs/protocol.md, Recovery).

Nothing is restored from a private file: the ledger and checkpoint projections are folded from the
log and the restore plan is derived from them alone (`trainer.core.recovery.plan_recovery`).  The
plan is then carried out: undecided checkpoints are aborted (presumed abort) and committed ones
finished; `TrainerRestored` records the cut and the plan's summary (claims after the cut roll back
with it); every group the plan names goes through the same door `submit` uses (`Groups.drive`), whose
driver retires or adopts each attempt left in flight before anything new is minted, or dead-letters
what has spent its budget.  The unpaid debts of the plan are sent by the ACK relay from the log.
"""

from __future__ import annotations

from eventstore.events import GroupTakenOver, TrainerRestored
from protocol.streams import group_stream, trainer_stream
from trainer.acks import AckRelay
from trainer.checkpoints import Finisher
from trainer.core.recovery import RecoveryPlan, plan_recovery
from trainer.groups import Groups
from trainer.journal import Journal
from trainer.settings import Settings, log


def groups_to_drive(plan: RecoveryPlan) -> list[str]:
    """Every group the plan has work for, in a stable order."""
    named = {t.group_id for t in plan.attempts_to_settle}
    named |= {s.group_id for s in plan.siblings_to_replace}
    named |= set(plan.groups_to_rerun) | set(plan.groups_to_dead_letter)
    return sorted(named)


async def recover(
    journal: Journal,
    settings: Settings,
    groups: Groups,
    finisher: Finisher,
    acks: AckRelay,
    *,
    restore_to: str | None = None,
    claims_kept: bool = False,
) -> RecoveryPlan:
    """Carries out the restore plan of a started coordinator's parts (its epoch taken, the log
    folded).  `RestoreRefused` for a checkpoint the log cannot restore it to (nothing written)."""
    trainer_id = settings.trainer_id
    plan = plan_recovery(
        journal.ledger, journal.checkpoints, trainer_id, restore_to=restore_to, claims_kept=claims_kept
    )
    to_drive = groups_to_drive(plan)
    # Every open group has work the plan names; one it missed would sit open for ever, so drive it too.
    missed = sorted(set(groups.open_groups()) - set(to_drive))
    if missed:
        log.warning("recovery plan names no work for open groups %s; driving them anyway", missed)
    # Fence the previous owner off every group before acting on any of them.
    for gid in [*to_drive, *missed]:
        await journal.take_over(
            group_stream(gid), GroupTakenOver(group_id=gid, trainer_id=trainer_id, reason="trainer recovery")
        )
    await finisher.recover(plan.checkpoints_to_abort, plan.checkpoints_to_resume)
    await journal.append(
        trainer_stream(trainer_id),
        [
            TrainerRestored(
                cut_position=plan.cut_position or 0,
                checkpoint_id=plan.checkpoint_id,
                plan=plan.summary(),
                trainer_id=trainer_id,
                claims_kept=plan.claims_kept,
            )
        ],
    )
    log.info("trainer %s restored from the log: %s", trainer_id or "(default)", plan.summary())
    acks.wake()
    for gid in [*to_drive, *missed]:
        groups.drive(gid)
    return plan
