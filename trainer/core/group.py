"""A group's moves: from the group's state folded from the log and one input, the events to append and
the attempts to settle (no I/O).  The group driver (`trainer/groups.py`) only performs them; the
recovery plan (`trainer.core.recovery`) asks the same functions, so a plan and what a driver does
cannot disagree.

Inputs, each answered by one function:

    the group is driven (a submit, a recovery)      round_next (prompt_group) / sibling_next (sibling)
    one attempt settled (its outcome)                on_attempt
    a prompt group's round given up (every outcome)  on_round
    an attempt's result kept                         kept: the seal or hold and the ACK debt, one append

A settled attempt ends in one of four ways (`ending`): `finished` (held or sealed: the keep append
recorded it), `interrupted` (infrastructure: a trainer or agent restart, a lost reply that had to be
retired, a checkpoint's retire, a deadline), `own_failure` (the environment failed, the result did not
verify, a masked sample under `mask_sample_retries`: the group's own data is at fault), `stranded` (a
finished result nobody can describe).  What comes next is the table `MOVES`, by mode, ending and
whether the group runs at target level `turn`; a spent retry budget dead-letters instead of replacing
or rerunning (`trainer.core.budget`).  The docs' diagram is drawn from the table
(`python -m trainer.diagrams --write`).

At level `turn` a prompt group keeps what it has: an interrupted sibling is replaced alone and its
replacement resumes the attempt's latest committed turn boundary, its finished siblings stay held, and
a sibling whose first attempt never left the trainer is sent; the group is rerun whole only for a
failure of its own.  At `sibling` and `prompt_group` a prompt group's round is one policy version:
anything that interrupts it reruns it whole (docs/protocol.md, Which policy a turn runs under).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final, Literal

from eventstore.events import (
    AckOwed,
    AttemptRetired,
    Event,
    GroupAbandoned,
    GroupDeadLettered,
    GroupSealed,
    Mode,
    ReplacementMinted,
    RetireCause,
    RolloutReceipt,
    SiblingHeld,
    SiblingSealed,
)
from projections.ledger import AttemptState, GroupState, SiblingState
from protocol import mutants
from protocol.wire import AttemptRef, AttemptWork, CompletionReceipt, ContinuationRef, ResumeReport
from trainer.core.attempt import resume_events
from trainer.core.budget import (
    AttemptAction,
    Budget,
    attempt_action,
    dead_letter_reason,
    failure_budget,
    lost_to_checkpoint,
    round_exhausted,
    sibling_exhausted,
)

OutcomeKind = Literal["finished", "owed", "retired", "stranded"]
Ending = Literal["finished", "interrupted", "own_failure", "stranded"]
Move = Literal["wait", "replace", "abandon", "dead_letter"]


@dataclass(frozen=True)
class AttemptOutcome:
    """How an attempt ended, as far as its group is concerned.

    finished: held or sealed (debt recorded); owed: the agent finished it but it is not usable
    (masked, unverifiable, or adopted after its group gave up) and its debt is recorded; retired: the
    agent cancelled or tombstoned it; stranded: the agent holds a finished result that answers garbage
    to every adoption, so it can be neither sealed, nor owed, nor replaced (the group is
    dead-lettered).  `recorded` says whether the `AttemptRetired` is in the log already (the driver
    appends `retire_events` otherwise, before it asks what comes next).
    """

    kind: OutcomeKind
    reason: str = ""
    retire_outcome: Literal["cancelled", "tombstoned", "done"] | None = None
    recorded: bool = False
    # The agent process that answered the retire (recorded with the `AttemptRetired`).
    execution_generation: int | None = None
    execution_incarnation: str | None = None
    # Set when a checkpoint's prepare retired it while running (recorded with the `AttemptRetired`).
    cause: RetireCause | None = None
    checkpoint_id: str | None = None
    # What the cancelled execution had done, as its agent measured it.
    work: AttemptWork | None = None
    # The attempt's latest committed turn boundary its agent offered with the retire, and what the
    # attempt did with the continuation it was asked to resume (docs/turns.md).
    continuation: ContinuationRef | None = None
    resume: ResumeReport | None = None


FINISHED: Final = AttemptOutcome("finished")
# A round interrupted between its dispatches: its attempts that never left the trainer end so.
NEVER_SENT: Final = AttemptOutcome("retired", "never sent: its round was interrupted between its dispatches")


def recorded_outcome(attempt: AttemptState) -> AttemptOutcome | None:
    """The outcome the log already holds for an attempt, if any."""
    if attempt.status in ("held", "sealed"):
        return FINISHED
    if attempt.receipt is not None:
        return AttemptOutcome("owed", "finished at the agent; result not kept")
    if attempt.retire_outcome in ("cancelled", "tombstoned", "done"):
        return AttemptOutcome(
            "retired", "retired", attempt.retire_outcome, recorded=True, continuation=attempt.offered
        )
    if attempt.status in ("retired", "discarded"):  # discarded: thrown away with its round, settled
        return AttemptOutcome("retired", attempt.status, recorded=True, continuation=attempt.offered)
    return None


def retire_events(rollout_id: str, attempt_index: int, outcome: AttemptOutcome) -> list[Event]:
    """What the log does not hold yet of an attempt that ended retired: its `AttemptRetired` (and what
    it did with a continuation it was asked to resume).  The driver appends these before it asks the
    group's next move, so the budget rules read them."""
    if outcome.kind != "retired" or outcome.recorded or outcome.retire_outcome is None:
        return []
    return [
        *resume_events(rollout_id, attempt_index, outcome.resume),
        AttemptRetired(
            rollout_id=rollout_id,
            attempt_index=attempt_index,
            outcome=outcome.retire_outcome,
            execution_generation=outcome.execution_generation,
            execution_incarnation=outcome.execution_incarnation,
            checkpoint_id=outcome.checkpoint_id,
            cause=outcome.cause,
            work=outcome.work,
            continuation=outcome.continuation,
        ),
    ]


# --- the table -------------------------------------------------------------------------------------

# (mode, ending, at target level turn) -> the move, when no budget is spent.  `replace` mints the
# sibling's next attempt (resuming its offered boundary at level turn: `continuation_to_resume`);
# `abandon` gives the prompt group's round up and reruns it whole; `wait` lets the sibling's keep
# append stand (sealed, or held until its round is complete).
MOVES: Final[dict[tuple[Mode, Ending, bool], Move]] = {
    ("sibling", "finished", False): "wait",
    ("sibling", "finished", True): "wait",
    ("sibling", "interrupted", False): "replace",
    ("sibling", "interrupted", True): "replace",
    ("sibling", "own_failure", False): "replace",
    ("sibling", "own_failure", True): "replace",
    ("sibling", "stranded", False): "dead_letter",
    ("sibling", "stranded", True): "dead_letter",
    ("prompt_group", "finished", False): "wait",
    ("prompt_group", "finished", True): "wait",
    ("prompt_group", "interrupted", False): "abandon",
    ("prompt_group", "interrupted", True): "replace",
    ("prompt_group", "own_failure", False): "abandon",
    ("prompt_group", "own_failure", True): "abandon",
    ("prompt_group", "stranded", False): "dead_letter",
    ("prompt_group", "stranded", True): "dead_letter",
}


def ending(attempt: AttemptState | None, outcome: AttemptOutcome) -> Ending:
    """How the attempt ended, from its outcome and what the log recorded of it: a retire is an
    interruption unless the attempt's own recorded failures say its data is at fault."""
    if outcome.kind == "finished":
        return "finished"
    if outcome.kind == "stranded":
        return "stranded"
    if outcome.kind == "owed":
        return "own_failure"  # finished at the agent, not usable: masked or unverifiable
    if outcome.cause == "checkpoint" or attempt is None:
        return "interrupted"
    if attempt.mask_sample or failure_budget(attempt) == "data":
        return "own_failure"
    return "interrupted"


def move_of(group: GroupState, attempt: AttemptState | None, outcome: AttemptOutcome) -> Move:
    return MOVES[(group.mode, ending(attempt, outcome), group.target_level == "turn")]


# --- decisions -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Decision:
    """What the driver does next: append `events` (one append), then settle the current attempts of
    the siblings `settle` names (each with the action it needs)."""

    move: Literal["settle", "wait", "seal", "replace", "resume", "abandon", "dead_letter", "give_up", "done"]
    events: tuple[Event, ...] = ()
    settle: tuple[tuple[int, AttemptAction], ...] = ()
    reason: str = ""
    budget: Budget | None = None
    # prompt_group: a round whose attempts partly never left the trainer (a crash between dispatches);
    # at levels other than turn those end as `NEVER_SENT` and the round is rerun whole.
    interrupted: bool = False

    @property
    def done(self) -> bool:
        return self.move == "done"


def continuation_to_resume(
    group: GroupState, replaced: AttemptState, offer: ContinuationRef | None = None
) -> ContinuationRef | None:
    """What a replacement of `replaced` resumes (docs/turns.md): at target level `turn`, the
    continuation the replaced attempt's agent offered with its retire (`offer`, or the one the log
    recorded), if it is of the same rollout; otherwise nothing, and it plays from its prompt."""
    offer = offer or replaced.offered
    if group.target_level != "turn" or offer is None or offer.rollout_id != replaced.rollout_id:
        return None
    return offer


def _replacement(
    group: GroupState, sibling: SiblingState, reason: str, offer: ContinuationRef | None
) -> ReplacementMinted:
    n = sibling.current_attempt
    return ReplacementMinted(
        rollout_id=sibling.rollout_id,
        generation_index=sibling.generation_index,
        attempt_index=n + 1,
        replaces=n,
        reason=reason[:300],
        continues=continuation_to_resume(group, sibling.attempts[n], offer),
    )


def _dead_letter(group: GroupState, reason: str, budget: Budget | None) -> GroupDeadLettered:
    attempts = [
        AttemptRef(rollout_id=s.rollout_id, attempt_index=a)
        for s in sorted(group.siblings.values(), key=lambda s: s.generation_index)
        for a in sorted(s.attempts)
    ]
    # Why first (the budget spent, or the stranded attempt), then every attempt's recorded failures.
    reasons = [
        reason,
        *(
            f"{s.rollout_id}#{a.attempt_index}: {f}"
            for s in group.siblings.values()
            for a in s.attempts.values()
            for f in a.failures
        ),
    ]
    return GroupDeadLettered(
        group_id=group.group_id, attempts=attempts, reasons=[r[:300] for r in reasons[:100]], budget=budget
    )


def dead_letter(group: GroupState, reason: str, budget: Budget | None) -> Decision:
    return Decision("dead_letter", (_dead_letter(group, reason, budget),), reason=reason, budget=budget)


def _budget_of(group: GroupState, sibling: SiblingState) -> Budget | None:
    """The budget spent, for a replacement of `sibling`: its own attempts in sibling mode, the group's
    rounds (attempt indexes) in prompt_group mode."""
    return sibling_exhausted(group, sibling) if group.mode == "sibling" else round_exhausted(group)


def on_attempt(group: GroupState, generation_index: int, outcome: AttemptOutcome) -> Decision:
    """One sibling's current attempt settled (its retire events already in the log).

    `wait`: nothing to do (sealed, or held until its round completes); `replace`/`resume`: append the
    replacement, then settle it; `dead_letter`: append it (sibling mode) or, in a prompt group, give
    the round up first; `give_up`: a prompt group's round ends here (the driver settles the rest, then
    asks `on_round`)."""
    if group.status != "open":
        return Decision("done")
    sibling = group.siblings[generation_index]
    attempt = sibling.current
    move = move_of(group, attempt, outcome)
    if move == "wait":
        return Decision("wait")
    if move == "abandon":
        return Decision("give_up", reason=outcome.reason)
    if move == "dead_letter":
        # A stranded attempt may still be finished at the agent: never replaced (retire-before-replace).
        if group.mode == "prompt_group":
            return Decision("give_up", reason=outcome.reason)
        return dead_letter(group, outcome.reason, None)
    budget = _budget_of(group, sibling)
    if budget is not None:
        if group.mode == "prompt_group":
            return Decision("give_up", reason=outcome.reason, budget=budget)
        return dead_letter(group, dead_letter_reason(budget, group), budget)
    replacement = _replacement(group, sibling, outcome.reason or outcome.kind, outcome.continuation)
    return Decision(
        "resume" if replacement.continues is not None else "replace",
        (replacement,),
        settle=((generation_index, "dispatch"),),
        reason=outcome.reason,
    )


def on_round(group: GroupState, outcomes: Mapping[int, AttemptOutcome]) -> Decision:
    """A prompt group's round given up, every sibling's outcome in (their retire events in the log):
    rerun it whole (`abandon`: `GroupAbandoned` and a replacement of every sibling), or dead-letter it
    when a budget is spent or an attempt stranded.  A round whose every attempt finished is `wait`
    (sealed by its last hold)."""
    if group.status != "open":
        return Decision("done")
    failed = {gi: o for gi, o in outcomes.items() if o.kind != "finished"}
    if not failed:
        return Decision("wait")
    reason = "; ".join(f"g{gi}: {o.reason}" for gi, o in sorted(failed.items()))[:500]
    budget = round_exhausted(group)
    if budget is not None or any(o.kind == "stranded" for o in failed.values()):
        why = reason if budget is None else f"{dead_letter_reason(budget, group)}; {reason}"
        return dead_letter(group, why[:500], budget)
    siblings = [group.siblings[gi] for gi in sorted(outcomes)]
    refs = [AttemptRef(rollout_id=s.rollout_id, attempt_index=s.current_attempt) for s in siblings]
    replacements = [
        _replacement(group, s, f"group abandoned: {reason}", outcomes[s.generation_index].continuation)
        for s in siblings
    ]
    return Decision(
        "abandon",
        (GroupAbandoned(group_id=group.group_id, reason=reason, attempts=refs), *replacements),
        settle=tuple((s.generation_index, "dispatch") for s in siblings),
        reason=reason,
    )


def sibling_next(group: GroupState, generation_index: int) -> Decision:
    """sibling mode: what one sibling needs when its driver takes it (at submit, at recovery, after a
    replacement): `done` once sealed, `settle` its current attempt, or, if the log holds its attempt's
    end already (a crash between that record and the next move), that end's move."""
    if group.status != "open":
        return Decision("done")
    sibling = group.siblings[generation_index]
    attempt = sibling.current
    if sibling.status == "sealed" or attempt is None:
        return Decision("done")
    action = attempt_action(attempt)
    if action is not None:
        return Decision("settle", settle=((generation_index, action),))
    known = recorded_outcome(attempt)
    if known is None or known.kind == "finished":
        return Decision("done")
    return on_attempt(group, generation_index, known)


def round_next(group: GroupState) -> Decision:
    """prompt_group: what the current round needs when the driver takes the group (at submit, at
    recovery, after a rerun).

    Every sibling held: `seal` (its last hold's append seals; a log that stopped in between is sealed
    here).  A sibling whose attempt ended and was not replaced (a crash between that record and the
    next move): that end's move (at level turn an interruption replaces the sibling alone; otherwise
    the round is given up, its other attempts settled first).  Some attempts sent and some never
    (a crash between dispatches): at level turn the rest are sent; otherwise the round is given up
    (`interrupted`: the unsent ones end as `NEVER_SENT`), the sent ones settled first.  Otherwise
    `settle` what each attempt needs."""
    if group.status != "open":
        return Decision("done")
    siblings = sorted(group.siblings.values(), key=lambda s: s.generation_index)
    if siblings and all(s.status == "held" for s in siblings):
        return Decision("seal", tuple(seal_if_complete(group)))
    settle = tuple(
        (s.generation_index, action)
        for s in siblings
        if s.current is not None and (action := attempt_action(s.current)) is not None
    )
    for s in siblings:
        known = recorded_outcome(s.current) if s.current is not None else None
        if known is not None and known.kind != "finished":
            decided = on_attempt(group, s.generation_index, known)
            if decided.move == "give_up":
                return Decision("give_up", settle=settle, reason=decided.reason, budget=decided.budget)
            if decided.move in ("replace", "resume"):
                return decided
    unsent = [gi for gi, action in settle if action == "dispatch"]
    sent = [gi for gi, action in settle if action != "dispatch"]
    held = [s for s in siblings if s.status == "held"]
    if unsent and (sent or held) and group.target_level != "turn":
        # Sending the rest now would start them after the others: at levels other than turn the
        # round is one policy version, so it is rerun whole, after settling (adopting or retiring)
        # what already left, so nothing strands.
        return Decision(
            "give_up",
            settle=tuple(item for item in settle if item[1] != "dispatch"),
            reason="round interrupted between its dispatches",
            interrupted=True,
        )
    return Decision("settle", settle=settle)


# --- keeping a result: the seal rule ----------------------------------------------------------------


def kept(
    group: GroupState | None, agent_name: str, rollout_receipt: RolloutReceipt, receipt: CompletionReceipt
) -> list[Event]:
    """What the log records with an attempt's kept result, in the same append as its receipt: the seal
    (sibling mode) or hold (prompt_group), and the ACK debt as the sibling arrives (never only once
    its group seals: a group that fails part-way would strand its finished siblings' results).  The
    group's seal when it is complete.  A group no longer open gets the debt alone."""
    owed = AckOwed(agent_name=agent_name, receipt=receipt)
    if group is None or group.status != "open":
        return [owed]
    rid, n = rollout_receipt.rollout_id, rollout_receipt.attempt_index
    if group.mode == "sibling":
        events: list[Event] = [
            SiblingSealed(
                rollout_id=rid, attempt_index=n, reward=rollout_receipt.reward, receipt=rollout_receipt
            ),
            owed,
        ]
        if all(s.status == "sealed" for s in group.siblings.values() if s.rollout_id != rid):
            events.append(GroupSealed(group_id=group.group_id, attempts=_sealed_refs(group, rid, n)))
        return events
    if mutants.active("pg_debt_at_group_seal"):
        sealed = seal_if_complete(group, rollout_receipt)
        held = [a.receipt for s in group.siblings.values() if (a := s.current)]
        owed_all = [AckOwed(agent_name=group.agent_name, receipt=r) for r in [receipt, *held] if r]
        return [
            SiblingHeld(rollout_id=rid, attempt_index=n, receipt=rollout_receipt),
            *sealed,
            *(owed_all if sealed else []),
        ]
    return [
        SiblingHeld(rollout_id=rid, attempt_index=n, receipt=rollout_receipt),
        owed,
        *seal_if_complete(group, rollout_receipt),
    ]


def seal_if_complete(group: GroupState, held: RolloutReceipt | None = None) -> list[Event]:
    """prompt_group: once every sibling's current attempt is held (`held` the one arriving now),
    `SiblingSealed` x G + `GroupSealed`."""
    receipts: list[RolloutReceipt] = []
    for sibling in sorted(group.siblings.values(), key=lambda s: s.generation_index):
        if held is not None and sibling.rollout_id == held.rollout_id:
            receipts.append(held)
            continue
        current = sibling.current
        if sibling.status != "held" or current is None or current.rollout_receipt is None:
            return []
        receipts.append(current.rollout_receipt)
    seals: list[Event] = [
        SiblingSealed(rollout_id=r.rollout_id, attempt_index=r.attempt_index, reward=r.reward, receipt=r)
        for r in receipts
    ]
    refs = [AttemptRef(rollout_id=r.rollout_id, attempt_index=r.attempt_index) for r in receipts]
    return [*seals, GroupSealed(group_id=group.group_id, attempts=refs)]


def _sealed_refs(group: GroupState, rid: str, n: int) -> list[AttemptRef]:
    refs = []
    for sibling in sorted(group.siblings.values(), key=lambda s: s.generation_index):
        index = n if sibling.rollout_id == rid else sibling.sealed_attempt
        refs.append(
            AttemptRef(rollout_id=sibling.rollout_id, attempt_index=index if index is not None else 0)
        )
    return refs


__all__ = [
    "FINISHED",
    "MOVES",
    "NEVER_SENT",
    "AttemptOutcome",
    "Decision",
    "continuation_to_resume",
    "dead_letter",
    "ending",
    "kept",
    "lost_to_checkpoint",
    "on_attempt",
    "on_round",
    "recorded_outcome",
    "retire_events",
    "round_next",
    "seal_if_complete",
    "sibling_next",
]
