"""What an ACK answer proves (trainer.core.debt) and how the ledger folds it."""

from __future__ import annotations

import pytest

from eventstore.events import AckAccepted, AckRejected
from projections.ledger import debt_dropped_by
from protocol.wire import AcknowledgeResult, CompletionReceipt
from trainer.core.debt import AgentSeen, on_ack

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
    from protocol.retry import RetryState
    from trainer.core.debt import ACK_POLICY, on_ack_failure

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
