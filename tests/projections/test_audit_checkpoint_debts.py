"""Which ACK debts a committed checkpoint may not leave unpaid at its cut (`checkpoint-clean`), exactly:
a debt owed at or before the cut, to one of the checkpoint's participants, of one of its own trainer's
groups, not paid by the cut (paid after it counts) and not carried by the prepare; the message counts
them all and names the first five."""

from __future__ import annotations

from eventstore import EventStore
from eventstore.events import GroupTakenOver
from projections.audit import ARCHIVED_BY_OWN_CUT, CHECKPOINT_CLEAN, Violation
from tests.projections.audit_fold import audit_both_ways
from tests.projections.builder import LogBuilder


def finished(log: LogBuilder, group_id: str, tries: int, trainer: str | None = None) -> list[int]:
    """A group whose tries are all sealed and owed (not ACKed): the positions of their debts."""
    log.reserve(group_id, tries, trainer=trainer)
    log.mint(group_id, tries)
    owed = []
    for i in range(tries):
        log.dispatch(f"{group_id}_g{i}")
        log.reply(f"{group_id}_g{i}")
        owed.append(log.seal(f"{group_id}_g{i}")[-1])
    return owed


def clean_violations(store: EventStore) -> list[Violation]:
    found = audit_both_ways(store).violations
    assert {v.rule for v in found} == {CHECKPOINT_CLEAN}, found
    return found


def test_the_debts_at_the_cut_counted_and_the_first_five_named(store: EventStore, log: LogBuilder) -> None:
    owed = finished(log, "p", 7)
    other = LogBuilder(store, agent="agent-b")  # a debt to an agent that is no participant of c1
    other.reserve("q", 1)
    other.mint("q", 1)
    other.dispatch("q_g0")
    other.reply("q_g0")
    other.seal("q_g0")
    (paid_at_cut,) = log.ack("p_g6")
    cut = paid_at_cut  # p_g6 is paid at the cut itself: not owed there
    (paid_after,) = log.ack("p_g5")  # paid after the cut, before the commit: owed at the cut
    log.prepare("c1")
    (committed,) = log.commit("c1", cut=cut)
    [violation] = clean_violations(store)
    assert violation.positions == [*owed[:6], committed]
    assert violation.message == (
        f"checkpoint c1 committed with 6 unpaid ACK debt(s) to a participant at its cut {cut}: "
        "p_g0/0, p_g1/0, p_g2/0, p_g3/0, p_g4/0 …"
    )
    assert paid_after > cut


def test_five_debts_are_all_named_and_one_owed_at_the_cut_itself_counts(
    store: EventStore, log: LogBuilder
) -> None:
    owed = finished(log, "p", 5)
    log.prepare("c1")
    (committed,) = log.commit("c1", cut=owed[-1])
    [violation] = clean_violations(store)
    assert violation.positions == [*owed, committed]
    assert violation.message == (
        f"checkpoint c1 committed with 5 unpaid ACK debt(s) to a participant at its cut {owed[-1]}: "
        "p_g0/0, p_g1/0, p_g2/0, p_g3/0, p_g4/0"
    )


def test_another_trainers_debts_to_an_agent_of_the_same_name_are_not_its_cuts(
    store: EventStore, log: LogBuilder
) -> None:
    finished(log, "mine", 1, trainer="T1")
    theirs = finished(log, "theirs", 2, trainer="T2")
    log.ack("mine_g0")
    log.prepare("c1", trainer="T1")
    log.commit("c1", trainer="T1")
    assert audit_both_ways(store).ok
    log.prepare("c2", trainer="T2")
    (committed,) = log.commit("c2", trainer="T2")
    [violation] = clean_violations(store)
    assert violation.positions == [*theirs, committed]
    assert violation.message.endswith(": theirs_g0/0, theirs_g1/0")


def test_the_cut_is_its_preparing_trainers_or_with_no_prepare_its_committing_ones(
    store: EventStore, log: LogBuilder
) -> None:
    mine = finished(log, "mine", 1, trainer="T1")
    theirs = finished(log, "theirs", 1, trainer="T2")
    (committed,) = log.commit("c1", trainer="T2")  # no prepare on record: the commit's trainer
    found = audit_both_ways(store).violations
    assert [(v.rule, v.positions, v.message) for v in found] == [
        (
            CHECKPOINT_CLEAN,
            [*theirs, committed],
            f"checkpoint c1 committed with 1 unpaid ACK debt(s) to a participant at its cut {committed - 1}: "
            "theirs_g0/0",
        ),
        (
            CHECKPOINT_CLEAN,
            [committed],
            "checkpoint c1 is committed without a CheckpointPrepareStarted before it",
        ),
    ]
    (prepared,) = log.prepare("c2", trainer="T1")
    (named_other,) = log.commit("c2", trainer="T2")  # a commit naming another trainer than its prepare
    found = audit_both_ways(store).violations
    assert [
        (v.rule, v.positions)
        for v in found
        if v.positions[-1] == named_other and v.positions[0] != named_other
    ] == [
        (CHECKPOINT_CLEAN, [*mine, named_other]),  # the preparing trainer's debts
        (ARCHIVED_BY_OWN_CUT, [prepared, named_other]),
    ], found
    archived = next(v for v in found if v.rule == ARCHIVED_BY_OWN_CUT)
    assert archived.message == (
        "checkpoint c2 was prepared by trainer 'T1' but its commit names trainer 'T2': the ledger would "
        "archive that trainer's groups at a cut it never took"
    )


def test_a_group_taken_over_is_its_new_trainers(store: EventStore, log: LogBuilder) -> None:
    owed = finished(log, "p", 1, trainer="A")
    log.group("p", [GroupTakenOver(group_id="p", trainer_id="B", reason="recovery")])
    log.group("ghost", [GroupTakenOver(group_id="ghost", trainer_id="B", reason="recovery")])  # no such group
    log.prepare("a1", trainer="A")
    log.commit("a1", trainer="A")
    assert audit_both_ways(store).ok  # no longer A's debt
    log.prepare("b1", trainer="B")
    (committed,) = log.commit("b1", trainer="B")
    [violation] = clean_violations(store)
    assert violation.positions == [*owed, committed]


def test_debts_paid_between_the_cut_and_the_commit(store: EventStore, log: LogBuilder) -> None:
    """Paid after the cut, a debt owed at or before it counts; one to another agent, or owed after the
    cut, does not; nor, for a trainer's commit, one of a group of no trainer."""
    other = LogBuilder(store, agent="agent-b")
    other.reserve("q", 1)
    other.mint("q", 1)
    other.dispatch("q_g0")
    other.reply("q_g0")
    other.seal("q_g0")
    (owed_at_cut,) = finished(log, "p", 1)
    finished(log, "r", 1)  # owed after the cut
    log.ack("r_g0")
    log.ack("p_g0")
    other.ack("q_g0")
    log.prepare("c1")
    (committed,) = log.commit("c1", cut=owed_at_cut)
    [violation] = clean_violations(store)
    assert violation.positions == [owed_at_cut, committed]
    assert violation.message.endswith(f"at its cut {owed_at_cut}: p_g0/0")


def test_a_trainers_cut_leaves_out_debts_of_groups_of_no_trainer(store: EventStore, log: LogBuilder) -> None:
    finished(log, "n", 1)
    cut = store.head()
    log.ack("n_g0")  # paid after the cut
    log.prepare("c1", trainer="T1")
    log.commit("c1", cut=cut, trainer="T1")
    assert audit_both_ways(store).ok
