"""The continuation rules of the auditor (projections/turn_audit.py): a clean resume reports nothing;
each broken history is reported under its rule, and only there."""

from __future__ import annotations

from eventstore import EventStore
from eventstore.events import (
    AttemptRetired,
    ContinuationResumed,
    ReplacementMinted,
    RunDispatched,
)
from participant.continuations import resumed_report
from projections.audit import AuditReport
from projections.turn_audit import CONTINUATION_AS_COMMITTED, RESUMED_PROMPT, TURN_EXECUTED_TWICE, TurnFacts
from protocol.digests import sha256_digest
from protocol.ids import capture_key
from protocol.wire import ContinuationRef, ResourceClass, ResourceRevision, ResumeReport
from tests.projections.audit_fold import audit_both_ways
from tests.projections.builder import LogBuilder

RID = "t1_g0"
LINEAGE = capture_key(RID, 0)
PROMPT = sha256_digest(b"the row of t1_g0")


def offer(
    source: int, turn: int, cls: ResourceClass = "export_restore", prompt: str = PROMPT
) -> ContinuationRef:
    return ContinuationRef(
        rollout_id=RID,
        source_attempt=source,
        lineage=LINEAGE,
        turn=turn,
        digest=sha256_digest(f"continuation {source}/{turn}".encode()),
        prompt_digest=prompt,
        model_call_ids=[f"{LINEAGE}-call-{i}" for i in range(1, turn + 1)],
        generated_tokens=40 * turn,
        resources=[ResourceRevision(name="tool", resource_class=cls, session=LINEAGE, revision=turn)],
    )


def report(ref: ContinuationRef) -> ResumeReport:
    """The agent's report of resuming `ref` (the participant's own construction), its restorable
    resources restored."""
    return resumed_report(ref, [r for r in ref.resources if r.resource_class == "export_restore"])


def dispatch(log: LogBuilder, n: int, continue_from: str | None, prompt: str = PROMPT) -> None:
    log.group(
        "t1",
        [
            RunDispatched(
                rollout_id=RID,
                attempt_index=n,
                capture_key=capture_key(RID, n),
                agent_name=log.agent,
                prompt_digest=prompt,
                continue_from=continue_from,
            )
        ],
    )


def retire_and_replace(
    log: LogBuilder, n: int, offered: ContinuationRef | None, told: ContinuationRef | None
) -> None:
    log.group(
        "t1",
        [
            AttemptRetired(
                rollout_id=RID, attempt_index=n, outcome="cancelled", cause="checkpoint", continuation=offered
            ),
            ReplacementMinted(
                rollout_id=RID,
                generation_index=0,
                attempt_index=n + 1,
                replaces=n,
                reason="retired",
                continues=told,
            ),
        ],
    )


def finish(log: LogBuilder, n: int, resumed: ResumeReport) -> None:
    log.group("t1", [ContinuationResumed(rollout_id=RID, attempt_index=n, resume=resumed)])
    log.reply(RID, n)
    log.seal(RID, n)
    log.ack(RID, n)
    log.seal_group("t1", {0: n})


def rules(store: EventStore) -> set[str]:
    found: AuditReport = audit_both_ways(store)
    return {v.rule for v in found.violations}


def history(log: LogBuilder, *, told: int = 2, resumed_turn: int | None = None, prompt: str = PROMPT) -> None:
    """Try 0 commits turn 2 and is retired; try 1 resumes there, commits turn 4 and is retired; try 2
    is told to resume turn `told` (the offered one: 4) and resumes turn `resumed_turn`."""
    log.reserve("t1", 1)
    log.mint("t1", 1)
    dispatch(log, 0, None)
    first = offer(0, 2)
    retire_and_replace(log, 0, first, first)
    dispatch(log, 1, first.digest)
    second = offer(1, 4)
    log.group("t1", [ContinuationResumed(rollout_id=RID, attempt_index=1, resume=report(first))])
    told_ref = second if told == 4 else first
    retire_and_replace(log, 1, second, told_ref)
    dispatch(log, 2, told_ref.digest, prompt)
    by_turn = {2: first, 4: second}
    finish(log, 2, report(by_turn[resumed_turn if resumed_turn is not None else told]))


def test_a_resume_of_each_offered_boundary_is_clean(store: EventStore, log: LogBuilder) -> None:
    history(log, told=4)
    assert audit_both_ways(store).ok, audit_both_ways(store).as_json()


def test_a_replacement_told_to_resume_what_was_not_offered(store: EventStore, log: LogBuilder) -> None:
    history(log, told=2)  # try 1 offered turn 4; try 2 is told the older boundary of try 0
    assert rules(store) == {CONTINUATION_AS_COMMITTED}


def test_a_resume_of_another_continuation_than_the_one_told(store: EventStore, log: LogBuilder) -> None:
    history(log, told=4, resumed_turn=2)
    assert rules(store) == {CONTINUATION_AS_COMMITTED}


def test_a_resume_nothing_told_of(store: EventStore, log: LogBuilder) -> None:
    log.reserve("t1", 1)
    log.mint("t1", 1)
    dispatch(log, 0, None)
    retire_and_replace(log, 0, offer(0, 2), None)  # the replacement plays from its prompt ...
    dispatch(log, 1, None)
    finish(log, 1, report(offer(0, 2)))  # ... yet its agent reports a resume
    assert rules(store) == {CONTINUATION_AS_COMMITTED}


def test_a_resumed_lineage_that_began_from_another_prompt(store: EventStore, log: LogBuilder) -> None:
    history(log, told=4, prompt=sha256_digest(b"another row"))
    assert rules(store) == {RESUMED_PROMPT}


def test_completed_turns_run_twice_on_a_restart_only_resource(store: EventStore, log: LogBuilder) -> None:
    """Try 2 resumes turn 2 of a lineage try 1 had carried to turn 4: turns 3-4 ran twice.  On a
    restart_only resource that is a side effect twice; on an export_restore one the restore undid it
    (only the continuation rule is broken there)."""
    log.reserve("t1", 1)
    log.mint("t1", 1)
    dispatch(log, 0, None)
    first = offer(0, 2, "restart_only")
    retire_and_replace(log, 0, first, first)
    dispatch(log, 1, first.digest)
    log.group("t1", [ContinuationResumed(rollout_id=RID, attempt_index=1, resume=report(first))])
    retire_and_replace(log, 1, offer(1, 4, "restart_only"), first)
    dispatch(log, 2, first.digest)
    finish(log, 2, report(first))
    found = audit_both_ways(store)
    assert {v.rule for v in found.violations} == {CONTINUATION_AS_COMMITTED, TURN_EXECUTED_TWICE}
    twice = next(v for v in found.violations if v.rule == TURN_EXECUTED_TWICE)
    assert "turns 3..4" in twice.message and "tool" in twice.message


def test_the_same_history_on_an_export_restore_resource_runs_nothing_twice(
    store: EventStore, log: LogBuilder
) -> None:
    log.reserve("t1", 1)
    log.mint("t1", 1)
    dispatch(log, 0, None)
    first = offer(0, 2)
    retire_and_replace(log, 0, first, first)
    dispatch(log, 1, first.digest)
    log.group("t1", [ContinuationResumed(rollout_id=RID, attempt_index=1, resume=report(first))])
    retire_and_replace(log, 1, offer(1, 4), first)
    dispatch(log, 2, first.digest)
    finish(log, 2, report(first))
    assert rules(store) == {CONTINUATION_AS_COMMITTED}


def test_the_turn_facts_name_the_positions_and_tries_of_each_violation() -> None:
    """The folded facts alone (no store): which boundary each try reached first, and what each violation
    names (the positions that prove it, the try that had gone further, the offer that was not told)."""
    facts = TurnFacts()
    facts.retired(10, RID, 0, offer(0, 3, "restart_only"))
    facts.retired(12, RID, 0, offer(0, 3, "restart_only"))  # the same boundary again: the first stands
    facts.retired(15, RID, 2, offer(2, 2, "restart_only"))
    facts.retired(16, RID, 3, offer(3, 1))
    facts.retired(17, RID, 6, None)  # nothing offered: nothing known
    assert facts.lineages[LINEAGE].reached == {0: (3, 10), 2: (2, 15), 3: (1, 16)}
    assert facts.lineages[LINEAGE].not_restorable == {"tool": 10}
    facts.resumed(20, RID, 1, report(offer(0, 1, "restart_only")))
    facts.replaced(30, RID, 4, 3, offer(2, 2))
    facts.replaced(31, RID, 5, 9, offer(0, 3))
    told = offer(2, 2).digest
    assert facts.found == [
        (
            CONTINUATION_AS_COMMITTED,
            [20],
            f"{RID}#1 resumed {offer(0, 1).digest}, but the log told it to resume no continuation",
        ),
        (
            TURN_EXECUTED_TWICE,
            [10, 10, 20],
            f"{RID}#1 resumed lineage {LINEAGE} at turn 1, but try #0 had committed turn 3 on it: turns 2..3 ran "
            "twice on tool (restart_only: no restore undoes them)",
        ),
        (
            CONTINUATION_AS_COMMITTED,
            [16, 30],
            f"{RID}#4 is told to resume {told}, which is not what #3's agent offered when it was retired "
            f"({offer(3, 1).digest})",
        ),
        (
            CONTINUATION_AS_COMMITTED,
            [None, 31],
            f"{RID}#5 is told to resume {offer(0, 3).digest}, which is not what #9's agent offered when it was "
            "retired (nothing)",
        ),
    ]


def test_a_restart_only_resource_restored_by_a_resume_counts_though_no_offer_named_it() -> None:
    facts = TurnFacts()
    facts.retired(10, RID, 0, offer(0, 3))
    export = offer(0, 1)
    touched = export.model_copy(
        update={
            "resources": [
                ResourceRevision(name="mail", resource_class="restart_only", session=LINEAGE),
                ResourceRevision(name="pager", resource_class="restart_only", session=LINEAGE),
            ]
        }
    )
    resumed = resumed_report(touched, list(touched.resources))
    facts.told[(RID, 1)] = (11, touched)
    facts.resumed(20, RID, 1, resumed)
    assert facts.found == [
        (
            TURN_EXECUTED_TWICE,
            [10, 20, 20, 20],
            f"{RID}#1 resumed lineage {LINEAGE} at turn 1, but try #0 had committed turn 3 on it: turns 2..3 ran "
            "twice on mail, pager (restart_only: no restore undoes them)",
        )
    ]


def test_a_resume_of_a_lineage_no_try_committed_on_runs_nothing_twice() -> None:
    """Restoring a restart_only resource on a lineage the log holds no boundary of: nothing ran before it."""
    facts = TurnFacts()
    ref = offer(0, 2, "restart_only")
    facts.told[(RID, 1)] = (11, ref)
    facts.resumed(20, RID, 1, resumed_report(ref, list(ref.resources)))
    assert facts.found == []
