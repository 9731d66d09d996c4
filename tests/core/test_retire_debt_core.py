"""A retire owed after a try declared lost (trainer.core.retire_debt, trainer.core.attempt's loss)."""

from __future__ import annotations

import pytest

from eventstore.events import AckOwed, ReceiptFetched, RetireOwed, RetirePaid, RunFailed
from projections.ledger import LedgerState
from protocol.retry import RetryState
from protocol.wire import CompletionReceipt
from tests.core.test_group_core import attempt, group
from trainer.core.attempt import CallFailed, RetireAnswer, RetireRefused, Retiring, Settled, on
from trainer.core.retire_debt import (
    RETIRE_OWED_POLICY,
    OwedRetire,
    on_failure,
    on_receipt,
    on_retire,
    settled,
)

HOLDER, OTHER = "a" * 32, "b" * 32
OWED = OwedRetire("agent-a", "p1-0", 0)


def receipt(rollout_id: str = "p1-0", incarnation: str = HOLDER, key: str = "p1-0") -> CompletionReceipt:
    return CompletionReceipt(
        rollout_id=rollout_id,
        attempt_index=0,
        execution_generation=2,
        execution_incarnation=incarnation,
        result_identity="r",
        result_digest="sha256:" + "0" * 64,
        manifest_capture_key=key,
        terminal_model_call_id="m1",
    )


def lose(state: Retiring) -> tuple[Settled, tuple[object, ...]]:
    now = 0.0
    while True:
        step = on(state, CallFailed("connection refused"), now=now, jitter=0.5, checkpoint_id=None)
        state = step.state
        if isinstance(step.action, Settled):
            return step.action, step.events
        now += step.action.delay_s


def test_a_try_declared_lost_owes_its_agent_a_retire_naming_the_process_that_held_it() -> None:
    answered = RetireAnswer(False, False, True, execution_generation=2, execution_incarnation=HOLDER)
    state = on(Retiring("p1-0", 0, agent_name="agent-a"), answered, now=0, jitter=0, checkpoint_id=None).state
    settled, events = lose(state)
    assert settled.kind == "lost"
    failed, owed = events
    assert isinstance(failed, RunFailed) and failed.kind == "agent_lost"
    assert owed == RetireOwed(
        agent_name="agent-a", rollout_id="p1-0", attempt_index=0, execution_incarnation=HOLDER
    )


def test_a_try_lost_with_no_agent_named_owes_nothing() -> None:
    _, events = lose(Retiring("p1-0", 0))
    assert [type(e) for e in events] == [RunFailed]


@pytest.mark.parametrize(
    ("answer", "outcome"),
    [
        (RetireAnswer(True, False, False, execution_incarnation=OTHER), "cancelled"),
        (RetireAnswer(False, True, False, execution_incarnation=OTHER), "tombstoned"),
        (RetireAnswer(False, False, False, done=True, execution_incarnation=HOLDER), "done"),
    ],
)
def test_an_agent_that_holds_nothing_of_the_try_pays_the_retire(answer: RetireAnswer, outcome: str) -> None:
    step = on_retire(OWED, answer)
    (paid,) = step.events
    assert step.verdict == "paid"
    assert isinstance(paid, RetirePaid) and paid.outcome == outcome
    assert paid.execution_incarnation == answer.execution_incarnation


def test_a_finished_result_still_held_is_released_through_its_ack_never_adopted() -> None:
    step = on_retire(OWED, RetireAnswer(False, False, True, execution_incarnation=HOLDER))
    assert step.verdict == "fetch_receipt" and step.incarnation == HOLDER and not step.events
    step = on_receipt(OWED, HOLDER, receipt())
    fetched, owed, paid = step.events
    assert step.verdict == "paid"
    assert isinstance(fetched, ReceiptFetched) and isinstance(owed, AckOwed)
    assert owed.agent_name == "agent-a" and owed.receipt == receipt()
    assert isinstance(paid, RetirePaid) and paid.outcome == "released"
    assert paid.execution_incarnation == HOLDER  # the process that held it, the evidence of the release


@pytest.mark.parametrize(
    "fetched",
    [
        receipt(rollout_id="p1-1", key="p1-1"),
        receipt(key="p1-0-a1"),
        receipt(incarnation=OTHER),
        receipt().model_copy(update={"attempt_index": 1}),
    ],
    ids=["another-try", "another-capture-key", "another-process", "another-attempt-index"],
)
def test_a_receipt_that_is_not_the_held_result_pays_nothing(fetched: CompletionReceipt) -> None:
    step = on_receipt(OWED, HOLDER, fetched)
    assert step.verdict == "failed" and not step.events and step.reason


@pytest.mark.parametrize(
    "got", [CallFailed("connection refused"), RetireRefused("invalid_phase"), RetireRefused("stale")]
)
def test_a_retire_that_fails_or_is_refused_is_called_again_later(got: CallFailed | RetireRefused) -> None:
    step = on_retire(OWED, got)
    assert step.verdict == "failed" and not step.events and step.reason


def test_failures_back_off_within_the_budget_then_are_stuck_and_called_at_the_cap() -> None:
    retry = on_failure(RetryState(), 0.0, 0.0, "refused")
    now, delays = 0.0, []
    while not retry.stuck:
        delays.append(retry.delay_s)
        now += retry.delay_s
        retry = on_failure(retry.state, now, 0.5, "refused")
    assert retry.state.calls <= RETIRE_OWED_POLICY.max_calls
    assert now <= RETIRE_OWED_POLICY.deadline_s
    assert delays == sorted(delays) and 0 < delays[0] < delays[-1] <= RETIRE_OWED_POLICY.cap_s
    assert RETIRE_OWED_POLICY.cap_s / 2 <= retry.delay_s <= RETIRE_OWED_POLICY.cap_s
    assert "refused" in retry.reason


def test_a_try_whose_result_was_taken_or_whose_agent_held_nothing_is_settled() -> None:
    """`settled`: a sealed or held try (its result taken), one retired or discarded with nothing held, a
    failed one whose sibling sealed; a failed one whose sibling is still open is the trainer's to decide."""
    for status in ("sealed", "held"):
        g = group("sibling", {0: [attempt(0, 0, status)]})
        assert settled(LedgerState(groups={"g": g}), "g_g0", 0)
    for status in ("retired", "discarded"):
        thrown = attempt(0, 0, status)  # type: ignore[arg-type]
        thrown.retire_outcome = "tombstoned"
        assert settled(LedgerState(groups={"g": group("prompt_group", {0: [thrown]})}), "g_g0", 0)
        thrown.retire_outcome = "completed_unacknowledged"
        assert not settled(LedgerState(groups={"g": group("prompt_group", {0: [thrown]})}), "g_g0", 0)
    g = group("sibling", {0: [attempt(0, 0, "failed")]})
    assert not settled(LedgerState(groups={"g": g}), "g_g0", 0)
    g.siblings[0].status = "sealed"
    assert settled(LedgerState(groups={"g": g}), "g_g0", 0)
