"""What an ACK answer proves (trainer.core.debt) and how the ledger folds it."""

from __future__ import annotations

import pytest

from eventstore.events import AckAccepted, AckRejected, OperatorMark, RetirePaid
from projections.ledger import RetireDebt, debt_dropped_by
from protocol import mutants
from protocol.retry import RetryState
from protocol.wire import AcknowledgeResult, CompletionReceipt
from trainer.core.debt import (
    ACK_POLICY,
    AckRetry,
    AgentSeen,
    DebtStep,
    OperatorDrop,
    on_ack,
    on_ack_failure,
    on_operator_drop,
)

HOLDER, OTHER = "a" * 32, "b" * 32
RECEIPT = CompletionReceipt(
    rollout_id="p1-0",
    attempt_index=0,
    execution_generation=2,
    execution_incarnation=HOLDER,
    result_identity="r",
    result_digest="sha256:" + "0" * 64,
    manifest_capture_key="p1-0",
    terminal_model_call_id="m1",
)


def result(acknowledged: bool, error: str | None = None) -> AcknowledgeResult:
    return AcknowledgeResult(rollout_id="p1-0", attempt_index=0, acknowledged=acknowledged, error=error)


def test_accepted_pays() -> None:
    step = on_ack(RECEIPT, result(True), None)
    assert step.verdict == "paid" and isinstance(step.events[0], AckAccepted)


def test_receipt_mismatch_is_recorded_and_refetched() -> None:
    step = on_ack(RECEIPT, result(False, "receipt_mismatch"), AgentSeen(HOLDER, 2))
    assert step.verdict == "refetch"
    (rejected,) = step.events
    assert isinstance(rejected, AckRejected) and not debt_dropped_by(rejected, RECEIPT)


def test_unknown_execution_without_the_agents_identity_records_nothing_yet() -> None:
    step = on_ack(RECEIPT, result(False, "unknown_execution"), None)
    assert step.verdict == "need_agent" and not step.events


@pytest.mark.parametrize("generation", [1, 2, 3])
def test_unknown_execution_from_another_incarnation_drops_the_debt(generation: int) -> None:
    """Whatever its generation (an agent whose state directory was lost counts from 1 again, one whose
    clock was a day ahead started higher): another process than the receipt's has lost the result."""
    step = on_ack(RECEIPT, result(False, "unknown_execution"), AgentSeen(OTHER, generation))
    (rejected,) = step.events
    assert step.verdict == "dropped" and isinstance(rejected, AckRejected)
    assert (rejected.agent_generation, rejected.agent_incarnation) == (generation, OTHER)
    assert debt_dropped_by(rejected, RECEIPT)


@pytest.mark.parametrize("generation", [1, 2, 3])
def test_unknown_execution_from_the_same_incarnation_keeps_the_debt(generation: int) -> None:
    """Case 7: no evidence of a restart, so the debt is not dropped, whatever generation it names."""
    step = on_ack(RECEIPT, result(False, "unknown_execution"), AgentSeen(HOLDER, generation))
    (rejected,) = step.events
    assert step.verdict == "kept" and "stays owed" in step.reason
    assert isinstance(rejected, AckRejected) and not debt_dropped_by(rejected, RECEIPT)


def test_a_receipt_from_before_incarnations_is_dropped_by_any_incarnations_denial() -> None:
    legacy = RECEIPT.model_copy(update={"execution_incarnation": None})
    step = on_ack(legacy, result(False, "unknown_execution"), AgentSeen(OTHER, 1))
    assert step.verdict == "dropped"


def test_rows_from_before_incarnations_keep_the_rule_they_were_decided_under() -> None:
    """v2/v3 rows name a generation and no incarnation: a newer generation dropped the debt."""
    for generation, dropped in ((3, True), (2, False), (1, False)):
        row = AckRejected(
            rollout_id="p1-0", attempt_index=0, error="unknown_execution", agent_generation=generation
        )
        assert debt_dropped_by(row, RECEIPT) is dropped


def test_a_v1_row_keeps_its_old_meaning() -> None:
    legacy = AckRejected(rollout_id="p1-0", attempt_index=0, error="unknown_execution")
    assert legacy.agent_generation is None and debt_dropped_by(legacy, RECEIPT)


def test_an_ack_that_keeps_failing_is_stuck_within_its_budget_then_called_at_the_cap() -> None:
    """The relay's retry is bounded: within ACK_POLICY's calls and deadline the agent is reported
    stuck (once, by the shell), and the calls go on at the longest wait, jittered."""
    state, now, calls = RetryState(), 0.0, 0
    while True:
        retry = on_ack_failure(state, now, 0.99, "AgentUnavailableError: connection refused")
        calls += 1
        state = retry.state
        if retry.stuck:
            break
        assert 0 < retry.delay_s <= ACK_POLICY.cap_s
        now += retry.delay_s
    assert calls <= ACK_POLICY.max_calls and now <= ACK_POLICY.deadline_s
    assert "connection refused" in retry.reason
    for jitter in (0.0, 0.5, 0.999):
        later = on_ack_failure(state, now + 100, jitter, "still refused")
        assert later.stuck and ACK_POLICY.cap_s / 2 <= later.delay_s <= ACK_POLICY.cap_s


def test_a_rejection_naming_no_error_is_a_receipt_mismatch_even_without_the_agents_identity() -> None:
    step = on_ack(RECEIPT, result(False), None)
    assert step == DebtStep(
        "refetch", (AckRejected(rollout_id="p1-0", attempt_index=0, error="receipt_mismatch"),)
    )


def test_a_denial_says_which_process_denied_it_and_how_an_operator_ends_it() -> None:
    dropped = on_ack(RECEIPT, result(False, "unknown_execution"), AgentSeen(OTHER, 3))
    assert dropped.reason == f"the agent restarted (incarnation {OTHER})"
    kept = on_ack(RECEIPT, result(False, "unknown_execution"), AgentSeen(HOLDER, 2))
    assert kept.reason == (
        f"the agent process that made the receipt of p1-0#0 (incarnation {HOLDER}) denies it: the debt "
        "stays owed (a different agent behind this client?); if it can never be paid: "
        "ledger debt drop p1-0 0 --reason ..."
    )


def test_the_debt_dropped_without_evidence_mutant_drops_on_any_denial_and_only_a_denial() -> None:
    """The catalogue's `debt_dropped_without_evidence` switch reaches this decision: an unknown_execution
    drops the debt with no incarnation named; a mismatch is still refetched."""
    with mutants.enabled("debt_dropped_without_evidence"):
        step = on_ack(RECEIPT, result(False, "unknown_execution"), AgentSeen(HOLDER, 2))
        assert step == DebtStep(
            "dropped", (AckRejected(rollout_id="p1-0", attempt_index=0, error="unknown_execution"),)
        )
        assert on_ack(RECEIPT, result(False, "receipt_mismatch"), None).verdict == "refetch"
    assert on_ack(RECEIPT, result(False, "unknown_execution"), AgentSeen(HOLDER, 2)).verdict == "kept"


def test_a_failing_ack_past_the_deadline_is_stuck_and_waits_three_quarters_of_the_cap_at_half_jitter() -> (
    None
):
    first = on_ack_failure(RetryState(), 0.0, 0.0, "refused")
    assert first == AckRetry(RetryState(1, 0.0, "refused"), ACK_POLICY.base_s / 2)
    late = on_ack_failure(first.state, ACK_POLICY.deadline_s + 1, 0.5, "refused again")
    reason = f"2 calls failed within the {ACK_POLICY.deadline_s:g} s deadline: refused again"
    assert late == AckRetry(RetryState(2, 0.0, "refused again"), ACK_POLICY.cap_s * 0.75, True, reason)


MARK = OperatorMark(operator="ops", reason="agent host decommissioned")


def test_an_operator_drop_of_an_ack_debt_names_its_agent_and_receipt() -> None:
    """The ACK debt is dropped (at the agent named, or whichever holds it), even where a retire is owed too."""
    debts = {"agent-a": {"p1-0/0": RECEIPT}, "agent-b": {"p9-0/0": RECEIPT}}
    retires = {"agent-a": {"p1-0/0": RetireDebt(rollout_id="p1-0", attempt_index=0, position=5)}}
    event = AckRejected(rollout_id="p1-0", attempt_index=0, error="dropped_by_operator", operator=MARK)
    expected = OperatorDrop(
        DebtStep("dropped", (event,), "dropped by ops: agent host decommissioned"), "agent-a", RECEIPT
    )
    for agent in (None, "agent-a"):
        assert on_operator_drop(debts, "p1-0", 0, agent, MARK, retires) == expected
    refused = on_operator_drop(debts, "p1-0", 0, "agent-b", MARK, retires)
    assert refused == OperatorDrop(
        DebtStep("unknown", reason="no unpaid ACK debt and no retire owed for p1-0#0 to agent 'agent-b'")
    )


def test_an_operator_drop_with_no_ack_debt_pays_the_retire_owed() -> None:
    debts = {"agent-a": {"p1-0/1": RECEIPT}}
    retires = {
        "agent-a": {"p1-0/1": RetireDebt(rollout_id="p1-0", attempt_index=1, position=2)},
        "agent-b": {"p1-0/0": RetireDebt(rollout_id="p1-0", attempt_index=0, position=5)},
    }
    event = RetirePaid(rollout_id="p1-0", attempt_index=0, outcome="dropped_by_operator", operator=MARK)
    expected = OperatorDrop(
        DebtStep("dropped", (event,), "dropped by ops: agent host decommissioned"), "agent-b"
    )
    assert on_operator_drop(debts, "p1-0", 0, None, MARK, retires) == expected
    assert on_operator_drop(debts, "p1-0", 0, "agent-b", MARK, retires) == expected
    nothing = on_operator_drop(debts, "p1-0", 0, None, MARK)
    assert nothing == OperatorDrop(
        DebtStep("unknown", reason="no unpaid ACK debt and no retire owed for p1-0#0")
    )
