"""A retire owed to an agent (docs/protocol.md, Retire debts): what its answers prove, what to record.

A try declared lost (trainer.core.attempt: its agent away past RETIRE_POLICY) may still be finished at
the agent, which then holds its result until someone releases it; a held result blocks the agent's
later checkpoints and is the stranded result the audit names.  So the loss records a debt
(`RetireOwed`), folded from the log like an ACK debt, and paid when the agent answers again:

    retire  --retired / tombstoned / done ---------> RetirePaid (the agent holds nothing of the try)
            --completed_unacknowledged ------------> fetch the try's receipt (it holds a finished result)
    receipt --of this try, from the process that --> RetirePaid released + ReceiptFetched + AckOwed: the
              answered the retire                    ACK relay pays it and the agent discards the result
                                                     (released, never adopted: the group is dead-lettered)
            --of another try or another process ---> failed (retired again: the agent may have restarted)
    retire refused by a checkpoint phase (409) ----> failed: called again after the wait
    the agent refuses this trainer (409 -----------> refused: no more calls to it; the retire stays owed
    trainer_conflict)                                in the log (trainer.core.refusal)
    a call failing in transport -------------------> failed: the agent's next call after a jittered wait
                                                     within RETIRE_OWED_POLICY; spent, reported stuck once
                                                     per spell (RetireDeliveryStuck) and called on at the
                                                     cap: a debt is never dropped here

A stray result is one an agent holds for a try the log has settled (`settled`: retired with the agent
holding nothing, sealed and ACKed, failed with its sibling moved on, archived): the agent restarted on
an empty state directory, its tombstones and its record of the ACK went with it, and a late `/run` of
the try (a stale process's, a duplicate delivery) ran it again.  Nothing else would release it (the
log's outcome of the try is final), so every later checkpoint would carry it.  Found in an agent's
status (`strays`), it is owed a retire like a lost try's, and paid the same way: the agent answers
`completed_unacknowledged`, the receipt is fetched and the ACK owed releases it (docs/protocol.md,
Stray results).

Paying twice is harmless: the agent's retire of a try it no longer holds answers done or tombstoned,
and an ACK it already accepted is accepted again (idempotent); the fold records the first payment.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, Literal, get_args

from eventstore.events import AckOwed, Event, ReceiptFetched, RetireOwed, RetirePaid, RetirePaidOutcome
from projections.ledger import LedgerState, debt_key
from projections.ownership import Driver, owner_of_try
from protocol.ids import capture_key, group_id_of
from protocol.retry import RetryPolicy, RetryState
from protocol.wire import AttemptRef, CompletionReceipt
from trainer.core.attempt import CallFailed, DriverRefused, RetireAnswer, RetireOutcome, RetireRefused
from trainer.core.debt import AckRetry, on_ack_failure

# One agent's owed retires failing (transport, a checkpoint phase in the way): jittered backoff within
# this budget, then reported stuck once and called at the cap from then on.  The cap bounds the probe
# an agent away for hours gets: one retire every 2.5-5 s.
RETIRE_OWED_POLICY = RetryPolicy(max_calls=16, deadline_s=60.0, base_s=0.05, cap_s=5.0)


# The retire answers after which the agent holds nothing of a try: a result of it found later is stray.
HELD_NOTHING: Final = frozenset(get_args(RetireOutcome))


def settled(ledger: LedgerState, rollout_id: str, attempt_index: int) -> bool:
    """Whether the log will never take a result of this try again: its group is archived; its result
    was taken (sealed or held, even if its round was discarded later); its agent answered its retire
    holding nothing; or it failed and its sibling moved on (a later try, a seal, the group
    dead-lettered)."""
    attempt = ledger.attempt(rollout_id, attempt_index)
    if attempt is None:
        return group_id_of(rollout_id) in ledger.archived
    if attempt.status in ("sealed", "held") or attempt.rollout_receipt is not None:
        return True
    if attempt.status in ("retired", "discarded"):
        return attempt.retire_outcome in HELD_NOTHING
    group = ledger.group_of(rollout_id)
    sibling = ledger.sibling(rollout_id)
    return (
        attempt.status == "failed"
        and group is not None
        and sibling is not None
        and (
            group.status == "dead_lettered"
            or sibling.status == "sealed"
            or sibling.current_attempt > attempt_index
        )
    )


def strays(
    ledger: LedgerState,
    driver: Driver,
    agent_name: str,
    incarnation: str,
    held: Sequence[AttemptRef],
    owed_before: frozenset[str] = frozenset(),
) -> list[RetireOwed]:
    """The retires owed for the stray results among `held`, the finished tries agent `agent_name`
    (process `incarnation`) reports holding: tries of this trainer's groups at that agent that the log
    settled (`settled`), with no ACK or retire owed for them, now or before the agent was asked
    (`owed_before`, debt keys: one paid meanwhile was held for that debt when the agent answered)."""
    acks, retires = ledger.debts.get(agent_name, {}), ledger.retires.get(agent_name, {})
    found: list[RetireOwed] = []
    for ref in held:
        rid, n = ref.rollout_id, ref.attempt_index
        key = debt_key(rid, n)
        if key in acks or key in retires or key in owed_before:
            continue
        owner = owner_of_try(ledger, rid)
        if owner is None or owner.agent_name != agent_name or not driver.drives(owner):
            continue
        if settled(ledger, rid, n):
            found.append(
                RetireOwed(
                    agent_name=agent_name, rollout_id=rid, attempt_index=n, execution_incarnation=incarnation
                )
            )
    return found


def owed_keys(ledger: LedgerState, agent_name: str) -> frozenset[str]:
    """The debt keys of every ACK and retire owed to `agent_name` (`strays`' `owed_before`)."""
    return frozenset(ledger.debts.get(agent_name, {})) | frozenset(ledger.retires.get(agent_name, {}))


@dataclass(frozen=True)
class OwedRetire:
    """One retire owed, as the ledger holds it (`projections.ledger.RetireDebt`)."""

    agent_name: str
    rollout_id: str
    attempt_index: int


@dataclass(frozen=True)
class RetireDebtStep:
    """`paid`: append `events`; `fetch_receipt`: the agent holds a finished result, ask it for the
    receipt (from `incarnation`, the process that answered); `failed`: `reason`, call again later;
    `refused`: the agent refuses this trainer (`reason` says so), call it no more."""

    verdict: Literal["paid", "fetch_receipt", "failed", "refused"]
    events: tuple[Event, ...] = ()
    reason: str = ""
    incarnation: str | None = None


def on_retire(
    owed: OwedRetire, got: RetireAnswer | RetireRefused | CallFailed | DriverRefused
) -> RetireDebtStep:
    """After one /retire of an owed try."""
    if isinstance(got, DriverRefused):
        return RetireDebtStep("refused", reason=got.message)
    if isinstance(got, CallFailed):
        return RetireDebtStep("failed", reason=got.error)
    if isinstance(got, RetireRefused):
        return RetireDebtStep("failed", reason=f"retire refused: {got.kind}")
    if got.completed_unacknowledged:
        return RetireDebtStep("fetch_receipt", incarnation=got.execution_incarnation)
    outcome: RetirePaidOutcome = "cancelled" if got.retired else "tombstoned" if got.tombstoned else "done"
    return RetireDebtStep("paid", (_paid(owed, outcome, got.execution_incarnation),))


def on_receipt(owed: OwedRetire, incarnation: str | None, receipt: CompletionReceipt) -> RetireDebtStep:
    """After the receipt fetch of an owed try the agent answered `completed_unacknowledged` for
    (from `incarnation`): owe the ACK of it, which releases the result, if it is this try's."""
    rid, n = owed.rollout_id, owed.attempt_index
    if (
        receipt.rollout_id != rid
        or receipt.attempt_index != n
        or receipt.manifest_capture_key != capture_key(rid, n)
    ):
        return RetireDebtStep("failed", reason=f"the receipt fetched for {rid}#{n} names another try")
    if incarnation is not None and receipt.execution_incarnation != incarnation:
        return RetireDebtStep(
            "failed",
            reason=(
                f"the receipt of {rid}#{n} is from agent incarnation {receipt.execution_incarnation}, "
                f"retire was answered by {incarnation}"
            ),
        )
    return RetireDebtStep(
        "paid",
        (
            ReceiptFetched(agent_name=owed.agent_name, receipt=receipt),
            AckOwed(agent_name=owed.agent_name, receipt=receipt),
            _paid(owed, "released", receipt.execution_incarnation),
        ),
    )


def on_failure(
    state: RetryState, now: float, jitter: float, error: str, policy: RetryPolicy = RETIRE_OWED_POLICY
) -> AckRetry:
    """After a failed owed retire: the same budget shape as an ACK's (trainer.core.debt)."""
    return on_ack_failure(state, now, jitter, error, policy)


def _paid(owed: OwedRetire, outcome: RetirePaidOutcome, incarnation: str | None) -> RetirePaid:
    return RetirePaid(
        rollout_id=owed.rollout_id,
        attempt_index=owed.attempt_index,
        outcome=outcome,
        execution_incarnation=incarnation,
    )
