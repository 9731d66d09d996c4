"""An ACK debt: what the agent's answer to one acknowledged receipt proves, and what to record.

    accepted                                   -> AckAccepted (paid)
    receipt_mismatch                           -> AckRejected, then the receipt is fetched again
    unknown_execution, agent not known         -> ask the agent's status first, record nothing yet
    unknown_execution, another incarnation     -> AckRejected with that incarnation: the debt drops
                                                  (the process that made the receipt is gone, and the
                                                  result with it)
    unknown_execution, the same incarnation    -> AckRejected with that incarnation: the debt stays
                                                  owed, is not resent in a loop, and the operator is
                                                  told (a wrong agent behind the client, or a lie)

    operator drop, debt owed                   -> AckRejected dropped_by_operator with the operator's
                                                  mark (`ledger debt drop`): the debt drops
    operator drop, no ACK debt, a retire owed  -> RetirePaid dropped_by_operator with the mark: the
                                                  agent is gone for good, nothing left to release
    operator drop, no such debt owed           -> refused, nothing recorded

A debt is dropped only on evidence (another incarnation) or by an operator, by the rule the folds apply
(`projections.ledger.debt_dropped_by`, the one copy), so the log alone shows why each debt left.
Incarnations are compared for equality only: no clock and no lost state directory can make a new
process look older than the receipt's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from eventstore.events import AckAccepted, AckRejected, Event, OperatorMark, RetirePaid
from projections.ledger import RetireDebt, debt_dropped_by, debt_key
from protocol import mutants
from protocol.retry import RetryPolicy, RetryState, next_step
from protocol.wire import AcknowledgeResult, CompletionReceipt

# One agent's /acknowledge failing in transport (away, 5xx, garbage): jittered backoff within this
# budget; spent, the agent is reported stuck once and called at the longest wait from then on (its
# debts stay owed in the log: only the agent's answer, its restart or an operator ends them).
ACK_POLICY = RetryPolicy(max_calls=16, deadline_s=60.0, base_s=0.05, cap_s=2.0)


@dataclass(frozen=True)
class AckRetry:
    """After a failed /acknowledge: the wait before the next call, and `stuck` once the budget is
    spent (the shell reports that once per spell; the calls go on at the longest wait)."""

    state: RetryState
    delay_s: float
    stuck: bool = False
    reason: str = ""


def on_ack_failure(
    state: RetryState, now: float, jitter: float, error: str, policy: RetryPolicy = ACK_POLICY
) -> AckRetry:
    failed = state.failed(now, error)
    verdict = next_step(policy, failed, now, jitter)
    if verdict.kind == "retry":
        return AckRetry(failed, verdict.delay_s)
    return AckRetry(failed, policy.cap_s * (0.5 + jitter / 2), True, verdict.reason)


@dataclass(frozen=True)
class DebtStep:
    verdict: Literal["paid", "refetch", "need_agent", "dropped", "kept", "unknown"]
    events: tuple[Event, ...] = ()
    reason: str = ""


@dataclass(frozen=True)
class AgentSeen:
    """The agent process that answered, as its `/status` named it."""

    incarnation: str
    generation: int | None = None


def on_ack(receipt: CompletionReceipt, result: AcknowledgeResult, agent: AgentSeen | None) -> DebtStep:
    rid, n = receipt.rollout_id, receipt.attempt_index
    if result.acknowledged:
        return DebtStep("paid", (AckAccepted(rollout_id=rid, attempt_index=n, idempotent=result.idempotent),))
    error = result.error or "receipt_mismatch"
    if error == "unknown_execution" and mutants.active("debt_dropped_without_evidence"):
        return DebtStep("dropped", (AckRejected(rollout_id=rid, attempt_index=n, error=error),))
    if error == "unknown_execution" and agent is None:
        return DebtStep("need_agent")
    rejected = AckRejected(
        rollout_id=rid,
        attempt_index=n,
        error=error,
        agent_generation=agent.generation if agent is not None else None,
        agent_incarnation=agent.incarnation if agent is not None else None,
    )
    if error == "receipt_mismatch":
        return DebtStep("refetch", (rejected,))
    assert agent is not None
    if debt_dropped_by(rejected, receipt):
        return DebtStep("dropped", (rejected,), f"the agent restarted (incarnation {agent.incarnation})")
    return DebtStep(
        "kept",
        (rejected,),
        f"the agent process that made the receipt of {rid}#{n} (incarnation {agent.incarnation}) denies "
        "it: the debt stays owed (a different agent behind this client?); "
        f"if it can never be paid: ledger debt drop {rid} {n} --reason ...",
    )


@dataclass(frozen=True)
class OperatorDrop:
    """An operator's drop of one debt, decided: the agent it was owed to and the event to append."""

    step: DebtStep
    agent_name: str | None = None
    receipt: CompletionReceipt | None = None


def on_operator_drop(
    debts: Mapping[str, Mapping[str, CompletionReceipt]],
    rollout_id: str,
    attempt_index: int,
    agent_name: str | None,
    mark: OperatorMark,
    retires: Mapping[str, Mapping[str, RetireDebt]] | None = None,
) -> OperatorDrop:
    """`debts`: the ledger's unpaid debts (agent -> debt key -> receipt); `retires`: its retires owed
    (agent -> debt key).  Only a debt the log holds unpaid can be dropped: the try's ACK debt, else the
    retire owed for it (the agent is gone for good: nothing left there to release); anything else is
    refused with nothing to record."""
    key = debt_key(rollout_id, attempt_index)
    acks = _owed_to(debts, key, agent_name)
    retires_owed = [] if acks else _owed_to(retires or {}, key, agent_name)
    event: Event
    receipt: CompletionReceipt | None
    if acks:
        owner, receipt = acks[0], debts[acks[0]][key]
        event = AckRejected(
            rollout_id=rollout_id, attempt_index=attempt_index, error="dropped_by_operator", operator=mark
        )
    elif retires_owed:
        owner, receipt = retires_owed[0], None
        event = RetirePaid(
            rollout_id=rollout_id, attempt_index=attempt_index, outcome="dropped_by_operator", operator=mark
        )
    else:
        to = f" to agent {agent_name!r}" if agent_name is not None else ""
        return OperatorDrop(
            DebtStep(
                "unknown",
                reason=f"no unpaid ACK debt and no retire owed for {rollout_id}#{attempt_index}{to}",
            )
        )
    return OperatorDrop(
        DebtStep("dropped", (event,), f"dropped by {mark.operator}: {mark.reason}"), owner, receipt
    )


def _owed_to(
    owed_by_agent: Mapping[str, Mapping[str, object]], key: str, agent_name: str | None
) -> list[str]:
    """The agents (`agent_name` alone, if given) the log owes `key` to."""
    return [a for a, owed in owed_by_agent.items() if key in owed and agent_name in (None, a)]
