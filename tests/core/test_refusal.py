"""An agent refusing this trainer (`409 trainer_conflict`) at a call after the start: each machine's
decision (trainer.core.refusal, and its input in the attempt, owed-retire and checkpoint machines),
row by row, without an agent."""

from __future__ import annotations

from eventstore.events import CheckpointParticipantFinished
from trainer.core import checkpoint as ckpt
from trainer.core.attempt import CallFailed, CallRetire, DriverRefused, Retiring, Settled, on
from trainer.core.refusal import driven, on_trainer_conflict, refusal_line
from trainer.core.retire_debt import OwedRetire, on_retire

SAID = "agent 'ag' is driven by trainer 'A', not by trainer 'B': one trainer per agent"


def test_the_refusal_is_the_line_start_raises_and_is_reported_once() -> None:
    first = on_trainer_conflict({}, "ag", "http://127.0.0.1:9", SAID)
    assert first.first and first.line == f"http://127.0.0.1:9: {SAID}" and first.agent_name == "ag"
    assert refusal_line("http://h:1", "two\nlines") == "http://h:1: two lines"  # one line, always
    again = on_trainer_conflict({"ag"}, "ag", "http://127.0.0.1:9", SAID)
    assert not again.first
    assert driven(["ag", "other"], {"ag"}) == ["other"]


def test_a_retire_answered_trainer_conflict_settles_refused_with_nothing_recorded_or_owed() -> None:
    state = Retiring("p1_g0", 0, agent_name="ag")
    refused = on(state, DriverRefused(SAID), now=0.0, jitter=0.0, checkpoint_id=None)
    assert refused.action == Settled("refused", SAID) and refused.events == ()
    assert refused.state == state  # the try stays as the log has it
    # Unlike a transport failure, which is retried (and declared lost, a retire owed, once spent).
    failed = on(state, CallFailed("503"), now=0.0, jitter=0.0, checkpoint_id=None)
    assert isinstance(failed.action, CallRetire)


def test_an_owed_retire_is_not_called_again_at_an_agent_that_refuses_this_trainer() -> None:
    step = on_retire(OwedRetire("ag", "p1_g0", 0), DriverRefused(SAID))
    assert (step.verdict, step.events, step.reason) == ("refused", (), SAID)


def test_a_participant_that_refuses_this_trainer_holds_nothing_of_its_checkpoint() -> None:
    aborting = ckpt.Participant.finishing("ck", "ag", "aborted")
    committing = ckpt.Participant.finishing("ck", "ag", "resumed")
    resuming = ckpt.Participant("ck", "ag", "resumed", "resume", commit_confirmed=True)
    for p, outcome in ((aborting, "aborted"), (committing, "lost"), (resuming, "resumed")):
        result = ckpt.step(p, ckpt.NotDriven(SAID), 0.0, 0.0)
        assert isinstance(result.action, ckpt.Done) and result.action.outcome == outcome, (p, result)
        (finished,) = result.events
        assert isinstance(finished, CheckpointParticipantFinished) and finished.outcome == outcome
