"""Every transition of a checkpoint participant (trainer.core.checkpoint), without an agent."""

from __future__ import annotations

from eventstore.events import CheckpointAborted, CheckpointParticipantFinished, CheckpointParticipantStuck
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
