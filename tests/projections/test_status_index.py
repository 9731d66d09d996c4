"""The ledger's index of open and sealed-unclaimed groups stays what a scan of every group says.

The trainer's loop asks for both at every batch; the fold keeps them (`LedgerState.status_index`)
instead of a scan of the groups in play.  Over legal logs with reservations, seals, dead letters,
claims, restores that roll claims back and checkpoints that archive groups, the index, built at any
point of the fold, agrees with the scan after every later event, in the same order.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from eventstore import EventStore
from eventstore.events import GroupDeadLettered, GroupSealed, TrainerRestored
from projections.base import decode
from projections.ledger import LedgerProjection, LedgerState
from tests.projections.builder import LogBuilder
from tests.projections.simulator import Simulator


def scanned(state: LedgerState) -> tuple[list[str], list[str]]:
    """The definition: every group in play, in reservation order."""
    groups = list(state.groups.values())
    return (
        [g.group_id for g in groups if g.status == "open"],
        [g.group_id for g in groups if g.status == "sealed" and not g.claims],
    )


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(rng=st.randoms(use_true_random=False), steps=st.integers(10, 80), built_at=st.floats(0, 1))
def test_the_index_agrees_with_a_scan_after_every_event(
    fresh_store: Callable[[], EventStore], rng: random.Random, steps: int, built_at: float
) -> None:
    store = fresh_store()
    try:
        Simulator(LogBuilder(store), rng).run(steps)
        events = list(store.read_all())
    finally:
        store.close()
    projection = LedgerProjection()
    state = projection.initial()
    first_query = int(built_at * len(events))
    for i, event in enumerate(events):
        projection.apply(state, event, decode(event))
        if i < first_query:
            continue
        assert (state.open_group_ids(), state.sealed_unclaimed_ids()) == scanned(state), (i, event.type)


def test_the_index_follows_a_group_through_seal_claim_restore_and_archive(
    store: EventStore, log: LogBuilder
) -> None:
    """One history, step by step: each transition moves the group between the two sets."""
    projection = LedgerProjection()
    state = projection.initial()
    seen = 0

    def fold() -> None:
        nonlocal seen
        for event in list(store.read_all())[seen:]:
            projection.apply(state, event, decode(event))
            seen += 1

    sim = Simulator(log, random.Random(11))
    fold()
    assert state.open_group_ids() == [] and state.sealed_unclaimed_ids() == []  # built, empty
    kinds: set[type] = set()
    for _ in range(400):
        sim.step()
        before = seen
        fold()
        kinds |= {type(decode(e)) for e in list(store.read_all())[before:]}
        assert (state.open_group_ids(), state.sealed_unclaimed_ids()) == scanned(state)
    # The history went through each transition the index must follow.
    assert {GroupSealed, GroupDeadLettered, TrainerRestored} <= kinds
    assert state.archived, "no checkpoint archived a group"
