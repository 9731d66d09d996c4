"""A checkpoint's life in the audit, each violation with its message: decided without a prepare, decided
twice two ways, resumed without a commit or without every participant's confirmation; a restore to
another trainer's checkpoint or past its own cut, a plan that keeps claims or no longer holds their
groups, a plan that flushes fewer debts than were unpaid."""

from __future__ import annotations

from eventstore import EventStore
from eventstore.events import CheckpointResumed
from projections.audit import ARCHIVED_BY_OWN_CUT, CHECKPOINT_CLEAN, DEBT_UNTIL_ACCEPTED
from protocol.streams import checkpoint_stream
from tests.projections.audit_fold import audit_both_ways
from tests.projections.builder import LogBuilder
from tests.projections.test_audit_protocol import two_trainers


def said(store: EventStore) -> list[tuple[str, list[int], str]]:
    return [(v.rule, v.positions, v.message) for v in audit_both_ways(store).violations]


def test_decisions_without_a_prepare_or_against_an_earlier_one(store: EventStore, log: LogBuilder) -> None:
    (aborted,) = log.abort("c0")
    log.prepare("c1")
    (committed,) = log.commit("c1")
    (again,) = log.commit("c1", cut=committed - 1)  # the same decision again: not a conflict
    (then_aborted,) = log.abort("c1")
    assert said(store) == [
        (
            CHECKPOINT_CLEAN,
            [aborted],
            "checkpoint c0 is aborted without a CheckpointPrepareStarted before it",
        ),
        (CHECKPOINT_CLEAN, [again, then_aborted], "checkpoint c1 is aborted after it was already committed"),
    ]


def test_a_resume_of_a_checkpoint_never_committed(store: EventStore, log: LogBuilder) -> None:
    (_, unknown) = log.resume("c0")
    log.prepare("c1")
    (aborted,) = log.abort("c1")
    (_, after_abort) = log.resume("c1")
    assert said(store) == [
        (CHECKPOINT_CLEAN, [unknown], "checkpoint c0 is resumed but was never committed"),
        (CHECKPOINT_CLEAN, [aborted, after_abort], "checkpoint c1 is resumed but was never committed"),
    ]


def test_a_resume_no_participant_confirmed(store: EventStore, log: LogBuilder) -> None:
    log.prepare("c1", ["agent-a", "agent-b"])
    (committed,) = log.commit("c1", participants=["agent-a", "agent-b"])
    (resumed,) = log.append(
        checkpoint_stream("c1"), [CheckpointResumed(checkpoint_id="c1", participants=["agent-a", "agent-b"])]
    )
    found = said(store)
    assert [(rule, positions) for rule, positions, _ in found] == [
        ("resumed-by-every-participant", [committed, resumed])
    ]
    assert found[0][2] == (
        "checkpoint c1 is resumed in the log but agent-a, agent-b never confirmed it resumed "
        "(no CheckpointParticipantFinished resumed)"
    )


def test_a_restore_to_another_trainers_checkpoint_past_its_own_cut(
    store: EventStore, log: LogBuilder
) -> None:
    at = two_trainers(log)
    (restore,) = log.restored(at["t2_cut"], "t2-c1", {"claims_to_roll_back": 0}, trainer="T1")
    assert said(store) == [
        (
            ARCHIVED_BY_OWN_CUT,
            [at["claim"], restore],
            f"trainer 'T1' restored to cut {at['t2_cut']}, past its own newest committed cut {at['t1_cut']}: "
            f"1 of its claims after {at['t1_cut']} are kept by a cut it never committed",
        ),
        (
            ARCHIVED_BY_OWN_CUT,
            [at["t2_commit"], restore],
            "trainer 'T1' restored to checkpoint t2-c1, which trainer 'T2' took: another trainer's cut says "
            "nothing of where this one may restore to",
        ),
    ]


def test_a_plan_that_keeps_claims_or_no_longer_holds_their_groups(store: EventStore, log: LogBuilder) -> None:
    at = two_trainers(log)
    (restore,) = log.restored(
        at["t1_cut"], "t1-c1", {"claims_to_roll_back": 0, "sealed_kept": 0}, trainer="T1"
    )
    assert said(store) == [
        (
            ARCHIVED_BY_OWN_CUT,
            [restore],
            f"trainer 'T1' restored to cut {at['t1_cut']} with a plan rolling back 0 claim(s), but 1 of its "
            "claims stood after that cut: the plan kept claims that no cut of its own covers (another "
            "trainer's cut archived their groups)",
        ),
        (
            ARCHIVED_BY_OWN_CUT,
            [restore],
            "trainer 'T1' rolled back the claims of 1 group(s) (g1) but its plan holds only 0 sealed group(s) "
            "to offer again: another trainer's cut archived them, so they are neither offered nor claimable",
        ),
    ]


def test_a_claim_at_the_cut_stands_one_after_it_is_rolled_back(store: EventStore, log: LogBuilder) -> None:
    log.clean_sibling_group("g1", 1)
    log.clean_sibling_group("g2", 1)
    (at_cut,) = log.claim("g1", 0)
    log.prepare("c1")
    log.commit("c1", cut=at_cut)
    log.resume("c1")
    log.claim("g2", 1)
    log.restored(at_cut, "c1", {"claims_to_roll_back": 1, "sealed_kept": 1})
    assert said(store) == []
    log.claim("g2", 1)  # rolled back: claimed again once
    log.claim("g1", 1)  # stood at the cut: claimed twice
    assert [rule for rule, _, _ in said(store)] == ["trained-once"]


def test_a_plan_flushing_fewer_debts_than_were_unpaid_when_it_was_made(
    store: EventStore, log: LogBuilder
) -> None:
    log.reserve("p", 3)
    log.mint("p", 3)
    owed = []
    for i in range(3):
        log.dispatch(f"p_g{i}")
        log.reply(f"p_g{i}")
        owed.append(log.seal(f"p_g{i}")[-1])
    # the plan was made when the first two were owed (the second at that very position)
    (restore,) = log.restored(None, None, {"as_of_position": owed[1], "debts_to_flush": 1})
    assert said(store) == [
        (
            DEBT_UNTIL_ACCEPTED,
            [owed[0], owed[1], restore],
            "the restored trainer plans to flush 1 ACK debts, but 2 were unpaid: a debt was dropped without an "
            "AckAccepted",
        )
    ]
