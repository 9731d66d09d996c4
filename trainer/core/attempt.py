"""A try being retired (or adopted): what each answer of the agent means and what to do next.

    retire --retired--------------> settled "retired" (cancelled while running)
           --tombstoned-----------> settled "retired" (never started there)
           --done-----------------> settled "retired" (already done for good; in reduced mode, a
                                    try POSTed with no reply held, the answer saying how it ended)
           --completed_unack.-----> adopt (re-POST /run, adopt-only, expecting that incarnation)
    adopt  --adopted--------------> settled "finished" (the shell recorded seal/hold and the debt)
           --not_found / other inc-> retire again (the agent restarted: it no longer has the result)
           --garbage x LIMIT------> settled "stranded" (a result nobody can describe; group dead-lettered)
    any call failing in transport ---> the same call again after a jittered wait, within RETIRE_POLICY;
                                       spent: settled "lost" (`RunFailed` agent_lost: the try is
                                       declared lost and its group dead-lettered; `RetireOwed`: a
                                       retire of it is owed to the agent, trainer.core.retire_debt)
    a checkpoint in the way (409) ---> retire again after a wait, within PHASE_WAIT_POLICY; spent: lost
    the agent refuses this trainer --> settled "refused" at once, nothing recorded and nothing owed
    (409 trainer_conflict)             (the agent is another trainer's and holds nothing of this one:
                                       trainer.core.refusal); the try stays as the log has it

Adoption never starts a new execution: the re-POST carries the adopt-only mark, and a receipt from
another agent process (incarnation) than the one that answered retire is refused (the try is retired
again).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

from eventstore.events import AttemptRetired, Event, RetireOwed, RunFailed
from protocol.retry import RetryPolicy, RetryState, next_step
from protocol.wire import ContinuationRef, ResumeReport, TryWork

# Transport failures of retire and adopt calls: half a minute of an agent away (a Gym server's restart),
# then lost.  The deadline binds, not the calls: at the 2 s cap, waits drawn from 1-2 s, 16 calls ran
# out after 11-21 s, and a finished result its agent held through a longer restart was left stranded.
RETIRE_POLICY = RetryPolicy(max_calls=40, deadline_s=30.0, base_s=0.05, cap_s=2.0)
# A checkpoint phase in the way of a retire (the agent is committing or paused): waited out this long.
PHASE_WAIT_POLICY = RetryPolicy(max_calls=2000, deadline_s=600.0, base_s=0.05, cap_s=1.0)
# Adoptions answered with something that is not a receipt of this try before it is declared stranded.
ADOPT_GARBAGE_LIMIT = 3

SettledKind = Literal["finished", "retired", "stranded", "lost", "refused"]
RetireOutcome = Literal["cancelled", "tombstoned", "done"]


# --- inputs ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RetireAnswer:
    retired: bool
    tombstoned: bool
    completed_unacknowledged: bool
    done: bool = False
    execution_generation: int | None = None
    execution_incarnation: str | None = None
    # What the cancelled execution had done (`retired`), as the agent measured it.
    work: TryWork | None = None
    # The try's latest committed turn boundary the agent offers (docs/turns.md), and what the try did
    # with the continuation it was asked to resume, if it was.
    continuation: ContinuationRef | None = None
    resume: ResumeReport | None = None
    # What the caller knows of a try done at the agent (reduced mode: how its POST ended).
    detail: str = ""


@dataclass(frozen=True)
class RetireRefused:
    """A phase-fence refusal of retire: `invalid_phase` (committing or paused), `stale` (the agent
    does not know the checkpoint named), `conflict` (another checkpoint is active there)."""

    kind: Literal["invalid_phase", "stale", "conflict"]


@dataclass(frozen=True)
class CallFailed:
    error: str


@dataclass(frozen=True)
class DriverRefused:
    """`409 trainer_conflict`: the agent is bound to another trainer (`message` names it)."""

    message: str


@dataclass(frozen=True)
class AdoptResult:
    """How an adoption ended: `adopted` (recorded by the shell), `garbage` (not a receipt of this
    try), `other_incarnation` (a receipt from another process than the one retire described),
    `not_found` (the agent has no record of it), `gone` (acknowledged or cancelled meanwhile)."""

    kind: Literal["adopted", "garbage", "other_incarnation", "not_found", "gone"]
    detail: str = ""


Input = RetireAnswer | RetireRefused | CallFailed | AdoptResult | DriverRefused


# --- state and actions --------------------------------------------------------------------------


@dataclass(frozen=True)
class Retiring:
    rollout_id: str
    attempt_index: int
    calling: Literal["retire", "adopt"] = "retire"
    # The checkpoint id the agent called unknown: the next retire names none.
    unknown_checkpoint: str | None = None
    completed_recorded: bool = False
    # The agent process (incarnation) that answered retire with completed_unacknowledged.
    adopt_incarnation: str | None = None
    garbage: tuple[str, ...] = ()
    failures: RetryState = field(default_factory=RetryState)
    waits: RetryState = field(default_factory=RetryState)
    policy: RetryPolicy = RETIRE_POLICY
    # The agent the try runs at: a try declared lost there is owed a retire of it (`RetireOwed`), so a
    # finished result the agent still holds when it comes back is released.  None: no one to owe it to
    # (the simulator, which models no retire relay).
    agent_name: str | None = None


@dataclass(frozen=True)
class CallRetire:
    delay_s: float = 0.0


@dataclass(frozen=True)
class CallAdopt:
    expect_incarnation: str | None
    delay_s: float = 0.0


@dataclass(frozen=True)
class Settled:
    kind: SettledKind
    reason: str
    retire_outcome: RetireOutcome | None = None
    # The agent process that answered the retire (recorded with its `AttemptRetired`).
    execution_generation: int | None = None
    execution_incarnation: str | None = None
    work: TryWork | None = None
    continuation: ContinuationRef | None = None
    resume: ResumeReport | None = None


@dataclass(frozen=True)
class Next:
    state: Retiring
    action: CallRetire | CallAdopt | Settled
    events: tuple[Event, ...] = ()


def checkpoint_to_name(state: Retiring, active: str | None) -> str | None:
    """The checkpoint a retire names: the one in flight here, unless the agent called it unknown."""
    return None if active is not None and active == state.unknown_checkpoint else active


def on(state: Retiring, got: Input, *, now: float, jitter: float, checkpoint_id: str | None) -> Next:
    """The next step after `got`, the answer to `state.calling` (made naming `checkpoint_id`)."""
    if isinstance(got, CallFailed):
        return _failed(state, got.error, now, jitter)
    if isinstance(got, DriverRefused):
        # Not a failure to retry, and nothing to owe: the agent holds nothing of this trainer.
        return Next(state, Settled("refused", got.message))
    if isinstance(got, RetireRefused):
        if got.kind == "stale":
            # The agent does not know our checkpoint (restarted mid-prepare, or finished it): it is
            # idle for that id, so retire without naming it.
            state = replace(state, unknown_checkpoint=checkpoint_id)
        elif got.kind == "conflict":
            state = replace(state, unknown_checkpoint=None)
        return _wait(state, f"retire refused: {got.kind}", now, jitter)
    if isinstance(got, RetireAnswer):
        return _retire_answered(state, got, checkpoint_id)
    return _adopted(state, got, now, jitter)


def _retire_answered(state: Retiring, got: RetireAnswer, checkpoint_id: str | None) -> Next:
    rid, n = state.rollout_id, state.attempt_index
    if got.completed_unacknowledged:
        events: tuple[Event, ...] = ()
        if not state.completed_recorded:
            events = (
                AttemptRetired(
                    rollout_id=rid,
                    attempt_index=n,
                    outcome="completed_unacknowledged",
                    checkpoint_id=checkpoint_id,
                    execution_generation=got.execution_generation,
                    execution_incarnation=got.execution_incarnation,
                ),
            )
        state = replace(
            state, calling="adopt", completed_recorded=True, adopt_incarnation=got.execution_incarnation
        )
        return Next(state, CallAdopt(got.execution_incarnation), events)
    who = (got.execution_generation, got.execution_incarnation)
    offer, resume = got.continuation, got.resume
    if got.retired:
        why = "retired while running"
        return Next(state, Settled("retired", why, "cancelled", *who, got.work, offer, resume))
    if got.tombstoned:
        why = "never started at the agent (tombstoned)"
        return Next(state, Settled("retired", why, "tombstoned", *who, None, offer, resume))
    why = got.detail or "already done for good at the agent"
    return Next(state, Settled("retired", why, "done", *who, None, offer, resume))


def _adopted(state: Retiring, got: AdoptResult, now: float, jitter: float) -> Next:
    if got.kind == "adopted":
        return Next(state, Settled("finished", "adopted"))
    if got.kind == "garbage":
        garbage = (*state.garbage, got.detail)
        state = replace(state, garbage=garbage, calling="retire")
        if len(garbage) >= ADOPT_GARBAGE_LIMIT:
            reason = (
                f"the agent holds a finished result it does not describe consistently "
                f"({len(garbage)} adoptions failed): {garbage[-1]}"
            )[:500]
            failed = RunFailed(
                rollout_id=state.rollout_id, attempt_index=state.attempt_index, reason=reason, kind="receipt"
            )
            return Next(state, Settled("stranded", reason), (failed,))
        return _failed(state, f"adoption answered garbage: {got.detail}", now, jitter)
    # not_found / other_incarnation / gone: whatever the agent holds now, retire tells us.
    return _failed(replace(state, calling="retire"), f"adoption: {got.kind} {got.detail}", now, jitter)


def _failed(state: Retiring, error: str, now: float, jitter: float) -> Next:
    failures = state.failures.failed(now, error)
    verdict = next_step(state.policy, failures, now, jitter)
    state = replace(state, failures=failures)
    if verdict.kind == "give_up":
        return _lost(state, verdict.reason)
    if state.calling == "adopt":
        return Next(state, CallAdopt(state.adopt_incarnation, verdict.delay_s))
    return Next(state, CallRetire(verdict.delay_s))


def _wait(state: Retiring, error: str, now: float, jitter: float) -> Next:
    waits = state.waits.failed(now, error)
    verdict = next_step(PHASE_WAIT_POLICY, waits, now, jitter)
    state = replace(state, waits=waits, calling="retire")
    if verdict.kind == "give_up":
        return _lost(state, f"a checkpoint phase kept the try from being retired: {verdict.reason}")
    return Next(state, CallRetire(verdict.delay_s))


def _lost(state: Retiring, reason: str) -> Next:
    reason = f"declared lost: {reason}"[:500]
    failed = RunFailed(
        rollout_id=state.rollout_id, attempt_index=state.attempt_index, reason=reason, kind="agent_lost"
    )
    if state.agent_name is None:
        return Next(state, Settled("lost", reason), (failed,))
    owed = RetireOwed(
        agent_name=state.agent_name,
        rollout_id=state.rollout_id,
        attempt_index=state.attempt_index,
        execution_incarnation=state.adopt_incarnation,
    )
    return Next(state, Settled("lost", reason), (failed, owed))
