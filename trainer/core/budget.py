"""What a group's attempts have spent of its retry budgets, from the group's folded state alone (the
group's moves, `trainer.core.group`, ask it before they replace or rerun anything).

What an attempt needs before its group can move on:

    minted -> dispatch; replied or completed_unacknowledged -> adopt;
    dispatched or failed -> retire_or_adopt; held/sealed/retired/discarded -> none

Two retry budgets, each with its own dead-letter reason: infrastructure failures (the agent away, a
transport error, a deadline: another attempt may well succeed) and data failures (the environment failed,
the result did not verify, the sample was masked: the prompt itself may be at fault).  `max_tries`
caps the attempts of a sibling (or the rounds of a prompt group) whatever their causes, but one: an attempt a
checkpoint's prepare retired as its last resort (`AttemptRetired` cause `checkpoint`) is the trainer's
doing and spends no budget; the trainer bounds those per rollout instead (trainer.core.blocking).
"""

from __future__ import annotations

from typing import Literal

from eventstore.events import RetryBudget
from projections.ledger import AttemptState, GroupState, SiblingState
from protocol.failures import DATA_RUN_FAILURES, FINAL_RUN_FAILURES, budget_of_failure_kind

AttemptAction = Literal["adopt", "retire_or_adopt", "dispatch"]
Budget = RetryBudget

# An attempt in these states may be running at the agent, or finished there without the trainer knowing.
_IN_FLIGHT: frozenset[str] = frozenset({"dispatched", "failed"})


def attempt_action(attempt: AttemptState) -> AttemptAction | None:
    """What an attempt needs before its group can move on (None: it owns its outcome already)."""
    if attempt.status == "minted":
        return "dispatch"
    if attempt.status == "replied" or attempt.retire_outcome == "completed_unacknowledged":
        return "adopt"
    if attempt.status in _IN_FLIGHT:
        return "retire_or_adopt"
    return None


def failure_budget(attempt: AttemptState) -> Literal["infra", "data"]:
    """Which budget an attempt that ended without a usable result spends: a masked reply's the one its Gym
    `failure_kind` names (`protocol.failures`; data when it names none), else by the failures."""
    if attempt.mask_sample:
        return budget_of_failure_kind(attempt.failure_kind) if attempt.failure_kind else "data"
    kinds = {f.partition(":")[0] for f in attempt.failures}
    return "data" if kinds & DATA_RUN_FAILURES else "infra"


def refused(attempt: AttemptState) -> bool:
    """The agent refused the attempt's request itself: every later attempt would be refused the same way."""
    return any(f.partition(":")[0] in FINAL_RUN_FAILURES for f in attempt.failures)


def lost_to_checkpoint(attempt: AttemptState) -> bool:
    """A checkpoint's prepare retired the attempt as its last resort: the trainer's doing, not the attempt's
    failure, so it spends no budget (a rollout loses at most `max_checkpoint_retires` attempts so)."""
    return attempt.retire_cause == "checkpoint"


def checkpoint_losses(group: GroupState, sibling: SiblingState) -> int:
    """Attempts this sibling's rollout lost to checkpoints: its own in sibling mode; in prompt_group mode
    the group's rounds (a round lost to a checkpoint throws every sibling's attempt away with it)."""
    if group.mode == "prompt_group":
        rounds = {
            a.attempt_index
            for s in group.siblings.values()
            for a in s.attempts.values()
            if lost_to_checkpoint(a)
        }
        return len(rounds)
    return sum(1 for a in sibling.attempts.values() if lost_to_checkpoint(a))


def spent(group: GroupState, attempts: list[AttemptState]) -> dict[Budget, int]:
    """The failures of `attempts` (settled without a result) counted against each budget; an attempt lost
    to a checkpoint counts against none."""
    counted = [a for a in attempts if not lost_to_checkpoint(a)]
    counts: dict[Budget, int] = {"infra": 0, "data": 0, "tries": len(counted)}
    for attempt in counted:
        if attempt.status in ("retired", "discarded", "failed"):
            counts[failure_budget(attempt)] += 1
    return counts


def exhausted_budget(group: GroupState, attempts: list[AttemptState]) -> Budget | None:
    """The budget a sibling's (or a round's) attempts so far have spent, if any: no new attempt then."""
    if any(refused(a) for a in attempts):
        return "data"
    counts = spent(group, attempts)
    if counts["tries"] >= group.max_tries:
        return "tries"
    if counts["infra"] >= group.max_infra_failures:
        return "infra"
    if counts["data"] >= group.max_data_failures:
        return "data"
    return None


def dead_letter_reason(budget: Budget, group: GroupState) -> str:
    if budget == "data":
        first = next((a for s in group.siblings.values() for a in s.attempts.values() if refused(a)), None)
        if first is not None:
            why = next(f for f in first.failures if f.partition(":")[0] in FINAL_RUN_FAILURES)
            return (
                f"data budget spent: the agent refused {first.rollout_id}#{first.attempt_index}'s request "
                f"itself, and a retry sends the same request ({why})"
            )[:500]
    limits = {
        "tries": f"max_tries={group.max_tries}",
        "infra": f"max_infra_failures={group.max_infra_failures}",
        "data": f"max_data_failures={group.max_data_failures}",
    }
    return f"{budget} budget spent ({limits[budget]})"


def round_exhausted(group: GroupState) -> Budget | None:
    """prompt_group: the budget the rounds so far have spent (each round counts once, for the kind
    of its first failed attempt); a refused attempt of any round spends the data budget at once."""
    if any(refused(a) for s in group.siblings.values() for a in s.attempts.values()):
        return "data"
    rounds = [_round_attempts(group, n) for n in range(group.attempts_used)]
    return exhausted_budget(group, [r for r in rounds if r is not None])


def _round_attempts(group: GroupState, round_index: int) -> AttemptState | None:
    """One try standing for a finished round: its attempt lost to a checkpoint (the round spends no
    budget then), else its first attempt that failed, else any of the round."""
    tries = [s.attempts[round_index] for s in group.siblings.values() if round_index in s.attempts]
    lost = [a for a in tries if lost_to_checkpoint(a)]
    if lost:
        return lost[0]
    failed = [a for a in tries if a.status in ("retired", "discarded", "failed")]
    found = failed or tries
    return found[0] if found else None


def sibling_exhausted(group: GroupState, sibling: SiblingState) -> Budget | None:
    return exhausted_budget(group, [sibling.attempts[i] for i in sorted(sibling.attempts)])
