"""The edges of a restore and of the rows beside it, each with what the audit reports in full: a claim
exactly at its trainer's own cut, at the plan's `as_of_position` or at the restore's cut; two claims
of one group rolled back; another trainer's claim kept across two restores; a plan losing six groups;
a restore that kept its claims between two checkpoints; a sibling first minted by a replacement under an id of its own; a
replacement told to resume a continuation no retire offered."""

from __future__ import annotations

from eventstore import EventStore
from eventstore.events import (
    AttemptMinted,
    AttemptRetired,
    GroupSealed,
    ReplacementMinted,
    TrainerRestored,
)
from projections.audit import ARCHIVED_BY_OWN_CUT, NO_REUSED_TRY, TRAINED_ONCE
from projections.training_audit import TRAINED_ONCE_ACROSS_RESTORES
from projections.turn_audit import CONTINUATION_AS_COMMITTED
from protocol.digests import sha256_digest
from protocol.ids import capture_key
from protocol.streams import trainer_stream
from protocol.wire import AttemptRef, ContinuationRef
from tests.projections.audit_fold import audit_both_ways
from tests.projections.builder import LogBuilder

ARCHIVED_THEM = (
    "the plan kept claims that no cut of its own covers (another trainer's cut archived their groups)"
)


def said(store: EventStore) -> list[tuple[str, list[int], str]]:
    return [(v.rule, v.positions, v.message) for v in audit_both_ways(store).violations]


def own_checkpoint(log: LogBuilder, checkpoint_id: str, trainer: str) -> int:
    """`trainer` prepares, commits at the head after its prepare, and resumes: the cut."""
    log.prepare(checkpoint_id, trainer=trainer)
    cut = log.store.head()
    log.commit(checkpoint_id, cut=cut, trainer=trainer)
    log.resume(checkpoint_id)
    return cut


def test_a_claim_at_its_trainers_own_cut_is_covered_and_one_at_the_restores_cut_is_not(
    store: EventStore, log: LogBuilder
) -> None:
    """T1's cut is the position of its claim of g1, and it restores to the position of its claim of
    g2: g1's claim is its own cut's, g2's (at the restore's cut) is kept by a cut T1 never took."""
    log.clean_sibling_group("g1", 1, trainer="T1")
    log.clean_sibling_group("g2", 1, trainer="T1")
    [at_own] = log.claim("g1", 0)
    log.prepare("c1", trainer="T1")
    log.commit("c1", cut=at_own, trainer="T1")
    log.resume("c1")
    [at_cut] = log.claim("g2", 1)
    [restore] = log.restored(at_cut, None, {}, trainer="T1")
    assert said(store) == [
        (
            ARCHIVED_BY_OWN_CUT,
            [at_cut, restore],
            f"trainer 'T1' restored to cut {at_cut}, past its own newest committed cut {at_own}: 1 of its "
            f"claims after {at_own} are kept by a cut it never committed",
        )
    ]


def test_a_claim_at_the_plans_as_of_position_is_one_the_plan_must_roll_back(
    store: EventStore, log: LogBuilder
) -> None:
    """The plan was made as of the claim's own position: the claim stood, so a plan rolling back
    none kept it."""
    log.clean_sibling_group("g1", 1, trainer="T1")
    cut = own_checkpoint(log, "c1", "T1")
    [claim] = log.claim("g1", 0)
    plan = {"as_of_position": claim, "claims_to_roll_back": 0, "sealed_kept": 1}
    [restore] = log.restored(cut, "c1", plan, trainer="T1")
    assert said(store) == [
        (
            ARCHIVED_BY_OWN_CUT,
            [restore],
            f"trainer 'T1' restored to cut {cut} with a plan rolling back 0 claim(s), but 1 of its claims "
            f"stood after that cut: {ARCHIVED_THEM}",
        )
    ]


def test_two_claims_of_one_group_rolled_back_are_two_claims(store: EventStore, log: LogBuilder) -> None:
    """g1 claimed twice after the cut (a violation of its own): a plan rolling back one claim kept the
    other."""
    log.clean_sibling_group("g1", 1, trainer="T1")
    cut = own_checkpoint(log, "c1", "T1")
    [first] = log.claim("g1", 0)
    [second] = log.claim("g1", 1)
    [restore] = log.restored(cut, "c1", {"claims_to_roll_back": 1, "sealed_kept": 1}, trainer="T1")
    assert said(store) == [
        (
            TRAINED_ONCE,
            [first, second],
            f"group g1 is claimed for training again (step 1) while its claim at {first} stands: no "
            "TrainerRestored rolled it back",
        ),
        (
            ARCHIVED_BY_OWN_CUT,
            [restore],
            f"trainer 'T1' restored to cut {cut} with a plan rolling back 1 claim(s), but 2 of its claims "
            f"stood after that cut: {ARCHIVED_THEM}",
        ),
    ]


def test_another_trainers_claim_stands_across_two_restores(store: EventStore, log: LogBuilder) -> None:
    """T2 claims g2 after both cuts; T1 restores to its cut twice (rolling back none of its own), then
    T2 restores to its cut with a plan that rolls back nothing: its claim still stood."""
    log.clean_sibling_group("g1", 1, trainer="T1")
    log.clean_sibling_group("g2", 1, trainer="T2")
    t1_cut = own_checkpoint(log, "t1-c1", "T1")
    t2_cut = own_checkpoint(log, "t2-c1", "T2")
    log.claim("g2", 0)
    for _ in range(2):
        log.restored(t1_cut, "t1-c1", {"claims_to_roll_back": 0, "sealed_kept": 0}, trainer="T1")
    [restore] = log.restored(t2_cut, "t2-c1", {"claims_to_roll_back": 0}, trainer="T2")
    assert said(store) == [
        (
            ARCHIVED_BY_OWN_CUT,
            [restore],
            f"trainer 'T2' restored to cut {t2_cut} with a plan rolling back 0 claim(s), but 1 of its claims "
            f"stood after that cut: {ARCHIVED_THEM}",
        )
    ]


def test_a_plan_losing_six_groups_names_the_first_five(store: EventStore, log: LogBuilder) -> None:
    groups = [f"g{i}" for i in range(1, 7)]
    for group in groups:
        log.clean_sibling_group(group, 1, trainer="T1")
    cut = own_checkpoint(log, "c1", "T1")
    for step, group in enumerate(groups):
        log.claim(group, step)
    [restore] = log.restored(cut, "c1", {"claims_to_roll_back": 6, "sealed_kept": 0}, trainer="T1")
    assert said(store) == [
        (
            ARCHIVED_BY_OWN_CUT,
            [restore],
            "trainer 'T1' rolled back the claims of 6 group(s) (g1, g2, g3, g4, g5) but its plan holds only "
            "0 sealed group(s) to offer again: another trainer's cut archived them, so they are neither "
            "offered nor claimable",
        )
    ]


def test_a_restore_that_kept_its_claims_starts_no_state_of_its_own(
    store: EventStore, log: LogBuilder
) -> None:
    """Only the coordinator's process restarted (`claims_kept`) between g1's claim and checkpoint c2:
    the trainer's state stays the one that trained on g1, so after a restore to c1 (rolling the claim
    back) and one to c2, the state holds g1 again and claiming it once more is told."""
    log.clean_sibling_group("g1", 1, trainer="T1")
    c1 = own_checkpoint(log, "c1", "T1")
    [first] = log.claim("g1", 0)
    log.append(
        trainer_stream("T1"),
        [TrainerRestored(cut_position=c1, checkpoint_id="c1", plan={}, trainer_id="T1", claims_kept=True)],
    )
    c2 = own_checkpoint(log, "c2", "T1")
    log.restored(c1, "c1", {}, trainer="T1")
    [back] = log.restored(c2, "c2", {}, trainer="T1")
    [again] = log.claim("g1", 1)
    assert said(store) == [
        (
            TRAINED_ONCE_ACROSS_RESTORES,
            [first, back, again],
            f"group g1 is claimed for training again (step 1) though the state its trainer holds trained on it "
            f"at {first}, brought back by its restore at {back} to checkpoint c2 (a state on a branch an "
            "earlier restore had left): the log let go of that claim, the trainer's state did not",
        )
    ]


def test_a_sibling_first_minted_by_a_replacement_is_its_generations_sibling(
    store: EventStore, log: LogBuilder
) -> None:
    """p's generation 1 is first minted by a replacement, under an id of its own (p_gx): the group's
    seal reads that id as generation 1's, so the seal is complete."""
    log.reserve("p", 2)
    log.group("p", [AttemptMinted(rollout_id="p_g0", generation_index=0)])
    [stray] = log.group(
        "p",
        [
            ReplacementMinted(
                rollout_id="p_gx", generation_index=1, attempt_index=1, replaces=0, reason="retry"
            )
        ],
    )
    log.seal("p_g0", 0)
    log.ack("p_g0", 0)
    log.seal("p_gx", 1)
    log.ack("p_gx", 1)
    refs = [AttemptRef(rollout_id="p_g0", attempt_index=0), AttemptRef(rollout_id="p_gx", attempt_index=1)]
    log.group("p", [GroupSealed(group_id="p", attempts=refs)])
    assert said(store) == [
        (NO_REUSED_TRY, [stray], "replacement p_gx#1 for a sibling that was never minted"),
    ]


def test_a_replacement_told_to_resume_what_no_retire_offered_names_its_position(
    store: EventStore, log: LogBuilder
) -> None:
    log.reserve("t1", 1)
    log.mint("t1", 1)
    told = ContinuationRef(
        rollout_id="t1_g0",
        source_attempt=0,
        lineage=capture_key("t1_g0", 0),
        turn=2,
        digest=sha256_digest(b"continuation 0/2"),
        prompt_digest=sha256_digest(b"the row of t1_g0"),
        model_call_ids=[],
        generated_tokens=0,
        resources=[],
    )
    [_, replaced] = log.group(
        "t1",
        [
            AttemptRetired(rollout_id="t1_g0", attempt_index=0, outcome="cancelled", cause="checkpoint"),
            ReplacementMinted(
                rollout_id="t1_g0",
                generation_index=0,
                attempt_index=1,
                replaces=0,
                reason="retired",
                continues=told,
            ),
        ],
    )
    assert said(store) == [
        (
            CONTINUATION_AS_COMMITTED,
            [replaced],
            f"t1_g0#1 is told to resume {told.digest}, which is not what #0's agent offered when it was "
            "retired (nothing)",
        )
    ]
