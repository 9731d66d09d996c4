"""Rows edited or removed behind the append-only trigger's back are reported by the hash-chain rule."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest

from eventstore import EventStore, open_store
from eventstore.events import RunReplied
from projections.audit import HASH_CHAIN, audit_log
from projections.base import ReplayRefused
from projections.runner import ProjectionRunner, rebuild
from tests.projections.builder import LogBuilder
from tests.projections.simulator import Simulator
from tests.projections.tamper import delete_row, edit_data, rehash_stream


@pytest.fixture
def any_store(store_url: str) -> Iterator[EventStore]:
    s = open_store(store_url)
    try:
        yield s
    finally:
        s.close()


def history(store: EventStore) -> None:
    """A legal history with projection checkpoints stored along it."""
    Simulator(LogBuilder(store), random.Random(11)).run(30)
    ProjectionRunner(store, checkpoint_every=15, keep=None).catch_up()


def test_clean_history_with_checkpoints_is_clean(any_store: EventStore) -> None:
    history(any_store)
    assert audit_log(any_store).ok


def test_tampered_row_is_reported(any_store: EventStore, store_url: str) -> None:
    history(any_store)
    target = next(e for e in any_store.read_all() if e.type == "RunReplied" and e.position > 5)
    edited = RunReplied.model_validate_json(target.data_json).model_copy(update={"reward": 99.0})
    edit_data(store_url, target.position, edited.model_dump(mode="json"))

    report = audit_log(any_store)
    assert {v.rule for v in report.violations} == {HASH_CHAIN}, report.as_json()
    assert [(v.positions, "does not match its content" in v.message) for v in report.violations] == [
        ([target.position], True)
    ]


def test_rehashed_stream_is_caught_by_checkpoint_digests(any_store: EventStore, store_url: str) -> None:
    """A tamperer who also rewrites the stream's chain passes the per-stream check, not the running digest."""
    history(any_store)
    target = next(e for e in any_store.read_all() if e.type == "RunReplied" and e.position > 5)
    edited = RunReplied.model_validate_json(target.data_json).model_copy(update={"reward": 99.0})
    edit_data(store_url, target.position, edited.model_dump(mode="json"))
    rehash_stream(store_url, any_store, target.stream_id)
    assert any_store.verify_chain() is None  # the per-stream chain alone no longer sees it

    report = audit_log(any_store)
    assert report.violations and {v.rule for v in report.violations} == {HASH_CHAIN}, report.as_json()
    assert all("digest" in v.message and v.positions[0] >= target.position for v in report.violations)


def test_deleted_last_event_of_a_stream_is_reported(any_store: EventStore, store_url: str) -> None:
    history(any_store)
    events = list(any_store.read_all())
    last_of_stream = {e.stream_id: e for e in events}
    target = next(e for e in reversed(events[:-5]) if last_of_stream[e.stream_id] is e)
    delete_row(store_url, target.position)

    report = audit_log(any_store)
    assert {v.rule for v in report.violations} == {HASH_CHAIN}, report.as_json()
    assert report.violations[0].positions == [target.position - 1, target.position + 1]
    assert "missing" in report.violations[0].message
    with pytest.raises(ReplayRefused, match="missing"):
        rebuild(any_store, from_checkpoint=False)


def test_deleted_last_event_of_the_log_is_reported(any_store: EventStore, store_url: str) -> None:
    history(any_store)
    runner = ProjectionRunner(any_store, checkpoint_every=15)
    runner.catch_up()
    runner.checkpoint()  # a checkpoint at the head records how far the log went
    head = any_store.head()
    delete_row(store_url, head)

    report = audit_log(any_store)
    assert {v.rule for v in report.violations} == {HASH_CHAIN}, report.as_json()
    assert any(
        v.positions == [head - 1, head] and "removed from its end" in v.message for v in report.violations
    )
