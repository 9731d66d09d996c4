"""Every transition of a checkpoint participant (trainer.core.checkpoint), without an agent."""

from __future__ import annotations

from dataclasses import replace

from eventstore.events import CheckpointAborted, CheckpointParticipantFinished, CheckpointParticipantStuck
from protocol import mutants
from protocol.retry import RetryState
from trainer.core import checkpoint as ckpt
from trainer.core.checkpoint import (
    FINISH_POLICY,
    Accepted,
    Call,
    Done,
    Failed,
    Participant,
    Refused,
    StatusSeen,
    decide,
    resumed_event_due,
    step,
)

CID = "ckpt-1"


def commit() -> Participant:
    return Participant.finishing(CID, "agent-a", "resumed")


def abort() -> Participant:
    return Participant.finishing(CID, "agent-a", "aborted")


def finished_as(result_events: tuple[object, ...]) -> str:
    (event,) = result_events
    assert isinstance(event, CheckpointParticipantFinished)
    return event.outcome


# --- a committed checkpoint ---------------------------------------------------------------------


def test_commit_accepted_then_resume_accepted_finishes_resumed() -> None:
    p = commit()
    assert p.op == "commit"
    s = step(p, Accepted("committed_paused"), 0.0, 0.0)
    assert s.action == Call("resume") and s.participant.commit_confirmed and not s.events
    s = step(s.participant, Accepted("idle"), 0.1, 0.0)
    assert s.action == Done("resumed") and finished_as(s.events) == "resumed"


def test_commit_refused_stale_resumed_is_an_earlier_answer_lost() -> None:
    s = step(commit(), Refused("stale", "resumed"), 0.0, 0.0)
    assert isinstance(s.action, Done) and s.action.outcome == "resumed"


def test_commit_refused_stale_aborted_is_lost_never_resumed() -> None:
    """Case 2: the agent aborted what the log committed."""
    s = step(commit(), Refused("stale", "aborted"), 0.0, 0.0)
    assert isinstance(s.action, Done) and s.action.outcome == "lost"
    assert finished_as(s.events) == "lost"


def test_commit_refused_without_an_outcome_asks_the_status_first() -> None:
    for refusal in (Refused("stale"), Refused("invalid_phase"), Refused("conflict")):
        s = step(commit(), refusal, 0.0, 0.0)
        assert s.action == Call("status") and s.participant.refused_op == "commit" and not s.events


def test_commit_refused_and_the_agent_idle_is_lost_when_the_commit_never_confirmed() -> None:
    """Case 2: the agent restarted after preparing (or a sweep aborted it)."""
    s = step(commit(), Refused("invalid_phase"), 0.0, 0.0)
    s = step(s.participant, StatusSeen("idle", None, 2), 0.1, 0.0)
    assert isinstance(s.action, Done) and s.action.outcome == "lost"
    assert "generation 2" in s.action.reason


def test_commit_refused_while_paused_on_it_goes_on_to_resume() -> None:
    s = step(commit(), Refused("invalid_phase"), 0.0, 0.0)
    s = step(s.participant, StatusSeen("committed_paused", CID, 1), 0.1, 0.0)
    assert s.action == Call("resume") and s.participant.commit_confirmed


def test_commit_refused_while_still_committing_calls_commit_again_after_a_wait() -> None:
    s = step(commit(), Refused("invalid_phase"), 0.0, 0.0)
    s = step(s.participant, StatusSeen("committing", CID, 1), 0.1, 0.0)
    assert isinstance(s.action, Call) and s.action.op == "commit" and s.action.delay_s > 0


def test_resume_refused_and_the_agent_idle_after_a_confirmed_commit_is_resumed() -> None:
    s = step(commit(), Accepted("committed_paused"), 0.0, 0.0)
    s = step(s.participant, Refused("invalid_phase"), 0.1, 0.0)
    assert s.action == Call("status")
    s = step(s.participant, StatusSeen("idle", None, 1), 0.2, 0.0)
    assert s.action == Done("resumed", "the agent is no longer paused on this checkpoint")


def test_a_commit_that_keeps_failing_is_reported_stuck_once_and_keeps_retrying() -> None:
    """Case 3: a decided commit is never given up, and never reported resumed."""
    p = commit()
    stuck_events = []
    now = 0.0
    for _ in range(FINISH_POLICY.max_calls + 5):
        s = step(p, Failed("AgentServerError: 500"), now, 0.5)
        assert isinstance(s.action, Call) and s.action.op == "commit"
        stuck_events += [e for e in s.events if isinstance(e, CheckpointParticipantStuck)]
        assert not any(isinstance(e, CheckpointParticipantFinished) for e in s.events)
        now += s.action.delay_s
        p = s.participant
    assert len(stuck_events) == 1
    assert stuck_events[0].step == "commit" and "500" in stuck_events[0].reason
    assert p.stuck_reported and p.end is None


# --- an aborted checkpoint ----------------------------------------------------------------------


def test_abort_accepted_finishes_aborted() -> None:
    s = step(abort(), Accepted("idle"), 0.0, 0.0)
    assert isinstance(s.action, Done) and finished_as(s.events) == "aborted"


def test_an_abort_that_fails_is_retried_until_the_agent_confirms() -> None:
    """Case 4: one 503 no longer ends the abort."""
    s = step(abort(), Failed("AgentServerError: 503"), 0.0, 0.0)
    assert isinstance(s.action, Call) and s.action.op == "abort" and s.action.delay_s > 0
    s = step(s.participant, Accepted("idle"), 1.0, 0.0)
    assert isinstance(s.action, Done) and s.action.outcome == "aborted"


def test_abort_refused_stale_aborted_is_done_and_stale_resumed_is_lost() -> None:
    s = step(abort(), Refused("stale", "aborted"), 0.0, 0.0)
    assert isinstance(s.action, Done) and s.action.outcome == "aborted"
    s = step(abort(), Refused("stale", "resumed"), 0.0, 0.0)
    assert isinstance(s.action, Done) and s.action.outcome == "lost"


def test_abort_of_an_agent_paused_on_the_checkpoint_resumes_it() -> None:
    s = step(abort(), Refused("invalid_phase"), 0.0, 0.0)
    s = step(s.participant, StatusSeen("committed_paused", CID, 1), 0.1, 0.0)
    assert s.action == Call("resume")
    s = step(s.participant, Accepted("idle"), 0.2, 0.0)
    assert isinstance(s.action, Done) and s.action.outcome == "aborted"


def test_abort_refused_and_another_checkpoint_active_is_aborted_for_this_one() -> None:
    s = step(abort(), Refused("conflict"), 0.0, 0.0)
    s = step(s.participant, StatusSeen("preparing", "ckpt-2", 1), 0.1, 0.0)
    assert isinstance(s.action, Done) and s.action.outcome == "aborted"


def test_a_status_call_that_fails_is_retried() -> None:
    s = step(abort(), Refused("invalid_phase"), 0.0, 0.0)
    s = step(s.participant, Failed("timeout"), 0.1, 0.0)
    assert isinstance(s.action, Call) and s.action.op == "status"


def test_a_finished_participant_stays_finished() -> None:
    s = step(abort(), Accepted("idle"), 0.0, 0.0)
    again = step(s.participant, Failed("late"), 1.0, 0.0)
    assert again.action == Done("aborted") and not again.events


# --- the decision -------------------------------------------------------------------------------


def test_decide_waits_commits_or_aborts() -> None:
    assert decide({"a": "prepared", "b": None}, {}).verdict == "wait"
    assert decide({"a": "prepared", "b": "prepared"}, {}).verdict == "commit"
    assert decide({"a": "prepared", "b": "timeout"}, {}).verdict == "abort"
    owed = decide({"a": "prepared"}, {"a": 2, "other": 5})
    assert owed.verdict == "abort" and "a: 2 debts" in owed.reason


def test_resumed_is_due_only_when_every_participant_resumed() -> None:
    assert resumed_event_due({"a": "resumed", "b": "resumed"}, ["a", "b"])
    assert not resumed_event_due({"a": "resumed"}, ["a", "b"])
    assert not resumed_event_due({"a": "resumed", "b": "lost"}, ["a", "b"])


def test_a_presumed_abort_is_written_only_while_the_log_has_not_decided() -> None:
    """Recovery's plan and the phase reconciliation can both find one checkpoint in doubt: the second
    to append sees the first's decision and writes nothing (the checkpoint is decided once)."""
    [event] = ckpt.presume_abort("c", "preparing", ["a", "b"], "presumed abort: why")
    assert isinstance(event, CheckpointAborted) and event.participants == ["a", "b"]
    for decided in ("aborted", "committed", "resumed", None):
        assert ckpt.presume_abort("c", decided, ["a"], "why") == []


def test_a_leftover_at_an_agent_the_log_says_finished_is_undone_without_a_record() -> None:
    """An agent that restarted (forgetting the outcome) and was prepared again by a stale process holds
    a checkpoint whose end the log already records for it: the prepare is aborted, a commit resumed."""
    assert ckpt.leftover_call("preparing") == ckpt.leftover_call("prepared") == "abort"
    assert ckpt.leftover_call("committed_paused") == "resume"
    assert ckpt.leftover_call("idle") is None


def test_a_prepare_blocked_by_the_same_tries_waits_longer_each_time_within_the_deadline() -> None:
    """An agent answers not_ready at once when only the trainer can unblock it: a trainer that cannot
    (its ACKs refused, its log fenced) must not ask again as fast as the agent answers."""
    unchanged = RetryState()
    waits = []
    for i in range(6):
        unchanged = unchanged.failed(float(i), "not ready")
        waits.append(ckpt.not_ready_wait(unchanged, float(i), 0.0, deadline_left_s=100.0))
    assert waits[0] > 0 and waits == sorted(waits) and waits[-1] > waits[0]
    assert ckpt.not_ready_wait(unchanged, 0.0, 0.0, deadline_left_s=0.01) == 0.01


# --- what each step records and the state the next call starts from --------------------------------


def test_the_first_call_is_the_step_towards_the_target() -> None:
    assert ckpt.first_call(commit()) == Call("commit")
    assert ckpt.first_call(abort()) == Call("abort")


def test_a_stale_refusal_naming_the_outcome_finishes_with_the_reason_recorded() -> None:
    """The outcome the agent names, compared with the log's: the same one is an answer lost on the way;
    a resume refused as already resumed finishes at the log's target (an aborted checkpoint's paused
    agent was resumed), anything else is lost, saying what each side holds."""
    lost_answer = "resumed already (an earlier answer was lost)"
    s = step(commit(), Refused("stale", "resumed"), 0.0, 0.0)
    assert s.action == Done("resumed", lost_answer) and s.participant.end == "resumed"
    (event,) = s.events
    assert event == CheckpointParticipantFinished(
        checkpoint_id=CID, agent_name="agent-a", outcome="resumed", reason=lost_answer
    )
    s = step(abort(), Refused("stale", "aborted"), 0.0, 0.0)
    assert s.action == Done("aborted", "aborted already (an earlier answer was lost)")
    paused = step(
        step(abort(), Refused("conflict"), 0.0, 0.0).participant,
        StatusSeen("committed_paused", CID, 1),
        0.1,
        0.0,
    )
    assert paused.participant.op == "resume" and paused.participant.refused_op is None
    s = step(paused.participant, Refused("stale", "resumed"), 0.2, 0.0)
    assert s.action == Done("aborted", lost_answer)
    s = step(abort(), Refused("stale", "resumed"), 0.0, 0.0)
    assert s.action == Done("lost", "the log says aborted but the agent finished the checkpoint resumed")


def test_a_refused_agent_that_holds_nothing_says_so_and_a_long_reason_is_capped_in_the_log() -> None:
    s = step(abort(), ckpt.NotDriven("bound to trainer t-2"), 0.0, 0.0)
    assert s.action == Done("aborted", "the agent holds nothing of this checkpoint")
    message = "bound to " + "t" * 600
    s = step(commit(), ckpt.NotDriven(message), 0.0, 0.0)
    why = f"the agent refuses this trainer: {message} and never confirmed its commit: its artefact is lost"
    assert s.action == Done("lost", why)
    (event,) = s.events
    assert isinstance(event, CheckpointParticipantFinished) and event.reason == why[:500]


def test_a_status_answer_not_asked_for_repeats_the_call_and_a_non_status_answer_to_status_is_retried() -> (
    None
):
    p = commit()
    assert step(p, StatusSeen("idle", None, 1), 0.0, 0.0) == ckpt.Step(p, Call("commit"))
    asking = step(p, Refused("invalid_phase"), 0.0, 0.0).participant
    s = step(asking, Accepted("idle"), 0.1, 0.0)
    assert s == ckpt.Step(
        replace(asking, retry=RetryState(1, 0.1, "status answered Accepted(phase='idle')")),
        Call("status", FINISH_POLICY.base_s / 2),
    )


def test_a_commit_confirmed_starts_the_resume_on_a_fresh_budget() -> None:
    s = step(commit(), Failed("503"), 0.0, 0.0)
    s = step(s.participant, Accepted("committed_paused"), 1.0, 0.0)
    assert s.participant == replace(commit(), op="resume", commit_confirmed=True)
    done = step(s.participant, Accepted("idle"), 2.0, 0.0)
    assert step(done.participant, Failed("late"), 3.0, 0.0) == ckpt.Step(done.participant, Done("resumed"))


def test_a_step_found_still_in_progress_is_called_again_as_that_step() -> None:
    """The status said the agent is still committing: the next call is the commit, and the participant's
    op says so (its answer is read as the commit's, not as a status)."""
    asking = step(commit(), Refused("invalid_phase"), 0.0, 0.0).participant
    s = step(asking, StatusSeen("committing", CID, 1), 0.1, 0.0)
    assert s.participant.op == "commit" and s.action == Call("commit", FINISH_POLICY.base_s / 2)
    assert s.participant.retry.last_error == "the agent is committing on this checkpoint"
    assert step(s.participant, Accepted("committed_paused"), 0.2, 0.0).action == Call("resume")


def test_a_status_with_no_refused_step_on_record_calls_the_first_step_of_the_target() -> None:
    for target, first in (("resumed", "commit"), ("aborted", "abort")):
        p = Participant(CID, "agent-a", target, "status")  # type: ignore[arg-type]
        s = step(p, StatusSeen("prepared", CID, 1), 0.0, 0.0)
        assert s.participant.op == first and s.action == Call(first, FINISH_POLICY.base_s / 2)


def test_a_stuck_step_names_the_step_and_keeps_calling_at_the_longest_wait() -> None:
    """Stuck is reported for the step that keeps failing (for a status call, the step it asks about),
    when the calls or the deadline are spent, and the calls go on at the cap's jittered wait."""
    longest = FINISH_POLICY.cap_s * 0.75  # jitter 0.5: three quarters of the cap
    for p, named in ((abort(), "abort"), (step(abort(), Refused("conflict"), 0.0, 0.0).participant, "abort")):
        s = step(p, Failed("first"), 0.0, 0.5)
        assert s.events == ()
        s = step(s.participant, Failed("x" * 600), FINISH_POLICY.deadline_s + 1, 0.5)
        (stuck,) = s.events
        assert isinstance(stuck, CheckpointParticipantStuck)
        assert (stuck.step, stuck.calls, len(stuck.reason)) == (named, 2, 500)
        assert s.action == Call(p.op, longest) and s.participant.stuck_reported
        s = step(s.participant, Failed("again"), FINISH_POLICY.deadline_s + 2, 0.5)
        assert s.action == Call(p.op, longest) and s.events == ()


def test_the_decision_says_who_cannot_commit_and_why() -> None:
    refused = decide({"b": "timeout", "a": "refused", "c": "prepared"}, {})
    assert refused == ckpt.Decision("abort", "a: refused; b: timeout")
    owed = decide({"a": "prepared", "b": "prepared"}, {"b": 1, "a": 2, "other": 5})
    debts = "debts still unpaid in the log at the decision"
    assert owed == ckpt.Decision("abort", f"a: 2 {debts}; b: 1 {debts}")
    assert decide({"a": "prepared"}, {"a": 0, "other": 5}) == ckpt.Decision("commit")


def test_the_unpaid_debt_mutant_commits_past_the_debts() -> None:
    """The catalogue's `commit_with_unpaid_debt` switch reaches this decision (and only it turns it off)."""
    with mutants.enabled("commit_with_unpaid_debt"):
        assert decide({"a": "prepared"}, {"a": 2}) == ckpt.Decision("commit")
    assert decide({"a": "prepared"}, {"a": 2}).verdict == "abort"


def test_waits_between_prepare_calls_grow_from_the_base_and_stop_at_the_deadline() -> None:
    base = FINISH_POLICY.base_s
    assert ckpt.not_ready_wait(RetryState(1, 0.0, "x"), 0.0, 0.0, 100.0) == base / 2
    assert ckpt.prepare_retry(RetryState(), 0.0, 0.0, 100.0) == base / 2
    assert ckpt.prepare_retry(RetryState(1, 0.0, "x"), 0.0, 0.5, 100.0) == base * 0.75
    assert ckpt.prepare_retry(RetryState(3, 0.0, "x"), 0.0, 0.0, 100.0) == base * 2
    assert ckpt.prepare_retry(RetryState(3, 0.0, "x"), 0.0, 0.0, base * 2) is None
    assert ckpt.prepare_retry(RetryState(3, 0.0, "x"), 0.0, 0.0, base * 2 + 0.001) == base * 2
