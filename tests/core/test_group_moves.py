"""The group's moves (trainer.core.group): the table, each input's decision, the seal rule and the
docs drawn from the table, without a server."""

from __future__ import annotations

from pathlib import Path
from typing import get_args

import pytest

from eventstore.events import (
    AckOwed,
    GroupAbandoned,
    GroupDeadLettered,
    GroupSealed,
    Mode,
    ReplacementMinted,
    RolloutReceipt,
    SiblingHeld,
    SiblingSealed,
)
from projections.ledger import AttemptState, GroupState
from protocol.digests import sha256_digest
from protocol.ids import capture_key
from protocol.wire import CompletionReceipt, ContinuationRef
from tests.core.test_group_core import attempt, group
from trainer.core.group import (
    MOVES,
    NEVER_SENT,
    AttemptOutcome,
    Ending,
    ending,
    kept,
    on_attempt,
    on_round,
    recorded_outcome,
    retire_events,
    round_next,
    sibling_next,
)
from trainer.diagrams import with_generated

DOC = Path(__file__).resolve().parents[2] / "docs" / "state-machines.md"
FINISHED = AttemptOutcome("finished")
INTERRUPTED = AttemptOutcome("retired", "retired while running", "cancelled")


def offer(gi: int, n: int, turn: int = 2) -> ContinuationRef:
    rid = f"g_g{gi}"
    return ContinuationRef(
        rollout_id=rid,
        source_attempt=n,
        lineage=capture_key(rid, 0),
        turn=turn,
        digest=sha256_digest(f"{rid}/{n}/{turn}".encode()),
        prompt_digest=sha256_digest(b"prompt"),
        model_call_ids=[f"call-{i}" for i in range(turn)],
        generated_tokens=10 * turn,
    )


def at_level(g: GroupState, level: str) -> GroupState:
    g.target_level = level  # type: ignore[assignment]
    return g


def interrupted_at(gi: int, n: int, *failures: str) -> AttemptState:
    a = attempt(gi, n, "retired", *failures)
    a.retire_outcome = "cancelled"
    a.offered = offer(gi, n)
    return a


def receipts(gi: int, n: int = 0) -> tuple[RolloutReceipt, CompletionReceipt]:
    rid = f"g_g{gi}"
    key = capture_key(rid, n)
    digest = sha256_digest(key.encode())
    rollout = RolloutReceipt(
        rollout_id=rid,
        attempt_index=n,
        capture_key=key,
        model_call_ids=["c"],
        terminal_model_call_id="c",
        token_count=3,
        tokens_digest=digest,
        reward=1.0,
        mask_sample=False,
    )
    receipt = CompletionReceipt(
        rollout_id=rid,
        attempt_index=n,
        execution_generation=1,
        result_identity=key,
        result_digest=digest,
        manifest_capture_key=key,
        terminal_model_call_id="c",
    )
    return rollout, receipt


def held(gi: int, n: int = 0) -> AttemptState:
    a = attempt(gi, n, "held")
    a.rollout_receipt = receipts(gi, n)[0]
    return a


# --- the table -------------------------------------------------------------------------------------


def test_the_table_names_a_move_for_every_mode_ending_and_level() -> None:
    keys = {(m, e, t) for m in get_args(Mode) for e in get_args(Ending) for t in (True, False)}
    assert set(MOVES) == keys
    # What the level changes, and only there: a prompt group interrupted at level turn keeps its round.
    differs = {k[:2] for k in keys if MOVES[(k[0], k[1], True)] != MOVES[(k[0], k[1], False)]}
    assert differs == {("prompt_group", "interrupted")}
    assert MOVES[("prompt_group", "interrupted", True)] == "replace"
    assert MOVES[("prompt_group", "interrupted", False)] == "abandon"
    assert MOVES[("prompt_group", "own_failure", True)] == "abandon"


@pytest.mark.parametrize(
    ("failures", "mask", "outcome", "expected"),
    [
        ((), None, FINISHED, "finished"),
        ((), None, AttemptOutcome("stranded", "garbage"), "stranded"),
        ((), None, AttemptOutcome("owed", "unverifiable: x"), "own_failure"),
        (("agent_lost: gone",), None, INTERRUPTED, "interrupted"),
        (("deadline: slow",), None, INTERRUPTED, "interrupted"),
        ((), None, INTERRUPTED, "interrupted"),  # a trainer restart: retired with no failure of its own
        (("env: tool crashed",), None, INTERRUPTED, "own_failure"),
        (("refused: HTTP 422",), None, INTERRUPTED, "own_failure"),
        ((), True, INTERRUPTED, "own_failure"),
        (("env: x",), None, AttemptOutcome("retired", "x", "cancelled", cause="checkpoint"), "interrupted"),
    ],
)
def test_how_an_attempt_ended(
    failures: tuple[str, ...], mask: bool | None, outcome: AttemptOutcome, expected: Ending
) -> None:
    assert ending(attempt(0, 0, "retired", *failures, mask=mask), outcome) == expected


# --- one attempt settled ---------------------------------------------------------------------------


def test_at_level_turn_an_interrupted_sibling_of_a_prompt_group_is_replaced_alone_and_resumes() -> None:
    g = at_level(group("prompt_group", {0: [held(0)], 1: [interrupted_at(1, 0)], 2: [held(2)]}), "turn")
    decision = on_attempt(g, 1, recorded_outcome(g.siblings[1].attempts[0]) or INTERRUPTED)
    assert decision.move == "resume" and decision.settle == ((1, "dispatch"),)
    [replacement] = decision.events
    assert isinstance(replacement, ReplacementMinted)
    assert (replacement.rollout_id, replacement.attempt_index, replacement.replaces) == ("g_g1", 1, 0)
    assert replacement.continues == offer(1, 0)
    # Without an offer (the agent lost its state) it is still replaced alone, from its prompt.
    g.siblings[1].attempts[0].offered = None
    assert on_attempt(g, 1, INTERRUPTED).move == "replace"


def test_below_level_turn_an_interrupted_round_is_given_up() -> None:
    for level in ("sibling", "prompt_group"):
        g = at_level(group("prompt_group", {0: [held(0)], 1: [interrupted_at(1, 0)]}), level)
        assert on_attempt(g, 1, INTERRUPTED).move == "give_up"


def test_a_failure_of_its_own_gives_the_round_up_at_every_level() -> None:
    for level in ("turn", "sibling"):
        g = at_level(group("prompt_group", {0: [held(0)], 1: [interrupted_at(1, 0, "env: bad")]}), level)
        assert on_attempt(g, 1, INTERRUPTED).move == "give_up"
        assert on_attempt(g, 1, AttemptOutcome("owed", "mask_sample: x")).move == "give_up"


def test_a_spent_budget_dead_letters_instead_of_replacing() -> None:
    g = group("sibling", {0: [interrupted_at(0, 0, "http: 503")]}, infra=1)
    decision = on_attempt(g, 0, INTERRUPTED)
    assert decision.move == "dead_letter" and decision.budget == "infra"
    [dead] = decision.events
    assert isinstance(dead, GroupDeadLettered) and [a.rollout_id for a in dead.attempts] == ["g_g0"]
    # At level turn a prompt group's budget is its rounds' (attempt indexes): spent, the round gives up.
    pg = at_level(group("prompt_group", {0: [held(0)], 1: [interrupted_at(1, 0)]}, max_tries=1), "turn")
    assert on_attempt(pg, 1, INTERRUPTED).move == "give_up"


def test_a_stranded_attempt_is_never_replaced() -> None:
    g = group("sibling", {0: [attempt(0, 0, "failed", "receipt: garbage")]})
    assert on_attempt(g, 0, AttemptOutcome("stranded", "garbage")).move == "dead_letter"
    pg = group("prompt_group", {0: [attempt(0, 0, "failed")], 1: [held(1)]})
    assert on_attempt(pg, 0, AttemptOutcome("stranded", "garbage")).move == "give_up"
    assert on_round(pg, {0: AttemptOutcome("stranded", "garbage"), 1: FINISHED}).move == "dead_letter"


def test_a_finished_attempt_waits_for_its_round() -> None:
    g = group("prompt_group", {0: [held(0)], 1: [attempt(1, 0, "dispatched")]})
    assert on_attempt(g, 0, FINISHED).move == "wait"


# --- a round given up ----------------------------------------------------------------------------


def test_a_round_given_up_is_rerun_whole_and_its_offered_boundaries_resumed_at_level_turn() -> None:
    g = at_level(group("prompt_group", {0: [held(0)], 1: [interrupted_at(1, 0, "env: bad")]}), "turn")
    decision = on_round(g, {0: FINISHED, 1: recorded_outcome(g.siblings[1].attempts[0]) or INTERRUPTED})
    abandoned, *replacements = decision.events
    assert decision.move == "abandon" and isinstance(abandoned, GroupAbandoned)
    assert [(a.rollout_id, a.attempt_index) for a in abandoned.attempts] == [("g_g0", 0), ("g_g1", 0)]
    assert all(isinstance(r, ReplacementMinted) for r in replacements)
    assert [r.continues for r in replacements] == [None, offer(1, 0)]  # type: ignore[attr-defined]
    assert decision.settle == ((0, "dispatch"), (1, "dispatch"))


def test_a_round_whose_every_attempt_finished_is_sealed_by_its_last_hold() -> None:
    g = group("prompt_group", {0: [held(0)], 1: [held(1)]})
    assert on_round(g, {0: FINISHED, 1: FINISHED}).move == "wait"


# --- a driver taking the group (submit, recovery) -----------------------------------------------------


def test_at_level_turn_a_round_sends_what_never_left_instead_of_rerunning() -> None:
    siblings = {0: [held(0)], 1: [attempt(1, 0, "dispatched")], 2: [attempt(2, 0, "minted")]}
    turn = at_level(group("prompt_group", siblings), "turn")
    decision = round_next(turn)
    assert decision.move == "settle" and not decision.interrupted
    assert decision.settle == ((1, "retire_or_adopt"), (2, "dispatch"))
    below = group("prompt_group", siblings)
    assert round_next(below).move == "give_up" and round_next(below).interrupted


def test_at_level_turn_recovery_replaces_an_interrupted_sibling_alone() -> None:
    """A trainer restart left one sibling retired (its replacement not yet minted) beside held ones."""
    g = at_level(group("prompt_group", {0: [held(0)], 1: [interrupted_at(1, 0)], 2: [held(2)]}), "turn")
    decision = round_next(g)
    assert decision.move == "resume" and [type(e) for e in decision.events] == [ReplacementMinted]
    assert round_next(group("prompt_group", {0: [held(0)], 1: [interrupted_at(1, 0)]})).move == "give_up"


def test_a_sibling_whose_end_is_recorded_takes_its_move() -> None:
    g = group("sibling", {0: [interrupted_at(0, 0)], 1: [attempt(1, 0, "dispatched")]})
    assert sibling_next(g, 0).move == "replace"
    assert sibling_next(g, 1).settle == ((1, "retire_or_adopt"),)
    g.siblings[1].status = "sealed"
    assert sibling_next(g, 1).move == "done"


def test_an_ended_attempt_s_unrecorded_retire_is_appended_first() -> None:
    [retired] = retire_events(
        "g_g0", 0, AttemptOutcome("retired", "x", "cancelled", continuation=offer(0, 0))
    )
    assert retired.continuation == offer(0, 0)  # type: ignore[attr-defined]
    assert retire_events("g_g0", 0, AttemptOutcome("retired", "x", "cancelled", recorded=True)) == []
    assert retire_events("g_g0", 0, NEVER_SENT) == []  # never sent: nothing to record of it


# --- keeping a result ------------------------------------------------------------------------------


def test_a_debt_is_recorded_as_each_sibling_arrives_and_the_seal_when_complete() -> None:
    rollout0, receipt0 = receipts(0)
    pg = group("prompt_group", {0: [attempt(0, 0, "dispatched")], 1: [attempt(1, 0, "dispatched")]})
    first = kept(pg, "a", rollout0, receipt0)
    assert [type(e) for e in first] == [SiblingHeld, AckOwed]
    pg.siblings[1].attempts[0] = held(1)
    pg.siblings[1].status = "held"
    last = kept(pg, "a", rollout0, receipt0)
    assert [type(e) for e in last] == [SiblingHeld, AckOwed, SiblingSealed, SiblingSealed, GroupSealed]
    sib = group("sibling", {0: [attempt(0, 0, "dispatched")], 1: [attempt(1, 0, "dispatched")]})
    assert [type(e) for e in kept(sib, "a", rollout0, receipt0)] == [SiblingSealed, AckOwed]
    sib.status = "dead_lettered"
    assert [type(e) for e in kept(sib, "a", rollout0, receipt0)] == [AckOwed]  # never left unowed


def test_the_docs_draw_the_table() -> None:
    text = DOC.read_text()
    assert with_generated(text) == text, "run `python -m trainer.diagrams --write`"
