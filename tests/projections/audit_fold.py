"""The audit's rules are a fold like any projection's (`AuditProjection`); `audit_events` is the same fold
inlined in one pass.  `audit_both_ways` audits a log with `audit_log` after checking that the fold, one
decoded event at a time, finds the same violations (the row checks of the hash chain and the unreadable
events are the pass's alone)."""

from __future__ import annotations

from eventstore import EventStore
from projections.audit import EVENT_READABLE, HASH_CHAIN, AuditProjection, AuditReport, Violation, audit_log
from projections.base import ReplayRefused, decode


def _order(v: Violation) -> tuple[int, str, str]:
    return (v.positions[0] if v.positions else 0, v.rule, v.message)


def folded(store: EventStore) -> list[Violation]:
    """The violations `AuditProjection` finds folding the log one decoded event at a time."""
    projection = AuditProjection()
    state = projection.initial()
    for event in store.read_all():
        try:
            decoded = decode(event)
        except ReplayRefused:
            continue
        projection.apply(state, event, decoded)
        assert state.position == event.position
    projection.finish(state)
    return sorted(state.violations, key=_order)


def audit_both_ways(store: EventStore) -> AuditReport:
    report = audit_log(store)
    of_rules = sorted(
        (v for v in report.violations if v.rule not in (HASH_CHAIN, EVENT_READABLE)), key=_order
    )
    assert folded(store) == of_rules, report.as_json()
    return report
