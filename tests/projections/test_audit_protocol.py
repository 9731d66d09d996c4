"""The auditor's protocol rules: a fenced owner's writes, a resume without every participant's,
a debt dropped without evidence of a newer generation."""

from __future__ import annotations

from eventstore import EventStore, NewEvent
from eventstore.events import CheckpointPrepareStarted, GroupClaimedForTraining, TrainerEpochTaken
from projections.audit import (
    DEBT_DROPPED_ON_EVIDENCE,
    OWNER_EPOCH,
    RESUMED_BY_EVERY_PARTICIPANT,
    audit_log,
)
from protocol.streams import checkpoint_stream, group_stream
from tests.projections.builder import LogBuilder


def rules(store: EventStore) -> list[str]:
    return [v.rule for v in audit_log(store).violations]


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
    written_by(
        store,
        checkpoint_stream("c1"),
        CheckpointPrepareStarted(checkpoint_id="c1", participants=["agent-a"]),
        "old",
    )
    log.clean_sibling_group("g2", 1)
    written_by(store, group_stream("g2"), GroupClaimedForTraining(group_id="g2", train_step=1), "old")
    assert rules(store) == [OWNER_EPOCH, OWNER_EPOCH]


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
