"""An ACK debt: what the agent's answer to one acknowledged receipt proves, and what to record.

    accepted                                   -> AckAccepted (paid)
    receipt_mismatch                           -> AckRejected, then the receipt is fetched again
    unknown_execution, generation not known    -> ask the agent's status first, record nothing yet
    unknown_execution, agent generation newer  -> AckRejected with that generation: the debt drops
                                                  (the agent restarted and lost the result)
    unknown_execution, same or older generation-> AckRejected with that generation: the debt stays
                                                  owed, is not resent in a loop, and the operator is
                                                  told (a wrong agent behind the client, or a lie)

A debt is dropped only on evidence (a newer generation) or by an operator; the fold applies the same
rule (`projections.ledger.debt_dropped_by`), so the log alone shows why each debt left.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from eventstore.events import AckAccepted, AckRejected, Event
from protocol.wire import AcknowledgeResult, CompletionReceipt


@dataclass(frozen=True)
class DebtStep:
    verdict: Literal["paid", "refetch", "need_generation", "dropped", "kept"]
    events: tuple[Event, ...] = ()
    reason: str = ""


def on_ack(receipt: CompletionReceipt, result: AcknowledgeResult, agent_generation: int | None) -> DebtStep:
    rid, n = receipt.rollout_id, receipt.attempt_index
    if result.acknowledged:
        return DebtStep("paid", (AckAccepted(rollout_id=rid, attempt_index=n, idempotent=result.idempotent),))
    error = result.error or "receipt_mismatch"
    if error == "receipt_mismatch":
        rejected = AckRejected(
            rollout_id=rid, attempt_index=n, error=error, agent_generation=agent_generation
        )
        return DebtStep("refetch", (rejected,))
    if agent_generation is None:
        return DebtStep("need_generation")
    rejected = AckRejected(rollout_id=rid, attempt_index=n, error=error, agent_generation=agent_generation)
    if agent_generation > receipt.execution_generation:
        return DebtStep("dropped", (rejected,), f"the agent restarted (generation {agent_generation})")
    return DebtStep(
        "kept",
        (rejected,),
        f"the agent (generation {agent_generation}) denies {rid}#{n}, a result of its generation "
        f"{receipt.execution_generation}: the debt stays owed (a different agent behind this client?)",
    )
