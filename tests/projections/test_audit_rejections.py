"""What an AckRejected does to the audit, with each violation's message: a rejection of a debt never
owed; an operator's drop and an `unknown_execution` on evidence settle the debt (and the try is no
longer running: a replacement may follow), a drop with no incarnation recorded too but reported; an
`unknown_execution` from the same process leaves the debt owed."""

from __future__ import annotations

from eventstore import EventStore
from eventstore.events import AckRejected, OperatorMark
from projections.audit import (
    CHECKPOINT_CLEAN,
    DEBT_DROPPED_ON_EVIDENCE,
    SEAL_BEFORE_ACK,
)
from tests.projections.audit_fold import audit_both_ways
from tests.projections.builder import LogBuilder


def dropped_by_operator(log: LogBuilder, rollout_id: str) -> list[int]:
    mark = OperatorMark(operator="ops@host", reason="agent host decommissioned")
    return log.group(
        rollout_id.rpartition("_g")[0],
        [AckRejected(rollout_id=rollout_id, attempt_index=0, error="dropped_by_operator", operator=mark)],
    )


def said(store: EventStore) -> list[tuple[str, list[int], str]]:
    return [(v.rule, v.positions, v.message) for v in audit_both_ways(store).violations]


def owed(log: LogBuilder, group_id: str, tries: int) -> list[int]:
    log.reserve(group_id, tries)
    log.mint(group_id, tries)
    debts = []
    for i in range(tries):
        log.dispatch(f"{group_id}_g{i}")
        log.reply(f"{group_id}_g{i}")
        debts.append(log.seal(f"{group_id}_g{i}")[-1])
    return debts


def test_a_rejection_of_a_debt_never_owed(store: EventStore, log: LogBuilder) -> None:
    log.reserve("p", 2)
    log.mint("p", 2)
    log.dispatch("p_g0")
    (minted_only,) = dropped_by_operator(log, "p_g0")
    (never_minted,) = dropped_by_operator(log, "p_g5")
    unrecorded = "an ACK was sent for a receipt the trainer had not durably recorded"
    assert said(store) == [
        (SEAL_BEFORE_ACK, [minted_only], f"AckRejected for p_g0#0 with no AckOwed before it: {unrecorded}"),
        (SEAL_BEFORE_ACK, [never_minted], f"AckRejected for p_g5#0 with no AckOwed before it: {unrecorded}"),
    ]


def test_dropped_debts_are_settled_and_their_tries_may_be_replaced(
    store: EventStore, log: LogBuilder
) -> None:
    debts = owed(log, "p", 3)
    dropped_by_operator(log, "p_g0")
    log.reject("p_g1")  # from a newer generation of the agent: it restarted and lost the result
    (no_evidence,) = log.reject("p_g2", agent_generation=None)  # a v1-shaped drop
    for i in range(3):
        log.replace(f"p_g{i}", 1, reason="debt dropped")
    log.prepare("c1")
    log.commit("c1")  # every debt settled: none unpaid at the cut
    assert said(store) == [  # settled, but nothing in the row shows the agent lost the result
        (
            DEBT_DROPPED_ON_EVIDENCE,
            [debts[2], no_evidence],
            "the debt of p_g2#0 was dropped on an unknown_execution with no agent incarnation recorded: "
            "nothing shows the agent restarted and lost the result",
        )
    ]


def test_an_unknown_execution_from_the_process_that_made_the_receipt_leaves_the_debt_owed(
    store: EventStore, log: LogBuilder
) -> None:
    debts = owed(log, "p", 1)
    log.reject("p_g0", agent_generation=0)  # the receipt's own generation: no evidence of a loss
    log.prepare("c1")
    (committed,) = log.commit("c1")
    assert [(rule, positions) for rule, positions, _ in said(store)] == [
        (CHECKPOINT_CLEAN, [*debts, committed])
    ]
