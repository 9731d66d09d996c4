"""Every transition of a try being retired or adopted (trainer.core.attempt), without an agent."""

from __future__ import annotations

from dataclasses import replace

import pytest

from eventstore.events import AttemptRetired, RetireOwed, RunFailed
from protocol.digests import sha256_digest
from protocol.retry import RetryState
from protocol.wire import AttemptWork, ContinuationRef, ResumeReport
from trainer.core.attempt import (
    ADOPT_GARBAGE_LIMIT,
    PHASE_WAIT_POLICY,
    RETIRE_POLICY,
    AdoptResult,
    CallAdopt,
    CallFailed,
    CallRetire,
    Next,
    RetireAnswer,
    RetireRefused,
    Retiring,
    Settled,
    checkpoint_to_name,
    on,
)


def fresh() -> Retiring:
    return Retiring("p1-0", 0)


def test_retire_answers_settle_the_try() -> None:
    cases = {
        RetireAnswer(True, False, False): ("retired", "cancelled"),
        RetireAnswer(False, True, False): ("retired", "tombstoned"),
        RetireAnswer(False, False, False, done=True): ("retired", "done"),
    }
    for answer, (kind, outcome) in cases.items():
        step = on(fresh(), answer, now=0.0, jitter=0.0, checkpoint_id=None)
        assert isinstance(step.action, Settled)
        assert (step.action.kind, step.action.retire_outcome) == (kind, outcome)
        assert not step.events


INC_A, INC_B = "a" * 32, "b" * 32


def test_completed_unacknowledged_is_recorded_once_and_adopted_expecting_that_incarnation() -> None:
    answer = RetireAnswer(False, False, True, execution_generation=3, execution_incarnation=INC_A)
    step = on(fresh(), answer, now=0.0, jitter=0.0, checkpoint_id="c1")
    assert step.action == CallAdopt(INC_A)
    (retired,) = step.events
    assert isinstance(retired, AttemptRetired) and retired.outcome == "completed_unacknowledged"
    assert retired.checkpoint_id == "c1"
    assert (retired.execution_generation, retired.execution_incarnation) == (3, INC_A)
    step = on(step.state, AdoptResult("not_found"), now=0.1, jitter=0.0, checkpoint_id=None)
    assert isinstance(step.action, CallRetire)
    again = on(step.state, answer, now=0.2, jitter=0.0, checkpoint_id=None)
    assert again.action == CallAdopt(INC_A) and not again.events  # recorded once


def test_an_adoption_from_another_incarnation_is_refused_and_retired_again() -> None:
    """Case 8: the agent restarted between retire and the re-POST; its receipt is not the result
    retire described, so nothing is recorded and the try is retired again."""
    answer = RetireAnswer(False, False, True, execution_generation=1, execution_incarnation=INC_A)
    step = on(fresh(), answer, now=0, jitter=0, checkpoint_id=None)
    step = on(step.state, AdoptResult("other_incarnation", INC_B), now=0.1, jitter=0.0, checkpoint_id=None)
    assert isinstance(step.action, CallRetire) and not step.events
    step = on(step.state, RetireAnswer(False, True, False), now=0.2, jitter=0.0, checkpoint_id=None)
    assert isinstance(step.action, Settled) and step.action.retire_outcome == "tombstoned"


def test_adopted_settles_finished() -> None:
    step = on(
        fresh(), RetireAnswer(False, False, True, execution_generation=0), now=0, jitter=0, checkpoint_id=None
    )
    step = on(step.state, AdoptResult("adopted"), now=0.1, jitter=0.0, checkpoint_id=None)
    assert step.action == Settled("finished", "adopted")


def test_garbage_adoptions_strand_the_try_at_the_limit() -> None:
    state = on(fresh(), RetireAnswer(False, False, True), now=0, jitter=0, checkpoint_id=None).state
    for i in range(ADOPT_GARBAGE_LIMIT):
        step = on(state, AdoptResult("garbage", f"junk {i}"), now=float(i), jitter=0.0, checkpoint_id=None)
        state = step.state
        if i < ADOPT_GARBAGE_LIMIT - 1:
            assert isinstance(step.action, CallRetire)  # retire again: it may answer otherwise now
            state = on(
                state, RetireAnswer(False, False, True), now=float(i), jitter=0, checkpoint_id=None
            ).state
    assert isinstance(step.action, Settled) and step.action.kind == "stranded"
    (failed,) = step.events
    assert isinstance(failed, RunFailed) and failed.kind == "receipt"


def test_an_agent_that_never_answers_declares_the_try_lost_within_the_budget() -> None:
    """Case 5: retire is not retried for ever."""
    state, now, calls = fresh(), 0.0, 0
    while True:
        step = on(state, CallFailed("connection refused"), now=now, jitter=0.99, checkpoint_id=None)
        calls += 1
        state = step.state
        if isinstance(step.action, Settled):
            break
        assert isinstance(step.action, CallRetire)
        now += step.action.delay_s
    assert step.action.kind == "lost" and "declared lost" in step.action.reason
    assert calls <= RETIRE_POLICY.max_calls and now <= RETIRE_POLICY.deadline_s
    (failed,) = step.events
    assert isinstance(failed, RunFailed) and failed.kind == "agent_lost"


@pytest.mark.parametrize("jitter", [0.0, 0.99])
def test_an_agent_away_for_most_of_the_deadline_is_still_retried(jitter: float) -> None:
    """The deadline binds, not the call budget: an agent restarting for 25 s (its finished result
    held) is called again, however short the jittered waits are drawn."""
    state, now = fresh(), 0.0
    while now < 25.0:
        step = on(state, CallFailed("connection refused"), now=now, jitter=jitter, checkpoint_id=None)
        assert isinstance(step.action, CallRetire), (now, step.action)
        state, now = step.state, now + step.action.delay_s


def test_a_checkpoint_in_the_way_is_waited_out_with_backoff_not_spun_on() -> None:
    """Case 3/4's spin: a retire refused by the phase fence waits, and the waits grow."""
    state, delays = fresh(), list[float]()
    for _ in range(6):
        step = on(state, RetireRefused("invalid_phase"), now=sum(delays), jitter=0.0, checkpoint_id="c1")
        assert isinstance(step.action, CallRetire)
        delays.append(step.action.delay_s)
        state = step.state
    assert delays == sorted(delays) and delays[-1] > delays[0] > 0
    step = on(
        state,
        RetireRefused("invalid_phase"),
        now=PHASE_WAIT_POLICY.deadline_s + 1,
        jitter=0.0,
        checkpoint_id="c1",
    )
    assert isinstance(step.action, Settled) and step.action.kind == "lost"


def test_a_stale_refusal_drops_the_checkpoint_from_the_next_retire_and_a_conflict_names_it_again() -> None:
    step = on(fresh(), RetireRefused("stale"), now=0.0, jitter=0.0, checkpoint_id="c1")
    assert checkpoint_to_name(step.state, "c1") is None
    assert checkpoint_to_name(step.state, "c2") == "c2"
    step = on(step.state, RetireRefused("conflict"), now=0.1, jitter=0.0, checkpoint_id=None)
    assert checkpoint_to_name(step.state, "c1") == "c1"


# --- what each settlement carries, and what state the next call starts from ---------------------------


def _offer() -> ContinuationRef:
    return ContinuationRef(
        rollout_id="p1-0",
        source_attempt=0,
        lineage="p1-0-l",
        turn=2,
        digest=sha256_digest(b"continuation"),
        prompt_digest=sha256_digest(b"prompt"),
        model_call_ids=["m1", "m2"],
        generated_tokens=30,
    )


def test_a_retire_answer_settles_with_who_answered_what_it_cost_and_what_it_offers() -> None:
    """The settlement carries the agent process that answered, the work a cancel threw away (only a
    cancel: a tombstoned or done try threw nothing away), the boundary offered and the resume report;
    the state is left as it was (the retire is answered, nothing to call again)."""
    resume = ResumeReport(continuation=sha256_digest(b"c"), outcome="declined", reason="unknown_continuation")
    work = AttemptWork(model_s=2.5, generated_tokens=80)
    state = Retiring("p1-0", 2, agent_name="agent-a")

    def answer(retired: bool, tombstoned: bool, done: bool, detail: str = "") -> RetireAnswer:
        return RetireAnswer(
            retired,
            tombstoned,
            False,
            done=done,
            execution_generation=4,
            execution_incarnation=INC_A,
            work=work,
            continuation=_offer(),
            resume=resume,
            detail=detail,
        )

    tombstoned = "never started at the agent (tombstoned)"
    expected = [
        (
            answer(True, False, False),
            Settled("retired", "retired while running", "cancelled", 4, INC_A, work),
        ),
        (answer(False, True, False), Settled("retired", tombstoned, "tombstoned", 4, INC_A)),
        (
            answer(False, False, True),
            Settled("retired", "already done for good at the agent", "done", 4, INC_A),
        ),
        (
            answer(False, False, True, "its POST ended: 500"),
            Settled("retired", "its POST ended: 500", "done", 4, INC_A),
        ),
    ]
    for got, settled in expected:
        step = on(state, got, now=0.0, jitter=0.0, checkpoint_id="c1")
        assert step == Next(state, replace(settled, continuation=_offer(), resume=resume), ())


def test_completed_unacknowledged_switches_to_adopting_and_a_failed_adopt_is_made_again() -> None:
    """After completed_unacknowledged the next call is the adoption: a transport failure of it repeats the
    adoption (expecting the same incarnation), with the error kept for the give-up reason."""
    answer = RetireAnswer(False, False, True, execution_generation=3, execution_incarnation=INC_A)
    step = on(fresh(), answer, now=0.0, jitter=0.0, checkpoint_id=None)
    assert step.state == replace(fresh(), calling="adopt", completed_recorded=True, adopt_incarnation=INC_A)
    again = on(step.state, answer, now=0.1, jitter=0.0, checkpoint_id=None)
    assert again.events == () and again.state == step.state
    failed = on(step.state, CallFailed("reset by peer"), now=1.0, jitter=0.0, checkpoint_id=None)
    assert failed.action == CallAdopt(INC_A, RETIRE_POLICY.base_s / 2)
    assert failed.state.calling == "adopt" and failed.events == ()
    assert failed.state.failures == RetryState(calls=1, started_at=1.0, last_error="reset by peer")


def test_adopted_keeps_the_state_and_an_unusable_adoption_goes_back_to_retire_with_its_reason() -> None:
    adopting = on(fresh(), RetireAnswer(False, False, True), now=0, jitter=0, checkpoint_id=None).state
    done = on(adopting, AdoptResult("adopted"), now=0.1, jitter=0.0, checkpoint_id=None)
    assert done == Next(adopting, Settled("finished", "adopted"), ())
    for kind in ("not_found", "other_incarnation", "gone"):
        step = on(adopting, AdoptResult(kind, "why"), now=0.1, jitter=0.0, checkpoint_id=None)
        assert step.action == CallRetire(RETIRE_POLICY.base_s / 2)
        assert step.state.calling == "retire"
        assert step.state.failures.last_error == f"adoption: {kind} why"
    junk = on(adopting, AdoptResult("garbage", "junk 0"), now=0.1, jitter=0.0, checkpoint_id=None)
    assert junk.action == CallRetire(RETIRE_POLICY.base_s / 2)
    assert (junk.state.calling, junk.state.garbage) == ("retire", ("junk 0",))
    assert junk.state.failures.last_error == "adoption answered garbage: junk 0"


def test_the_stranded_reason_names_the_last_garbage_and_is_capped_at_500_characters() -> None:
    state = on(fresh(), RetireAnswer(False, False, True), now=0, jitter=0, checkpoint_id=None).state
    state = replace(state, garbage=("first", "second"))
    step = on(state, AdoptResult("garbage", "third"), now=1.0, jitter=0.0, checkpoint_id=None)
    reason = "the agent holds a finished result it does not describe consistently (3 adoptions failed): third"
    assert step.state == replace(state, garbage=("first", "second", "third"), calling="retire")
    failed = RunFailed(rollout_id="p1-0", attempt_index=0, reason=reason, kind="receipt")
    assert step == Next(step.state, Settled("stranded", reason), (failed,))
    long = on(state, AdoptResult("garbage", "x" * 600), now=1.0, jitter=0.0, checkpoint_id=None)
    assert isinstance(long.action, Settled) and len(long.action.reason) == 500


def test_a_try_declared_lost_says_why_and_owes_the_agent_a_retire() -> None:
    """Given up: the reason names the last error (capped at 500 characters), the `RunFailed` and the
    `RetireOwed` (to the agent the try runs at, for the incarnation adoption expected) are recorded."""
    state = replace(fresh(), agent_name="agent-a", adopt_incarnation=INC_A, failures=RetryState(39, 0.0, ""))
    step = on(state, CallFailed("refused"), now=1.0, jitter=0.0, checkpoint_id=None)
    reason = f"declared lost: 40 calls failed (budget {RETIRE_POLICY.max_calls}): refused"
    owed = RetireOwed(agent_name="agent-a", rollout_id="p1-0", attempt_index=0, execution_incarnation=INC_A)
    failed = RunFailed(rollout_id="p1-0", attempt_index=0, reason=reason, kind="agent_lost")
    assert step == Next(step.state, Settled("lost", reason), (failed, owed))
    assert step.state.failures.calls == 40
    nobody = on(
        replace(state, agent_name=None), CallFailed("x" * 600), now=1.0, jitter=0.0, checkpoint_id=None
    )
    assert isinstance(nobody.action, Settled) and len(nobody.action.reason) == 500
    assert nobody.state.failures.calls == 40 and len(nobody.events) == 1


def test_a_phase_refusal_retires_again_and_its_give_up_names_the_checkpoint_phase() -> None:
    adopting = on(fresh(), RetireAnswer(False, False, True), now=0, jitter=0, checkpoint_id=None).state
    step = on(adopting, RetireRefused("invalid_phase"), now=0.0, jitter=0.0, checkpoint_id="c1")
    assert step.action == CallRetire(PHASE_WAIT_POLICY.base_s / 2)
    assert step.state.calling == "retire"
    assert step.state.waits == RetryState(1, 0.0, "retire refused: invalid_phase")
    late = on(
        step.state,
        RetireRefused("invalid_phase"),
        now=PHASE_WAIT_POLICY.deadline_s + 1,
        jitter=0.0,
        checkpoint_id="c1",
    )
    assert isinstance(late.action, Settled) and late.state.calling == "retire"
    assert late.action.reason.startswith(
        "declared lost: a checkpoint phase kept the try from being retired: 2 calls failed within"
    )
