"""Every transition of a try being retired or adopted (trainer.core.attempt), without an agent."""

from __future__ import annotations

import pytest

from eventstore.events import AttemptRetired, RunFailed
from trainer.core.attempt import (
    ADOPT_GARBAGE_LIMIT,
    PHASE_WAIT_POLICY,
    RETIRE_POLICY,
    AdoptResult,
    CallAdopt,
    CallFailed,
    CallRetire,
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
