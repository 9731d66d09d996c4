"""Rebuilding a coordinator from the log and carrying on (protocol.md §9).

Nothing is restored from a private file: the ledger and checkpoint projections are folded from the
log; undecided checkpoints are aborted (presumed abort) and committed ones finished; claims after
the last committed cut are rolled back with `TrainerRestored`; every open group gets its driver
again, which retires or adopts each try left in flight before anything new is minted.  Unpaid debts
are sent by the relay from the log.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from eventstore.events import TrainerRestored
from workers.rollout.context import log

if TYPE_CHECKING:
    from workers.rollout.coordinator import RolloutCoordinator

TRAINER_STREAM = "trainer"


async def recover(coord: RolloutCoordinator) -> RolloutCoordinator:
    await coord.start()
    checkpoints = await coord.checkpointer.recover()
    ledger = coord.ledger
    last = coord.journal.checkpoints.last_committed()
    cut = last.cut_position if last is not None else 0
    rolled_back = sum(1 for g in ledger.groups.values() if g.claims and g.claims[-1].position > (cut or 0))
    open_groups = coord.open_groups()
    in_flight = sum(
        1
        for gid in open_groups
        for s in ledger.groups[gid].siblings.values()
        if s.status != "sealed"
        and (a := s.attempts.get(s.current_attempt)) is not None
        and a.status != "minted"
    )
    plan = {
        "open_groups": len(open_groups),
        "tries_to_settle": in_flight,
        "unpaid_debts": len(ledger.unpaid_debts()),
        "claims_rolled_back": rolled_back,
        "checkpoints_aborted": checkpoints["aborted"],
        "checkpoints_resumed": checkpoints["resumed"],
    }
    await coord.journal.append(
        TRAINER_STREAM,
        [TrainerRestored(cut_position=cut, checkpoint_id=last.checkpoint_id if last else None, plan=plan)],
    )
    log.info("trainer restored from the log: %s", plan)
    coord.ctx.ack_wakeup.set()
    for gid in open_groups:
        coord._drive(gid)
    return coord
