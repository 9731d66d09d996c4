"""`group-seal-complete`, each way a GroupSealed can break it, with the message it gets: a group never
reserved, a group sealed twice, siblings never sealed (one, or several), a try named that never sealed."""

from __future__ import annotations

from eventstore import EventStore
from eventstore.events import AttemptMinted, GroupSealed
from projections.audit import GROUP_SEAL_COMPLETE
from tests.projections.audit_fold import audit_both_ways
from tests.projections.builder import LogBuilder


def seal_violations(store: EventStore) -> list[tuple[list[int], str]]:
    found = audit_both_ways(store).violations
    assert {v.rule for v in found} <= {GROUP_SEAL_COMPLETE}, found
    return [(v.positions, v.message) for v in found]


def sealed_try(log: LogBuilder, rollout_id: str) -> None:
    log.dispatch(rollout_id)
    log.reply(rollout_id)
    log.seal(rollout_id)
    log.ack(rollout_id)


def test_a_group_never_reserved(store: EventStore, log: LogBuilder) -> None:
    (sealed,) = log.group("ghost", [GroupSealed(group_id="ghost", attempts=[])])
    assert seal_violations(store) == [([sealed], "GroupSealed for ghost, a group never reserved")]


def test_a_group_sealed_twice(store: EventStore, log: LogBuilder) -> None:
    log.reserve("p", 1)
    log.mint("p", 1)
    sealed_try(log, "p_g0")
    (first,) = log.seal_group("p", {0: 0})
    (again,) = log.seal_group("p", {0: 0})
    assert seal_violations(store) == [([first, again], "group p is sealed twice")]


def test_one_sibling_never_sealed_was_and_the_try_named_that_never_sealed(
    store: EventStore, log: LogBuilder
) -> None:
    log.reserve("p", 2)
    log.mint("p", 2)
    sealed_try(log, "p_g0")
    log.dispatch("p_g1")
    (sealed,) = log.seal_group("p", {0: 0, 1: 0})
    assert seal_violations(store) == [
        ([sealed], "group p is sealed but p_g1 was never sealed"),
        ([sealed], "group p names p_g1#0, a try that was never sealed"),
    ]


def test_siblings_never_sealed_were_named_by_their_minted_ids_or_the_ones_they_would_get(
    store: EventStore, log: LogBuilder
) -> None:
    """A sibling minted under another id than `<group>_g<index>` is looked for under its own; one never
    minted under the id it would have had."""
    log.reserve("p", 4)
    log.group("p", [AttemptMinted(rollout_id=f"p_g{i}", generation_index=i) for i in range(2)])
    log.group("p", [AttemptMinted(rollout_id="p-odd", generation_index=2)])
    sealed_try(log, "p_g0")
    sealed_try(log, "p_g1")
    (sealed,) = log.seal_group("p", {0: 0, 1: 0})
    assert seal_violations(store) == [([sealed], "group p is sealed but p-odd, p_g3 were never sealed")]
