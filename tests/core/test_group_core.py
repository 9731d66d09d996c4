"""The group's budgets and moves, shared by the recovery plan and the drivers (trainer.core.budget,
trainer.core.group): table row by table row, without a server."""

from __future__ import annotations

from eventstore.events import PromptRef
from projections.ledger import AttemptState, AttemptStatus, GroupState, SiblingState
from trainer.core.budget import (
    attempt_action,
    checkpoint_losses,
    dead_letter_reason,
    failure_budget,
    round_exhausted,
    sibling_exhausted,
)
from trainer.core.group import NEVER_SENT, AttemptOutcome, on_round, round_next


def attempt(gi: int, n: int, status: AttemptStatus, *failures: str, mask: bool | None = None) -> AttemptState:
    return AttemptState(
        rollout_id=f"g_g{gi}",
        attempt_index=n,
        status=status,
        failures=list(failures),
        mask_sample=mask,
    )


def group(mode: str, siblings: dict[int, list[AttemptState]], **budgets: int) -> GroupState:
    g = GroupState(
        group_id="g",
        agent_name="a",
        mode=mode,  # type: ignore[arg-type]
        expected_generations=len(siblings),
        max_tries=budgets.get("max_tries", 4),
        max_infra_failures=budgets.get("infra", 4),
        max_data_failures=budgets.get("data", 4),
        prompt_ref=PromptRef(sample_id="s", task_name="t"),
    )
    for gi, tries in siblings.items():
        held = tries[-1].status == "held"
        g.siblings[gi] = SiblingState(
            rollout_id=f"g_g{gi}",
            generation_index=gi,
            current_attempt=tries[-1].attempt_index,
            status="held" if held else "pending",
            attempts={a.attempt_index: a for a in tries},
        )
    g.attempts_used = max(len(t) for t in siblings.values())
    return g


def test_what_each_try_needs() -> None:
    assert attempt_action(attempt(0, 0, "minted")) == "dispatch"
    assert attempt_action(attempt(0, 0, "replied")) == "adopt"
    assert attempt_action(attempt(0, 0, "dispatched")) == "retire_or_adopt"
    assert attempt_action(attempt(0, 0, "failed", "http: 503")) == "retire_or_adopt"
    for settled in ("held", "sealed", "retired", "discarded"):
        assert attempt_action(attempt(0, 0, settled)) is None
    finished_there = attempt(0, 0, "failed")
    finished_there.retire_outcome = "completed_unacknowledged"
    assert attempt_action(finished_there) == "adopt"


def test_failures_are_counted_against_the_infra_or_the_data_budget() -> None:
    assert failure_budget(attempt(0, 0, "retired", "agent_lost: gone")) == "infra"
    assert failure_budget(attempt(0, 0, "retired", "deadline: slow")) == "infra"
    assert failure_budget(attempt(0, 0, "retired", "env: tool crashed")) == "data"
    assert failure_budget(attempt(0, 0, "discarded", "verify: digest")) == "data"
    assert failure_budget(attempt(0, 0, "discarded", mask=True)) == "data"


def test_a_sibling_dead_letters_on_the_first_budget_spent() -> None:
    data = [attempt(0, 0, "retired", "env: x"), attempt(0, 1, "retired", "env: y")]
    g = group("sibling", {0: data}, data=2)
    assert sibling_exhausted(g, g.siblings[0]) == "data"
    assert "max_data_failures=2" in dead_letter_reason("data", g)
    infra = [attempt(0, 0, "retired", "http: 503")]
    g = group("sibling", {0: infra}, infra=1)
    assert sibling_exhausted(g, g.siblings[0]) == "infra"
    g = group("sibling", {0: [attempt(0, 0, "retired", "http: 503")]}, max_tries=2)
    assert sibling_exhausted(g, g.siblings[0]) is None
    g = group("sibling", {0: [*infra, attempt(0, 1, "retired", "env: z")]}, max_tries=2)
    assert sibling_exhausted(g, g.siblings[0]) == "tries"


def test_an_interrupted_round_is_continued_not_rerun() -> None:
    """Case 9: three siblings held, the fourth in flight when the trainer died: settle (adopt or
    retire) the fourth; the round is rerun only if it fails."""
    held = {gi: [attempt(gi, 0, "held")] for gi in range(3)}
    g = group("prompt_group", {**held, 3: [attempt(3, 0, "dispatched")]})
    step = round_next(g)
    assert step.move == "settle"
    assert step.settle == ((3, "retire_or_adopt"),)
    g.siblings[3].attempts[0].status = "retired"
    g.siblings[3].attempts[0].retire_outcome = "cancelled"
    assert round_next(g).move == "give_up"  # then rerun whole (on_round), at levels other than turn


def test_a_round_seals_when_every_sibling_is_held_and_dead_letters_when_spent() -> None:
    g = group("prompt_group", {gi: [attempt(gi, 0, "held")] for gi in range(2)})
    assert round_next(g).move == "seal"
    g = group("prompt_group", {0: [attempt(0, 0, "held")], 1: [attempt(1, 0, "retired", "env: bad")]}, data=1)
    assert round_next(g).move == "give_up"
    step = on_round(
        g, {0: AttemptOutcome("finished"), 1: AttemptOutcome("retired", "env: bad", recorded=True)}
    )
    assert step.move == "dead_letter" and "data budget" in step.reason


def test_a_round_interrupted_between_its_dispatches_is_rerun_not_completed() -> None:
    """Sending the unsent try now would mix policy versions within the group."""
    g = group(
        "prompt_group",
        {0: [attempt(0, 0, "held")], 1: [attempt(1, 0, "dispatched")], 2: [attempt(2, 0, "minted")]},
    )
    step = round_next(g)
    assert step.move == "give_up" and step.interrupted
    assert step.settle == ((1, "retire_or_adopt"),)
    fresh = group("prompt_group", {gi: [attempt(gi, 0, "minted")] for gi in range(3)})
    assert round_next(fresh).move == "settle" and not round_next(fresh).interrupted
    spent = group(
        "prompt_group", {0: [attempt(0, 0, "dispatched")], 1: [attempt(1, 0, "minted")]}, max_tries=1
    )
    assert round_next(spent).move == "give_up" and round_exhausted(spent) == "tries"
    retired = AttemptOutcome("retired", "retired", "cancelled")
    assert on_round(spent, {0: retired, 1: NEVER_SENT}).move == "dead_letter"


def test_a_refused_request_ends_the_retries_at_once() -> None:
    """A 400/413/422 refusal is the data budget spent on its first try, in both modes: the next try
    would send the same request and be refused the same way."""
    refused = attempt(0, 0, "retired", "refused: POST /run: HTTP 413 payload_too_large: too big")
    sibling_group = group("sibling", {0: [refused]})
    assert sibling_exhausted(sibling_group, sibling_group.siblings[0]) == "data"
    assert "refused g_g0#0's request itself" in dead_letter_reason("data", sibling_group)
    # prompt_group: whichever sibling was refused, the round is dead-lettered, not rerun.
    other = attempt(0, 0, "retired", "http: 503")
    rounds = group("prompt_group", {0: [other], 1: [attempt(1, 0, "retired", "refused: HTTP 422")]})
    assert round_next(rounds).move == "give_up" and round_exhausted(rounds) == "data"
    # A retryable failure still leaves room for another try.
    assert (
        sibling_exhausted(group("sibling", {0: [other]}), group("sibling", {0: [other]}).siblings[0]) is None
    )


def _lost(gi: int, n: int) -> AttemptState:
    lost = attempt(gi, n, "retired")
    lost.retire_cause = "checkpoint"
    return lost


def test_a_try_lost_to_a_checkpoint_spends_no_budget() -> None:
    # sibling mode: one try per budget, the first lost to a checkpoint: not exhausted.
    g = group("sibling", {0: [_lost(0, 0)]}, max_tries=1, infra=1)
    assert sibling_exhausted(g, g.siblings[0]) is None
    assert checkpoint_losses(g, g.siblings[0]) == 1
    # A stalled try (stuck, not the checkpoint's doing) spends the infra budget like any retire.
    stalled = attempt(0, 0, "retired")
    stalled.retire_cause = "stalled"
    g = group("sibling", {0: [stalled]}, max_tries=1, infra=1)
    assert sibling_exhausted(g, g.siblings[0]) == "tries"
    # prompt_group: a round lost to a checkpoint is not counted, its other siblings' retires neither.
    g = group("prompt_group", {0: [_lost(0, 0)], 1: [attempt(1, 0, "retired")]}, max_tries=1, infra=1)
    assert round_exhausted(g) is None
    assert checkpoint_losses(g, g.siblings[1]) == 1  # the group's rounds, for every sibling
    g = group("prompt_group", {0: [attempt(0, 0, "retired")], 1: [attempt(1, 0, "retired")]}, max_tries=1)
    assert round_exhausted(g) == "tries"
