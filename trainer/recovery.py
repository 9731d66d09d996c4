"""Rebuilding a coordinator from the log and carrying on (docs/protocol.md, Recovery).

Nothing is restored from a private file: the ledger and checkpoint projections are folded from the
log and the restore plan is derived from them alone (`projections.recovery.plan_recovery`).  The
plan is then carried out: undecided checkpoints are aborted (presumed abort) and committed ones
finished; `TrainerRestored` records the cut and the plan's summary (claims after the cut roll back
with it); every group the plan names gets its driver again, which retires or adopts each try left
in flight before anything new is minted, or dead-letters what has spent its budget.  The unpaid
debts of the plan are sent by the relay from the log.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from eventstore.events import GroupTakenOver, TrainerRestored
from projections.recovery import RecoveryPlan, RestoreRefused, plan_recovery
from protocol.streams import group_stream, trainer_stream
from trainer.context import log

if TYPE_CHECKING:
    from trainer.coordinator import RolloutCoordinator


def groups_to_drive(plan: RecoveryPlan) -> list[str]:
    """Every group the plan has work for, in a stable order."""
    named = {t.group_id for t in plan.attempts_to_settle}
    named |= {s.group_id for s in plan.siblings_to_replace}
    named |= set(plan.groups_to_rerun) | set(plan.groups_to_dead_letter)
    return sorted(named)


async def recover(
    coord: RolloutCoordinator, *, restore_to: str | None = None, claims_kept: bool = False
) -> RolloutCoordinator:
    await coord.start()
    journal = coord.journal
    trainer_id = coord.settings.trainer_id
    try:
        plan = plan_recovery(
            journal.ledger, journal.checkpoints, trainer_id, restore_to=restore_to, claims_kept=claims_kept
        )
    except RestoreRefused:
        await coord.close()
        raise
    groups = groups_to_drive(plan)
    # Every open group has work the plan names; one it missed would sit open for ever, so drive it too.
    missed = sorted(set(coord.open_groups()) - set(groups))
    if missed:
        log.warning("recovery plan names no work for open groups %s; driving them anyway", missed)
    # Fence the previous owner off every group before acting on any of them.
    for gid in [*groups, *missed]:
        await journal.take_over(
            group_stream(gid), GroupTakenOver(group_id=gid, trainer_id=trainer_id, reason="trainer recovery")
        )
    await coord.checkpointer.recover(plan.checkpoints_to_abort, plan.checkpoints_to_resume)
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
    coord.ctx.ack_wakeup.set()
    for gid in [*groups, *missed]:
        coord._drive(gid)
    return coord
