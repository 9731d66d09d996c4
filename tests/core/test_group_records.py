"""What the group's decisions record and whose budget they read (trainer.core.group, trainer.core.budget):
the fields of each event a move appends, a closed group left alone by every input, each mode's own
budget, and the catalogue's `pg_debt_at_group_seal` being the bug it names.  Written for the mutants
mutation testing found alive (docs/testing.md, Mutation score of the pure core), without a server."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from eventstore.events import (
    AckOwed,
    AttemptRetired,
    ContinuationDeclined,
    ContinuationResumed,
    GroupAbandoned,
    GroupDeadLettered,
    GroupSealed,
    ReplacementMinted,
    SiblingHeld,
    SiblingSealed,
)
from projections.ledger import AttemptState, GroupState
from protocol import mutants
from protocol.digests import sha256_digest
from protocol.wire import AttemptWork, ResumeReport
from tests.core.test_group_core import attempt, group
from tests.core.test_group_moves import FINISHED, INTERRUPTED, at_level, held, interrupted_at, offer, receipts
from trainer.core.budget import (
    dead_letter_reason,
    exhausted_budget,
    failure_budget,
    round_exhausted,
    sibling_exhausted,
    spent,
)
from trainer.core.group import (
    AttemptOutcome,
    Decision,
    kept,
    on_attempt,
    on_round,
    recorded_outcome,
    retire_events,
    round_next,
    sibling_next,
)

# --- what the log already holds of an attempt --------------------------------------------------------


def test_the_outcome_the_log_holds_of_each_settled_attempt() -> None:
    """A held or sealed attempt finished; one whose receipt is in but not kept is owed (its group's own
    failure); one retired or discarded is a retire already recorded, with the boundary it offered."""
    for status in ("held", "sealed"):
        assert recorded_outcome(attempt(0, 0, status)) == FINISHED
    owed = attempt(0, 0, "failed")
    owed.receipt = receipts(0)[1]
    known = recorded_outcome(owed)
    assert known is not None and known.kind == "owed" and known.reason
    g = group("sibling", {0: [owed]})
    assert on_attempt(g, 0, known).move == "replace"  # a data failure: replaced, the debt kept
    for retire_outcome in ("cancelled", "tombstoned", "done"):
        retired = interrupted_at(0, 0)
        retired.retire_outcome = retire_outcome
        known = recorded_outcome(retired)
        assert known is not None and (known.kind, known.retire_outcome) == ("retired", retire_outcome)
        assert known.recorded and known.continuation == offer(0, 0) and known.reason
        assert retire_events("g_g0", 0, known) == []  # recorded once, never appended again
    for status in ("retired", "discarded"):
        thrown = attempt(0, 0, status)  # type: ignore[arg-type]
        thrown.offered = offer(0, 0)
        known = recorded_outcome(thrown)
        assert known is not None and (known.kind, known.reason, known.recorded) == ("retired", status, True)
        assert known.continuation == offer(0, 0)
    for running in ("minted", "dispatched", "failed", "replied"):
        assert recorded_outcome(attempt(0, 0, running)) is None


def test_an_unrecorded_retire_records_who_answered_it_why_and_what_it_resumed() -> None:
    """The `AttemptRetired` the driver appends carries everything the outcome knows: the agent process
    that answered (the evidence the debt and retire rules read), the checkpoint that retired it, the
    work thrown away; a resume the attempt was asked for is recorded before it."""
    resumed = ResumeReport(
        continuation=sha256_digest(b"c"), outcome="resumed", turn=2, source_attempt=0, lineage="g_g0-l"
    )
    outcome = AttemptOutcome(
        "retired",
        "retired while running",
        "tombstoned",
        execution_generation=3,
        execution_incarnation="7" * 32,
        cause="checkpoint",
        checkpoint_id="ck-1",
        work=AttemptWork(model_s=1.5, generated_tokens=40),
        continuation=offer(0, 1),
        resume=resumed,
    )
    first, retired = retire_events("g_g0", 1, outcome)
    assert isinstance(first, ContinuationResumed)
    assert (first.rollout_id, first.attempt_index, first.resume) == ("g_g0", 1, resumed)
    assert isinstance(retired, AttemptRetired)
    assert (retired.rollout_id, retired.attempt_index, retired.outcome) == ("g_g0", 1, "tombstoned")
    assert (retired.execution_generation, retired.execution_incarnation) == (3, "7" * 32)
    assert (retired.cause, retired.checkpoint_id) == ("checkpoint", "ck-1")
    assert retired.work == outcome.work and retired.continuation == offer(0, 1)
    declined = ResumeReport(
        continuation=sha256_digest(b"c"), outcome="declined", reason="unknown_continuation"
    )
    [first, _] = retire_events("g_g0", 1, AttemptOutcome("retired", "x", "cancelled", resume=declined))
    assert isinstance(first, ContinuationDeclined) and first.resume == declined


# --- a closed group ------------------------------------------------------------------------------------


@pytest.mark.parametrize("status", ["sealed", "dead_lettered"])
def test_a_group_no_longer_open_is_done_for_every_input(status: str) -> None:
    """A sealed or dead-lettered group is never replaced, rerun or settled again, whatever arrives late."""
    for mode in ("sibling", "prompt_group"):
        g = group(mode, {0: [interrupted_at(0, 0)], 1: [attempt(1, 0, "dispatched")]})
        g.status = status  # type: ignore[assignment]
        decisions = [
            on_attempt(g, 0, INTERRUPTED),
            on_round(g, {0: INTERRUPTED, 1: INTERRUPTED}),
            sibling_next(g, 1),
            round_next(g),
        ]
        assert all(d.done and d.events == () and d.settle == () for d in decisions)


# --- whose budget ------------------------------------------------------------------------------------


def test_in_sibling_mode_each_sibling_spends_its_own_budget() -> None:
    """Sibling 1 spent its infra budget; sibling 0, one failure in, is still replaced."""
    g = group(
        "sibling",
        {
            0: [interrupted_at(0, 0, "http: 503")],
            1: [interrupted_at(1, 0, "http: 503"), interrupted_at(1, 1, "http: 503")],
        },
        infra=2,
    )
    assert on_attempt(g, 0, INTERRUPTED).move == "replace"
    decision = on_attempt(g, 1, INTERRUPTED)
    assert decision.move == "dead_letter" and decision.budget == "infra"


def test_a_prompt_group_spends_its_rounds_budget_whichever_sibling_failed() -> None:
    """At level turn a sibling replaced alone still spends the group's rounds: sibling 0 failed once,
    but rounds 0 and 1 both failed (sibling 1's), so the infra budget is spent and the round gives up."""
    g = at_level(
        group(
            "prompt_group",
            {
                0: [interrupted_at(0, 0, "http: 503")],
                1: [interrupted_at(1, 0, "http: 503"), interrupted_at(1, 1, "http: 503")],
            },
            infra=2,
        ),
        "turn",
    )
    outcome = AttemptOutcome("retired", "lost", "cancelled", recorded=True)
    decision = on_attempt(g, 0, outcome)
    assert (decision.move, decision.budget, decision.reason) == ("give_up", "infra", "lost")


def test_every_settled_failure_counts_once_against_its_budget() -> None:
    """A failed, retired or discarded attempt spends one unit of its budget; a running one spends none."""
    g = group("sibling", {0: [attempt(0, 0, "retired")]})
    for status in ("retired", "discarded", "failed"):
        counts = spent(g, [attempt(0, 0, status, "env: x")])
        assert counts == {"infra": 0, "data": 1, "tries": 1}
    assert spent(g, [attempt(0, 0, "dispatched"), attempt(0, 1, "held")]) == {
        "infra": 0,
        "data": 0,
        "tries": 2,
    }
    # One data failure under max_data_failures=2 leaves room; so does one infra failure beside it.
    roomy = group("sibling", {0: [attempt(0, 0, "discarded", "verify: x")]}, data=2)
    assert sibling_exhausted(roomy, roomy.siblings[0]) is None
    mixed = [attempt(0, 0, "failed", "http: 503"), attempt(0, 1, "discarded", "env: y")]
    assert exhausted_budget(group("sibling", {0: mixed}, infra=2, data=2), mixed) is None


def test_a_masked_reply_spends_the_budget_its_failure_kind_names() -> None:
    """The Gym's `failure_kind` decides: an infrastructure kind spends the infra budget."""
    masked = attempt(0, 0, "discarded", mask=True)
    masked.failure_kind = "agent_timeout"
    assert failure_budget(masked) == "infra"
    masked.failure_kind = "verifier_error"
    assert failure_budget(masked) == "data"


def test_a_failure_is_classed_by_the_word_before_its_first_colon() -> None:
    """A failure's detail may hold colons of its own ("env: tool: crashed" is an environment failure)."""
    assert failure_budget(attempt(0, 0, "retired", "env: tool: crashed")) == "data"
    assert failure_budget(attempt(0, 0, "retired", "http: 503: env: text")) == "infra"


def test_a_round_stands_for_its_first_failed_attempt() -> None:
    """A round whose sibling 0 is held and sibling 1 ended failed, retired or discarded counts sibling
    1's failure; a round lost to a checkpoint counts nothing, whatever else failed in it."""
    for status in ("retired", "discarded", "failed"):
        g = group("prompt_group", {0: [held(0)], 1: [attempt(1, 0, status, "env: x")]}, data=1)
        assert round_exhausted(g) == "data"
    lost = attempt(1, 0, "retired", "http: 503")
    lost.retire_cause = "checkpoint"
    g = group("prompt_group", {0: [attempt(0, 0, "discarded", "http: 503")], 1: [lost]}, infra=1, max_tries=1)
    assert round_exhausted(g) is None


# --- what a move appends --------------------------------------------------------------------------------


def test_a_replacement_records_why_and_resumes_the_boundary_offered_with_the_retire() -> None:
    """At level turn the replacement resumes the continuation the retire offered (the outcome's, or
    else the one the log recorded of the attempt); its reason is the outcome's, or its kind."""
    g = at_level(group("prompt_group", {0: [held(0)], 1: [attempt(1, 0, "retired")]}), "turn")
    outcome = AttemptOutcome("retired", "agent restarted", "cancelled", continuation=offer(1, 0))
    decision = on_attempt(g, 1, outcome)
    [replacement] = decision.events
    assert isinstance(replacement, ReplacementMinted)
    assert decision.move == "resume" and replacement.continues == offer(1, 0)
    assert replacement.reason == "agent restarted" and decision.reason == "agent restarted"
    [bare] = on_attempt(g, 1, AttemptOutcome("retired", "", "cancelled")).events
    assert isinstance(bare, ReplacementMinted) and bare.reason == "retired" and bare.continues is None
    g.siblings[1].attempts[0].offered = offer(1, 0, turn=1)
    [recorded] = on_attempt(g, 1, AttemptOutcome("retired", "x", "cancelled")).events
    assert isinstance(recorded, ReplacementMinted) and recorded.continues == offer(1, 0, turn=1)
    # The offer arriving with the retire is newer than the one recorded before it.
    [newer] = on_attempt(g, 1, outcome).events
    assert isinstance(newer, ReplacementMinted) and newer.continues == offer(1, 0)


def test_a_round_rerun_at_level_turn_resumes_what_each_retire_offered() -> None:
    g = at_level(group("prompt_group", {0: [held(0)], 1: [attempt(1, 0, "retired", "env: bad")]}), "turn")
    outcome = AttemptOutcome("retired", "env: bad", "cancelled", continuation=offer(1, 0))
    decision = on_round(g, {0: FINISHED, 1: outcome})
    abandoned, *replacements = decision.events
    assert isinstance(abandoned, GroupAbandoned) and "g1: env: bad" in abandoned.reason
    assert decision.reason == abandoned.reason
    assert [r.continues for r in replacements] == [None, offer(1, 0)]  # type: ignore[attr-defined]


def test_a_dead_letter_records_the_budget_spent_and_every_attempt() -> None:
    g = group(
        "sibling",
        {
            1: [attempt(1, 0, "retired", "env: a")],
            0: [attempt(0, 0, "sealed"), attempt(0, 1, "retired", "env: b")],
        },
        data=1,
    )
    decision = on_attempt(g, 1, INTERRUPTED)
    [dead] = decision.events
    assert isinstance(dead, GroupDeadLettered) and dead.budget == decision.budget == "data"
    assert [(a.rollout_id, a.attempt_index) for a in dead.attempts] == [("g_g0", 0), ("g_g0", 1), ("g_g1", 0)]
    assert dead.reasons[0] == decision.reason and set(dead.reasons[1:]) == {
        "g_g1#0: env: a",
        "g_g0#1: env: b",
    }
    pg = group("prompt_group", {0: [held(0)], 1: [attempt(1, 0, "retired", "env: bad")]}, data=1)
    spent_round = on_round(pg, {0: FINISHED, 1: AttemptOutcome("retired", "env: bad", recorded=True)})
    [dead] = spent_round.events
    assert isinstance(dead, GroupDeadLettered) and dead.budget == spent_round.budget == "data"


def test_a_dead_letter_records_at_most_a_hundred_reasons() -> None:
    """A group with many failed attempts: the event stays bounded, the budget spent first."""
    tries = [attempt(0, n, "retired", *(f"http: 50{i}" for i in range(4))) for n in range(40)]
    g = group("sibling", {0: tries}, infra=40, max_tries=99)
    [dead] = on_attempt(g, 0, INTERRUPTED).events
    assert isinstance(dead, GroupDeadLettered) and len(dead.reasons) == 100
    assert dead.reasons[0].startswith("infra budget spent")


# --- a driver taking a prompt group --------------------------------------------------------------------


def test_a_round_whose_every_sibling_is_held_is_sealed_with_every_receipt() -> None:
    g = group("prompt_group", {1: [held(1)], 0: [held(0)]})
    decision = round_next(g)
    assert decision.move == "seal"
    assert [type(e) for e in decision.events] == [SiblingSealed, SiblingSealed, GroupSealed]
    assert [e.rollout_id for e in decision.events[:2]] == ["g_g0", "g_g1"]  # type: ignore[attr-defined]


def test_recovery_gives_a_round_up_when_a_sibling_s_end_is_recorded_below_level_turn() -> None:
    """The retired sibling's end is in the log: the round is given up, the running sibling settled
    first, with the reason and budget the end's move gave."""
    g = group("prompt_group", {0: [attempt(0, 0, "dispatched")], 1: [interrupted_at(1, 0, "http: 503")]})
    decision = round_next(g)
    assert (decision.move, decision.settle, decision.reason) == (
        "give_up",
        ((0, "retire_or_adopt"),),
        "retired",
    )
    assert decision.budget is None
    spent_g = group(
        "prompt_group", {0: [attempt(0, 0, "dispatched")], 1: [interrupted_at(1, 0, "http: 503")]}, infra=1
    )
    at_turn = at_level(spent_g, "turn")
    assert round_next(at_turn).budget == "infra"


def test_recovery_replaces_a_recorded_interruption_alone_at_level_turn_without_an_offer() -> None:
    lost = interrupted_at(1, 0)
    lost.offered = None
    g = at_level(group("prompt_group", {0: [held(0)], 1: [lost]}), "turn")
    decision = round_next(g)
    assert decision.move == "replace" and [type(e) for e in decision.events] == [ReplacementMinted]


def test_a_round_with_one_sibling_held_and_one_never_sent_is_rerun_below_level_turn() -> None:
    """Sending the unsent one now would start it under a later policy than its held sibling's."""
    g = group("prompt_group", {0: [held(0)], 1: [attempt(1, 0, "minted")]})
    decision = round_next(g)
    assert decision.move == "give_up" and decision.interrupted and decision.settle == () and decision.reason
    assert round_next(at_level(g, "turn")).settle == ((1, "dispatch"),)


def test_a_sibling_not_yet_minted_is_skipped_when_a_round_is_taken() -> None:
    """A sibling whose current attempt is not in the log (a group submitted in pieces) neither settles
    nor ends the round."""
    g = group("prompt_group", {0: [attempt(0, 0, "minted")], 1: [attempt(1, 0, "minted")]})
    g.siblings[1].current_attempt = 5
    assert round_next(g).settle == ((0, "dispatch"),)


# --- keeping a result ----------------------------------------------------------------------------------


def test_the_last_sibling_sealed_seals_its_group_with_each_sibling_s_sealed_attempt() -> None:
    """Sibling mode: the seal of the last open sibling also seals the group, naming the attempt each
    sibling sealed (its own, arriving now, and the others' as the log holds them), by generation."""
    one = attempt(1, 2, "sealed")
    g = group("sibling", {0: [attempt(0, 0, "retired"), attempt(0, 1, "dispatched")], 1: [one]})
    g.siblings[1].status = "sealed"
    g.siblings[1].sealed_attempt = 2
    rollout, receipt = receipts(0, 1)
    events = kept(g, "a", rollout, receipt)
    assert [type(e) for e in events] == [SiblingSealed, AckOwed, GroupSealed]
    sealed = events[2]
    assert isinstance(sealed, GroupSealed) and sealed.group_id == "g"
    assert [(a.rollout_id, a.attempt_index) for a in sealed.attempts] == [("g_g0", 1), ("g_g1", 2)]
    g.siblings[1].status = "pending"
    assert [type(e) for e in kept(g, "a", rollout, receipt)] == [SiblingSealed, AckOwed]


def test_a_prompt_group_is_not_sealed_while_a_sibling_is_not_held() -> None:
    g = group("prompt_group", {0: [attempt(0, 0, "dispatched")], 1: [held(1)]})
    g.siblings[1].status = "pending"  # its hold not folded yet
    rollout, receipt = receipts(0)
    assert [type(e) for e in kept(g, "a", rollout, receipt)] == [SiblingHeld, AckOwed]


def _held_with_receipt(gi: int) -> AttemptState:
    a = held(gi)
    a.receipt = receipts(gi)[1]
    return a


def _debts(events: Sequence[object]) -> list[str]:
    return [e.receipt.rollout_id for e in events if isinstance(e, AckOwed)]


def test_the_catalogue_mutant_records_a_prompt_group_s_debts_only_at_its_seal() -> None:
    """`pg_debt_at_group_seal` is the bug the catalogue says: a hold carries no debt until the group
    seals, then the seal carries every sibling's (so a group that fails part-way strands them)."""
    g: GroupState = group(
        "prompt_group", {0: [attempt(0, 0, "dispatched")], 1: [attempt(1, 0, "dispatched")]}
    )
    rollout0, receipt0 = receipts(0)
    with mutants.enabled("pg_debt_at_group_seal"):
        first = kept(g, "a", rollout0, receipt0)
        assert [type(e) for e in first] == [SiblingHeld] and first[0].receipt == rollout0  # type: ignore[attr-defined]
        g.siblings[1].attempts[0] = _held_with_receipt(1)
        g.siblings[1].status = "held"
        last = kept(g, "a", rollout0, receipt0)
    assert [type(e) for e in last[:4]] == [SiblingHeld, SiblingSealed, SiblingSealed, GroupSealed]
    assert sorted(_debts(last)) == ["g_g0", "g_g1"]
    assert all(e.agent_name == "a" for e in last if isinstance(e, AckOwed))
    assert (last[0].rollout_id, last[0].attempt_index) == ("g_g0", 0)  # type: ignore[attr-defined]
    # Without the mutant each hold carries its own debt at once.
    assert _debts(kept(g, "a", rollout0, receipt0)) == ["g_g0"]


# --- the reasons the moves record, and their caps -------------------------------------------------------


def test_an_owed_result_and_an_interrupted_round_say_why() -> None:
    owed = attempt(0, 0, "failed")
    owed.receipt = receipts(0)[1]
    assert recorded_outcome(owed) == AttemptOutcome("owed", "finished at the agent; result not kept")
    g = group("prompt_group", {0: [attempt(0, 0, "dispatched")], 1: [attempt(1, 0, "minted")]})
    assert round_next(g) == Decision(
        "give_up",
        settle=((0, "retire_or_adopt"),),
        reason="round interrupted between its dispatches",
        interrupted=True,
    )


def test_a_sibling_whose_attempt_finished_needs_nothing_more() -> None:
    g = group("sibling", {0: [attempt(0, 0, "sealed")]})
    assert sibling_next(g, 0) == Decision("done")


def test_a_prompt_group_gives_up_a_round_with_the_attempts_own_reason() -> None:
    stranded = AttemptOutcome("stranded", "the agent holds a result it does not describe")
    g = group("prompt_group", {0: [attempt(0, 0, "dispatched")], 1: [attempt(1, 0, "dispatched")]})
    assert on_attempt(g, 0, stranded) == Decision("give_up", reason=stranded.reason)


def test_reasons_are_capped_where_the_events_keep_them() -> None:
    """A replacement keeps 300 characters of its reason, a dead letter 300 of each (100 at most), a round's
    abandon 500 of its siblings' reasons joined."""
    long = AttemptOutcome("retired", "r" * 400, "cancelled")
    g = group("sibling", {0: [interrupted_at(0, 0)]})
    (minted,) = on_attempt(g, 0, long).events
    assert isinstance(minted, ReplacementMinted) and minted.reason == "r" * 300
    spent_group = group(
        "sibling", {0: [interrupted_at(0, 0, "AgentServerError: " + "x" * 400)]}, max_tries=1, infra=1
    )
    dead = on_attempt(spent_group, 0, AttemptOutcome("retired", "y" * 400, "cancelled"))
    (letter,) = dead.events
    assert isinstance(letter, GroupDeadLettered)
    assert len(letter.reasons) == 2 and len(letter.reasons[1]) == 300
    pg = group("prompt_group", {0: [attempt(0, 0, "failed")], 1: [attempt(1, 0, "failed")]})
    failed = {0: AttemptOutcome("retired", "a" * 10), 1: AttemptOutcome("retired", "b" * 10)}
    assert on_round(pg, failed).reason == f"g0: {'a' * 10}; g1: {'b' * 10}"
    failed = {0: AttemptOutcome("retired", "a" * 300), 1: AttemptOutcome("retired", "b" * 300)}
    assert len(on_round(pg, failed).reason) == 500
    spent_pg = group(
        "prompt_group", {0: [attempt(0, 0, "failed")], 1: [attempt(1, 0, "failed")]}, max_tries=1
    )
    dead_round = on_round(spent_pg, failed)
    assert dead_round.move == "dead_letter" and len(dead_round.reason) == 500


def test_a_refused_request_dead_letters_naming_the_refusal() -> None:
    refused_try = attempt(0, 0, "failed", "refused: the prompt is too long")
    g = group("sibling", {0: [refused_try]})
    assert dead_letter_reason("data", g) == (
        "data budget spent: the agent refused g_g0#0's request itself, and a retry sends the same request "
        "(refused: the prompt is too long)"
    )
    refused_try.failures = ["refused: " + "x" * 600]
    assert len(dead_letter_reason("data", g)) == 500
