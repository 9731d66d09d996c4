"""Claims for training in the audit, each violation with its message: a group claimed that never sealed,
a group claimed again while its claim stands."""

from __future__ import annotations

from eventstore import EventStore
from projections.audit import TRAINED_ONCE
from tests.projections.audit_fold import audit_both_ways
from tests.projections.builder import LogBuilder


def test_a_claim_of_a_group_never_sealed_or_never_reserved(store: EventStore, log: LogBuilder) -> None:
    log.reserve("p", 1)
    (open_claim,) = log.claim("p", 3)
    (ghost_claim,) = log.claim("ghost", 4)
    found = [(v.rule, v.positions, v.message) for v in audit_both_ways(store).violations]
    assert found == [
        (TRAINED_ONCE, [open_claim], "group p is claimed for training (step 3) but was never sealed"),
        (TRAINED_ONCE, [ghost_claim], "group ghost is claimed for training (step 4) but was never sealed"),
    ]


def test_a_group_claimed_again_while_its_claim_stands(store: EventStore, log: LogBuilder) -> None:
    log.clean_sibling_group("p", 1)
    (first,) = log.claim("p", 1)
    (again,) = log.claim("p", 2)
    [violation] = audit_both_ways(store).violations
    assert (violation.rule, violation.positions) == (TRAINED_ONCE, [first, again])
    assert violation.message == (
        f"group p is claimed for training again (step 2) while its claim at {first} stands: no TrainerRestored "
        "rolled it back"
    )
