"""The facts of `trained-once-across-restores` alone (projections.training_audit.TrainingFacts): which
claims a trainer's state holds after each restore, and what a claim of one it holds again reports."""

from __future__ import annotations

from projections.training_audit import TRAINED_ONCE_ACROSS_RESTORES, TrainingFacts

AGAIN = "the log let go of that claim, the trainer's state did not"


def test_a_claim_the_state_still_holds_is_reported_with_where_it_was_trained() -> None:
    facts = TrainingFacts()
    facts.claimed(10, "T", "g", False, 1)
    facts.claimed(11, None, "g", False, 1)  # another trainer's line: its own first claim
    facts.claimed(12, "T", "g", True, 2)  # the log still holds the first: trained-once's to report
    facts.restored(20, "T", 5, "c0", kept=True)  # only the coordinator restarted: the state is as it was
    facts.claimed(30, "T", "g", False, 3)
    assert set(facts.lines) == {"T", ""}
    assert facts.found == [
        (
            TRAINED_ONCE_ACROSS_RESTORES,
            [12, None, 30],
            f"group g is claimed for training again (step 3) though the state its trainer holds trained on it "
            f"at 12: {AGAIN}",
        )
    ]


def test_a_restore_brings_back_the_claims_of_the_branch_it_stood_in_at_its_cut() -> None:
    """a (at 5) on the first branch; a restore at 10 to cut 7 keeps it; b (at 12) on that branch; a restore
    at 20 to cut 15 stands on the second branch and holds both; a restore to no state holds nothing."""
    facts = TrainingFacts()
    facts.claimed(5, "T", "a", False, 0)
    facts.restored(10, "T", 7, "c1", kept=False)
    facts.claimed(12, "T", "b", False, 1)
    facts.claimed(13, "T", "late", False, 2)
    facts.restored(20, "T", 12, "c2", kept=False)
    line = facts.lines["T"]
    assert line.held == {"a": (5, 20), "b": (12, 20)}
    assert line.restored == (20, "c2")
    assert [(b.start, b.parent, b.limit) for b in line.branches] == [(0, None, 0), (10, 0, 7), (20, 1, 12)]
    facts.claimed(30, "T", "a", False, 3)
    assert facts.found == [
        (
            TRAINED_ONCE_ACROSS_RESTORES,
            [5, 20, 30],
            "group a is claimed for training again (step 3) though the state its trainer holds trained on it "
            "at 5, brought back by its restore at 20 to checkpoint c2 (a state on a branch an earlier restore "
            f"had left): {AGAIN}",
        )
    ]
    facts.restored(40, "T", None, None, kept=False)
    assert facts.lines["T"].held == {} and facts.lines["T"].restored == (40, None)
    facts.restored(
        50, "T", 6, None, kept=False
    )  # back to the first branch at 6: `a` alone, no checkpoint named
    facts.claimed(60, "T", "a", False, 4)
    assert facts.found[-1][1:] == (
        [5, 50, 60],
        "group a is claimed for training again (step 4) though the state its trainer holds trained on it "
        f"at 5, brought back by its restore at 50 to checkpoint none (a state on a branch an earlier restore "
        f"had left): {AGAIN}",
    )


def test_a_restore_to_the_position_of_an_earlier_restore_stands_in_the_state_that_restore_began() -> None:
    """The state at position 10, where a restore to cut 7 began a branch, is that branch's: the claim at 8
    (rolled back by that restore) is not in it.  A claim made after a restore is held by no restore."""
    facts = TrainingFacts()
    facts.claimed(5, "T", "a", False, 0)
    facts.claimed(8, "T", "x", False, 1)
    facts.restored(10, "T", 7, "c1", kept=False)
    facts.restored(20, "T", 10, "c2", kept=False)
    assert facts.lines["T"].held == {"a": (5, 20)}
    facts.claimed(21, "T", "z", False, 2)
    facts.claimed(22, "T", "z", False, 3)
    assert facts.found == [
        (
            TRAINED_ONCE_ACROSS_RESTORES,
            [21, None, 22],
            f"group z is claimed for training again (step 3) though the state its trainer holds trained on it "
            f"at 21: {AGAIN}",
        )
    ]
