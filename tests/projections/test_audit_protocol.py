"""The auditor's protocol rules: a fenced owner's writes, a resume without every participant's,
a debt dropped without evidence of a newer generation, a group archived by another trainer's cut."""

from __future__ import annotations

from eventstore import EventStore, NewEvent
from eventstore.events import (
    AckAccepted,
    AckRejected,
    CheckpointAborted,
    CheckpointCommitted,
    CheckpointPrepareStarted,
    GroupClaimedForTraining,
    TrainerEpochTaken,
    TrainerRestored,
)
from projections.audit import (
    ACTS_BY_OWNER,
    ARCHIVED_BY_OWN_CUT,
    CHECKPOINT_CLEAN,
    DEBT_DROPPED_ON_EVIDENCE,
    NO_CLAIM_WHILE_PREPARED,
    OWNER_EPOCH,
    RESUMED_BY_EVERY_PARTICIPANT,
)
from protocol.streams import checkpoint_stream, group_stream
from tests.projections.audit_fold import audit_both_ways
from tests.projections.builder import LogBuilder


def rules(store: EventStore) -> list[str]:
    return [v.rule for v in audit_both_ways(store).violations]


def take_epoch(store: EventStore, writer: str) -> None:
    store.append("trainer", [TrainerEpochTaken(trainer_id=None, reason="start", writer=writer)])


def written_by(store: EventStore, stream: str, event: object, writer: str) -> None:
    store.append(stream, [NewEvent.of(event, metadata={"writer": writer})])  # type: ignore[arg-type]


def test_a_claim_and_a_prepare_by_the_owner_are_clean_by_a_fenced_owner_are_not(
    store: EventStore, log: LogBuilder
) -> None:
    take_epoch(store, "old")
    log.clean_sibling_group("g1", 1)
    written_by(store, group_stream("g1"), GroupClaimedForTraining(group_id="g1", train_step=0), "old")
    assert rules(store) == []
    take_epoch(store, "new")
    new = store.head()
    written_by(
        store,
        checkpoint_stream("c1"),
        CheckpointPrepareStarted(checkpoint_id="c1", participants=["agent-a"]),
        "old",
    )
    log.clean_sibling_group("g2", 1)
    written_by(store, group_stream("g2"), GroupClaimedForTraining(group_id="g2", train_step=1), "old")
    assert rules(store) == [OWNER_EPOCH, OWNER_EPOCH]
    written_by(
        store,
        checkpoint_stream("c1"),
        CheckpointCommitted(
            checkpoint_id="c1", participants=["agent-a"], cut_position=new, prepare_wait_s={"agent-a": 0.1}
        ),
        "old",
    )
    fenced = f"a fenced owner of trainer None: new took its owner epoch at {new}"
    assert [v.message for v in audit_both_ways(store).violations if v.rule == OWNER_EPOCH] == [
        f"the prepare of checkpoint c1 was written by old, {fenced}",
        f"the claim of g2 was written by old, {fenced}",
        f"the commit of checkpoint c1 was written by old, {fenced}",
    ]


def test_resumed_without_every_participants_confirmation_is_a_violation(
    store: EventStore, log: LogBuilder
) -> None:
    log.prepare("c1")
    log.commit("c1")
    log.resume("c1", confirmed=False)
    assert rules(store) == [RESUMED_BY_EVERY_PARTICIPANT]


def test_a_debt_is_dropped_only_on_a_newer_generation(store: EventStore, log: LogBuilder) -> None:
    log.clean_sibling_group("g1", 3)
    store_rules = rules(store)
    assert store_rules == []
    log.reserve("g2", 2)
    log.mint("g2", 2)
    for rid in ("g2_g0", "g2_g1"):
        log.dispatch(rid)
        log.reply(rid)
        log.seal(rid)
    log.reject("g2_g0")  # the agent restarted (newer generation): dropped with evidence
    log.reject("g2_g1", agent_generation=None)  # a v1-shaped drop: nothing shows the agent lost it
    assert DEBT_DROPPED_ON_EVIDENCE in rules(store)
    assert rules(store).count(DEBT_DROPPED_ON_EVIDENCE) == 1


def two_trainers(log: LogBuilder) -> dict[str, int]:
    """T1 checkpoints, then claims g1; T2 runs g2, claims it and commits a cut past T1's claim.
    Returns the positions the tests name."""
    log.clean_sibling_group("g1", 1, trainer="T1")
    log.prepare("t1-c1", trainer="T1")
    t1_cut = log.store.head()
    log.commit("t1-c1", cut=t1_cut, trainer="T1")
    log.resume("t1-c1")
    claim = log.claim("g1", 0)[0]
    log.clean_sibling_group("g2", 1, trainer="T2")
    log.claim("g2", 0)
    log.prepare("t2-c1", trainer="T2")
    t2_cut = log.store.head()
    t2_commit = log.commit("t2-c1", cut=t2_cut, trainer="T2")[0]
    log.resume("t2-c1")
    return {"t1_cut": t1_cut, "claim": claim, "t2_cut": t2_cut, "t2_commit": t2_commit}


def violations_of(store: EventStore, rule: str) -> list[list[int]]:
    return [v.positions for v in audit_both_ways(store).violations if v.rule == rule]


def test_two_trainers_each_restoring_to_its_own_cut_is_clean(store: EventStore, log: LogBuilder) -> None:
    """T2's cut covers T1's claim; T1 restores to its own, earlier cut, rolls the claim back and claims
    the group again: nothing was archived by another trainer's cut."""
    at = two_trainers(log)
    log.restored(
        at["t1_cut"], "t1-c1", {"claims_to_roll_back": 1, "sealed_kept": 1, "debts_to_flush": 0}, trainer="T1"
    )
    log.claim("g1", 0)
    assert rules(store) == []


def test_a_restore_to_another_trainers_checkpoint_is_a_violation(store: EventStore, log: LogBuilder) -> None:
    """T1 restores to T2's cut: its claim of g1, after its own cut, would be kept (archived) by a cut
    T1 never committed, so g1 would be neither offered nor claimable again."""
    at = two_trainers(log)
    restore = log.restored(at["t2_cut"], "t2-c1", {"claims_to_roll_back": 0}, trainer="T1")[0]
    found = violations_of(store, ARCHIVED_BY_OWN_CUT)
    assert [at["t2_commit"], restore] in found  # another trainer's checkpoint
    assert [at["claim"], restore] in found  # T1's claim kept past T1's own cut
    assert set(rules(store)) == {ARCHIVED_BY_OWN_CUT}


def test_a_plan_that_keeps_a_claim_after_its_own_cut_is_a_violation(
    store: EventStore, log: LogBuilder
) -> None:
    """The restore names T1's own cut, but its plan rolled back nothing while T1's claim stood after
    it: the plan saw g1 archived (by T2's cut) and kept its claim."""
    at = two_trainers(log)
    restore = log.restored(at["t1_cut"], "t1-c1", {"claims_to_roll_back": 0}, trainer="T1")[0]
    assert violations_of(store, ARCHIVED_BY_OWN_CUT) == [[restore]]
    assert rules(store) == [ARCHIVED_BY_OWN_CUT]


def test_a_commit_naming_another_trainer_than_its_prepare_is_a_violation(
    store: EventStore, log: LogBuilder
) -> None:
    """A tampered commit: T2 prepared it, the commit names T1, so the ledger would archive T1's groups
    at T2's cut."""
    at = two_trainers(log)
    prepare = log.prepare("t2-c2", trainer="T2")[0]
    commit = log.commit("t2-c2", trainer="T1")[0]
    assert violations_of(store, ARCHIVED_BY_OWN_CUT) == [[prepare, commit]]
    assert at["claim"] > 0


def test_a_plan_that_no_longer_holds_a_rolled_back_group_is_a_violation(
    store: EventStore, log: LogBuilder
) -> None:
    """Case 6 as it was: T2's cut archived T1's claimed g1, so T1's plan rolled its claim back but held
    no sealed group to offer again (the ledger then neither offered g1 nor let it be claimed)."""
    at = two_trainers(log)
    plan = {"claims_to_roll_back": 1, "sealed_kept": 0}
    restore = log.restored(at["t1_cut"], "t1-c1", plan, trainer="T1")[0]
    assert violations_of(store, ARCHIVED_BY_OWN_CUT) == [[restore]]
    assert "g1" in audit_both_ways(store).violations[0].message


def test_a_claim_between_prepare_and_commit_is_a_violation(store: EventStore, log: LogBuilder) -> None:
    """Issue case: a group claimed after the trainer's checkpoint was prepared (the trainer was saving)
    lands inside the cut taken at commit; a claim before the prepare, another trainer's claim in the
    window, and a claim in the window of an aborted checkpoint are all clean."""
    log.clean_sibling_group("g1", 1, trainer="T1")
    log.clean_sibling_group("g2", 1, trainer="T1")
    log.clean_sibling_group("g3", 1, trainer="T2")
    log.clean_sibling_group("g4", 1, trainer="T1")
    log.prepare("c0", trainer="T1")
    log.claim("g4", 0)  # inside an aborted checkpoint's window: no cut holds it
    log.abort("c0")
    log.claim("g1", 0)
    log.prepare("c1", trainer="T1")
    log.claim("g3", 0)  # T2's group: T1's checkpoint says nothing of it
    log.commit("c1", cut=log.store.head(), trainer="T1")
    log.resume("c1")
    assert rules(store) == []
    prepare = log.prepare("c2", trainer="T1")[0]
    late = log.claim("g2", 1)[0]
    commit = log.commit("c2", cut=log.store.head(), trainer="T1")[0]
    assert violations_of(store, NO_CLAIM_WHILE_PREPARED) == [[prepare, late, commit]]
    assert rules(store) == [NO_CLAIM_WHILE_PREPARED]
    assert audit_both_ways(store).violations[0].message == (
        f"checkpoint c2 committed 1 claim(s) made after its prepare at {prepare}: they are inside the cut but "
        "not in the state the trainer saved, so a restore to it neither offers nor trains them"
    )


def test_an_event_one_trainers_process_writes_on_anothers_group_or_checkpoint_is_a_violation(
    store: EventStore, log: LogBuilder
) -> None:
    """Issue case 1 from the log alone: B's relay sent A's receipt to B's agent of the same name and
    appended the answer into A's group; B's process aborted A's checkpoint.  The owner's own writes, a
    row without a writer and a writer that took no epoch (an operator, a worker) are not judged."""
    store.append("trainer-A", [TrainerEpochTaken(trainer_id="A", reason="start", writer="wa")])
    store.append("trainer-B", [TrainerEpochTaken(trainer_id="B", reason="start", writer="wb")])
    log.reserve("g1", 1, trainer="A")
    log.mint("g1", 1)
    log.dispatch("g1_g0")
    log.reply("g1_g0")
    log.seal("g1_g0")
    written_by(
        store, group_stream("g1"), AckAccepted(rollout_id="g1_g0", attempt_index=0, idempotent=True), "wa"
    )
    written_by(
        store, group_stream("g1"), AckAccepted(rollout_id="g1_g0", attempt_index=0, idempotent=True), "ops"
    )
    written_by(
        store,
        checkpoint_stream("c1"),
        CheckpointPrepareStarted(checkpoint_id="c1", participants=["agent-a"], trainer_id="A"),
        "wa",
    )
    assert rules(store) == []
    foreign = [
        (group_stream("g1"), AckRejected(rollout_id="g1_g0", attempt_index=0, error="unknown_execution")),
        (group_stream("g1"), AckRejected(rollout_id="g1_g0", attempt_index=0, error="unknown_execution")),
        (
            checkpoint_stream("c1"),
            CheckpointAborted(checkpoint_id="c1", participants=["agent-a"], reason="ag: 1 debts unpaid"),
        ),
    ]
    for stream, event in foreign:
        written_by(store, stream, event, "wb")
    found = [v for v in audit_both_ways(store).violations if v.rule == ACTS_BY_OWNER]
    # one per stream and trainer: the group's first foreign write, the checkpoint's
    assert [v.positions for v in found] == [[store.head() - 2], [store.head()]]
    assert [v.message for v in found] == [
        "AckRejected on group g1 of trainer 'A' was written by wb, a process of trainer 'B': one trainer acted "
        "on another's work",
        "CheckpointAborted on checkpoint c1 of trainer 'A' was written by wb, a process of trainer 'B': one "
        "trainer acted on another's work",
    ]


def test_a_known_writers_rows_outside_groups_and_prepared_checkpoints_are_not_judged(
    store: EventStore, log: LogBuilder
) -> None:
    """Trainer B's process writes its own restore and epoch on its trainer stream, and aborts a checkpoint nobody
    prepared: neither is an act on another trainer's work (the abort is a checkpoint-clean matter)."""
    store.append("trainer-A", [TrainerEpochTaken(trainer_id="A", reason="start", writer="wa")])
    store.append("trainer-B", [TrainerEpochTaken(trainer_id="B", reason="start", writer="wb")])
    written_by(
        store,
        "trainer-B",
        TrainerRestored(cut_position=None, checkpoint_id=None, plan={}, trainer_id="B"),
        "wb",
    )
    written_by(store, "trainer-B", TrainerEpochTaken(trainer_id="B", reason="recovery", writer="wb"), "wb")
    written_by(
        store,
        checkpoint_stream("c9"),
        CheckpointAborted(checkpoint_id="c9", participants=["agent-a"], reason="deadline"),
        "wb",
    )
    assert rules(store) == [CHECKPOINT_CLEAN]


def test_a_fenced_owner_of_a_named_trainer_claims_prepares_and_commits(
    store: EventStore, log: LogBuilder
) -> None:
    store.append("trainer-A", [TrainerEpochTaken(trainer_id="A", reason="start", writer="wa")])
    log.clean_sibling_group("g", 1, trainer="A")
    store.append("trainer-A", [TrainerEpochTaken(trainer_id="A", reason="recovery", writer="wa2")])
    taken = store.head()
    written_by(store, group_stream("g"), GroupClaimedForTraining(group_id="g", train_step=0), "wa")
    written_by(
        store,
        checkpoint_stream("c1"),
        CheckpointPrepareStarted(checkpoint_id="c1", participants=["agent-a"], trainer_id="A"),
        "wa",
    )
    written_by(
        store,
        checkpoint_stream("c1"),
        CheckpointCommitted(
            checkpoint_id="c1",
            participants=["agent-a"],
            cut_position=taken,
            prepare_wait_s={"agent-a": 0.1},
            trainer_id="A",
        ),
        "wa",
    )
    fenced = f"was written by wa, a fenced owner of trainer 'A': wa2 took its owner epoch at {taken}"
    assert [v.message for v in audit_both_ways(store).violations if v.rule == OWNER_EPOCH] == [
        f"the claim of g {fenced}",
        f"the prepare of checkpoint c1 {fenced}",
        f"the commit of checkpoint c1 {fenced}",
    ]
