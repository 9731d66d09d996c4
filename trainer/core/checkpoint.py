"""The checkpoint state machines: one participant's steps after the decision, and the decision itself.

A checkpoint is a two-phase commit with presumed abort.  Before `CheckpointCommitted` is in the log
anything that goes wrong aborts (`decide`); after it, the log says what every agent must do and the
trainer keeps at it until each agent confirms (`step`).  A participant's steps:

    target "resumed" (the log committed):   commit --accepted--> resume --accepted--> resumed
    target "aborted" (the log aborted):     abort  --accepted--> aborted
                                            (an agent found committed_paused on an aborted checkpoint
                                             is resumed: its artefact is never used, its admission opens)

A phase-fence refusal is never read as "already past this step" on its own: a `stale` refusal that
names the agent's outcome is compared with the target, anything else asks the agent's status first.
An agent that no longer holds the checkpoint before its commit was confirmed lost it (`lost`: it
restarted, or a stale coordinator aborted it): recorded, never resumed in the log.  An agent that
refuses this trainer (`NotDriven`, 409 trainer_conflict: bound to another trainer) holds nothing of it
either (trainer.core.refusal), and is judged so at once, with no call after it.  Transport failures
retry under a budget; a decided step that spends it is recorded stuck (`CheckpointParticipantStuck`,
once) and keeps retrying at the budget's longest wait, because the log's decision cannot change.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

from eventstore.events import (
    CheckpointAborted,
    CheckpointParticipantFinished,
    CheckpointParticipantStuck,
    Event,
    ParticipantOutcome,
    PhaseStep,
)
from protocol import mutants
from protocol.retry import RetryPolicy, RetryState, backoff_s, next_step
from protocol.wire import Phase

Target = Literal["resumed", "aborted"]
Op = Literal["commit", "resume", "abort", "status"]
RefusalKind = Literal["stale", "invalid_phase", "conflict"]

# A decided step: retried with backoff; after this budget it is reported stuck, then retried at cap_s.
FINISH_POLICY = RetryPolicy(max_calls=12, deadline_s=30.0, base_s=0.05, cap_s=2.0)


# --- inputs: what an agent answered ------------------------------------------------------------------


@dataclass(frozen=True)
class Accepted:
    """The call returned a phase response."""

    phase: Phase


@dataclass(frozen=True)
class Refused:
    """The phase fence refused the call; `finished` is the outcome a `stale` refusal names, if any."""

    kind: RefusalKind
    finished: Literal["resumed", "aborted"] | None = None
    message: str = ""


@dataclass(frozen=True)
class Failed:
    """No usable answer: transport, 5xx, garbage."""

    error: str


@dataclass(frozen=True)
class StatusSeen:
    """The answer to a status call made after a refusal."""

    phase: Phase
    active_checkpoint_id: str | None
    execution_generation: int


@dataclass(frozen=True)
class NotDriven:
    """The agent refuses this trainer (`409 trainer_conflict`): bound to another, it holds nothing of
    this trainer's checkpoints."""

    message: str


Answer = Accepted | Refused | Failed | StatusSeen | NotDriven


# --- state and decisions -------------------------------------------------------------------------


@dataclass(frozen=True)
class Participant:
    """One agent's progress towards the log's decision on one checkpoint."""

    checkpoint_id: str
    agent_name: str
    target: Target
    op: Op
    # The step a refusal interrupted (what a status answer is about).
    refused_op: PhaseStep | None = None
    # The agent confirmed the commit (its artefact is written): a lost resume afterwards is harmless.
    commit_confirmed: bool = False
    retry: RetryState = field(default_factory=RetryState)
    stuck_reported: bool = False
    end: ParticipantOutcome | None = None

    @classmethod
    def finishing(cls, checkpoint_id: str, agent_name: str, target: Target) -> Participant:
        return cls(checkpoint_id, agent_name, target, "commit" if target == "resumed" else "abort")


@dataclass(frozen=True)
class Call:
    """Make `op` at the agent after `delay_s`."""

    op: Op
    delay_s: float = 0.0


@dataclass(frozen=True)
class Done:
    outcome: ParticipantOutcome
    reason: str = ""


@dataclass(frozen=True)
class Step:
    participant: Participant
    action: Call | Done
    events: tuple[Event, ...] = ()


def first_call(p: Participant) -> Call:
    return Call(p.op)


def _done(p: Participant, outcome: ParticipantOutcome, reason: str = "") -> Step:
    event = CheckpointParticipantFinished(
        checkpoint_id=p.checkpoint_id, agent_name=p.agent_name, outcome=outcome, reason=reason[:500]
    )
    return Step(replace(p, end=outcome), Done(outcome, reason), (event,))


def _again(p: Participant, op: Op, error: str, now: float, jitter: float) -> Step:
    """A failed (or not yet effective) call: back off and call `op`; report stuck once when the
    budget is spent, then keep calling at the longest wait."""
    retry = p.retry.failed(now, error)
    verdict = next_step(FINISH_POLICY, retry, now, jitter)
    p = replace(p, op=op, retry=retry)
    if verdict.kind == "retry":
        return Step(p, Call(op, verdict.delay_s))
    delay = FINISH_POLICY.cap_s * (0.5 + jitter / 2)
    if p.stuck_reported:
        return Step(p, Call(op, delay))
    step: PhaseStep = op if op != "status" else (p.refused_op or "commit")
    stuck = CheckpointParticipantStuck(
        checkpoint_id=p.checkpoint_id,
        agent_name=p.agent_name,
        step=step,
        calls=retry.calls,
        reason=verdict.reason[:500],
    )
    return Step(replace(p, stuck_reported=True), Call(op, delay), (stuck,))


def step(p: Participant, answer: Answer, now: float, jitter: float) -> Step:
    """The participant's next step after `answer` to its call `p.op` (made at `now`)."""
    if p.end is not None:
        return Step(p, Done(p.end))
    if isinstance(answer, Failed):
        return _again(p, p.op, answer.error, now, jitter)
    if isinstance(answer, NotDriven):
        return _holds_nothing(p, f"the agent refuses this trainer: {answer.message}")
    if p.op == "status":
        if not isinstance(answer, StatusSeen):
            return _again(p, "status", f"status answered {answer}", now, jitter)
        return _after_status(p, answer, now, jitter)
    if isinstance(answer, StatusSeen):  # not asked for: ignore it, repeat the call
        return Step(p, Call(p.op))
    if isinstance(answer, Accepted):
        return _accepted(p, answer)
    return _refused(p, answer)


def _accepted(p: Participant, answer: Accepted) -> Step:
    if p.op == "commit":
        # The agent wrote its artefact and is paused: resume it.
        return Step(replace(p, op="resume", commit_confirmed=True, retry=RetryState()), Call("resume"))
    if p.op == "resume":
        return _done(p, p.target)
    # abort accepted: whatever the phase it reports, the checkpoint is over at the agent.
    return _done(p, "aborted")


def _refused(p: Participant, answer: Refused) -> Step:
    op = p.op
    assert op != "status"
    if answer.kind == "stale" and answer.finished is not None:
        # The agent names how this checkpoint ended for it: compare with what the log decided.
        if answer.finished == "resumed" and p.target == "resumed":
            return _done(p, "resumed", "resumed already (an earlier answer was lost)")
        if answer.finished == "aborted" and p.target == "aborted":
            return _done(p, "aborted", "aborted already (an earlier answer was lost)")
        if answer.finished == "resumed" and op == "resume":
            return _done(p, p.target, "resumed already (an earlier answer was lost)")
        return _done(
            p,
            "lost",
            f"the log says {p.target} but the agent finished the checkpoint {answer.finished}",
        )
    # Not enough to decide: what is the agent's phase now?
    return Step(replace(p, op="status", refused_op=op), Call("status"))


def _after_status(p: Participant, seen: StatusSeen, now: float, jitter: float) -> Step:
    refused = p.refused_op or ("commit" if p.target == "resumed" else "abort")
    if seen.active_checkpoint_id != p.checkpoint_id:
        # The agent holds nothing of this checkpoint (idle, or another checkpoint is active there).
        return _holds_nothing(
            p,
            f"the agent (generation {seen.execution_generation}, phase {seen.phase}, active "
            f"{seen.active_checkpoint_id!r}) no longer holds this checkpoint",
        )
    if seen.phase == "committed_paused":
        if p.target == "resumed":
            p = replace(p, commit_confirmed=True)
        # Paused on it: resume (for an aborted checkpoint too: its artefact is never used).
        return Step(replace(p, op="resume", refused_op=None), Call("resume"))
    # preparing / prepared / committing: the agent is still on its way; call the step again.
    return _again(p, refused, f"the agent is {seen.phase} on this checkpoint", now, jitter)


def _holds_nothing(p: Participant, why: str) -> Step:
    """The agent holds nothing of this checkpoint: aborted there if that is the target; resumed if it
    confirmed the commit (its artefact is written); else its artefact is lost."""
    if p.target == "aborted":
        return _done(p, "aborted", "the agent holds nothing of this checkpoint")
    if p.commit_confirmed:
        return _done(p, "resumed", "the agent is no longer paused on this checkpoint")
    return _done(p, "lost", f"{why} and never confirmed its commit: its artefact is lost")


# --- the decision --------------------------------------------------------------------------------

PrepareEnd = Literal["prepared", "refused", "failed", "timeout"]


@dataclass(frozen=True)
class Decision:
    verdict: Literal["commit", "abort", "wait"]
    reason: str = ""


def decide(prepares: dict[str, PrepareEnd | None], unpaid_debts: dict[str, int]) -> Decision:
    """Commit when every participant is prepared and nothing it accepted is unpaid in the log; abort
    as soon as one cannot be (it refused, failed or ran out of time); wait otherwise."""
    failed = {a: e for a, e in prepares.items() if e is not None and e != "prepared"}
    if failed:
        return Decision("abort", "; ".join(f"{a}: {e}" for a, e in sorted(failed.items())))
    if any(e is None for e in prepares.values()):
        return Decision("wait")
    owed = unpaid_at_decision(unpaid_debts, list(prepares))
    if owed:
        return Decision("abort", "; ".join(f"{a}: {r}" for a, r in sorted(owed.items())))
    return Decision("commit")


def unpaid_at_decision(unpaid_debts: dict[str, int], participants: list[str]) -> dict[str, str]:
    """Participant -> why the cut cannot be taken: debts to it still unpaid in the log (kept owed
    ones included: an agent that denies a result with no evidence it lost it, until an operator
    drops the debt)."""
    if mutants.active("commit_with_unpaid_debt"):
        return {}
    return {
        a: f"{n} debts still unpaid in the log at the decision"
        for a, n in unpaid_debts.items()
        if a in participants and n
    }


def presume_abort(
    checkpoint_id: str, status: str | None, participants: list[str], reason: str
) -> list[Event]:
    """Presumed abort of a checkpoint found undecided (`status` as the log holds it now, None when the
    log never started it): its `CheckpointAborted`, or nothing when the log already decided it.

    Recovery's plan and the reconciliation of an agent's phase can both find the same checkpoint in
    doubt; whichever appends second sees the first's decision and writes nothing, so a checkpoint is
    decided once."""
    if status != "preparing":
        return []
    return [CheckpointAborted(checkpoint_id=checkpoint_id, participants=participants, reason=reason)]


def leftover_call(phase: str) -> Op | None:
    """The call that puts right an agent found active, in `phase`, on a checkpoint whose end the log
    already records for it (it restarted and forgot the outcome, then a stale process prepared the same
    id again): a prepare left over is aborted, a commit left over resumed (its artefact is never used);
    nothing is recorded, the log's record stands."""
    if phase in ("preparing", "prepared"):
        return "abort"
    if phase == "committed_paused":
        return "resume"
    return None


def not_ready_wait(unchanged: RetryState, now: float, jitter: float, deadline_left_s: float) -> float:
    """After a `not_ready` prepare answer that named the same blocking tries as the one before it (the
    trainer's ACKs and adoptions changed nothing yet): the wait before asking again, growing with each
    such answer (FINISH_POLICY's backoff), never past the prepare deadline.  An agent answers
    `not_ready` at once when only the trainer can unblock it, so without this wait a trainer that
    cannot (its ACKs refused, its log fenced) would ask as fast as the agent answers."""
    return min(backoff_s(FINISH_POLICY, max(1, unchanged.calls), jitter), max(0.0, deadline_left_s))


def prepare_retry(state: RetryState, now: float, jitter: float, deadline_left_s: float) -> float | None:
    """After a failed prepare call: the wait before the next, or None when the prepare deadline
    leaves no time for it."""
    delay = backoff_s(FINISH_POLICY, max(1, state.calls), jitter)
    return None if delay >= deadline_left_s else delay


def resumed_event_due(finished: dict[str, ParticipantOutcome], participants: list[str]) -> bool:
    """`CheckpointResumed` is appended only when every participant confirmed resumed."""
    return all(finished.get(a) == "resumed" for a in participants)
