"""Typed replay on both backends: pages read ahead, decoded in one pass, a bad event refused with
its position after everything before it."""

from __future__ import annotations

import sys
import threading

import pytest

from eventstore import InvalidEvent, NewEvent, open_store
from eventstore.bulk_reads import READ_AHEAD_SWITCH_S
from eventstore.events import AttemptMinted, RunFailed
from eventstore.records import decode_events, decode_in_bulk


def minted(i: int) -> AttemptMinted:
    return AttemptMinted(rollout_id=f"p1_g{i}", generation_index=i)


def test_read_typed_yields_every_event_then_refuses_the_bad_one_by_position(store_url: str) -> None:
    store = open_store(store_url)
    store.append("group-p1", [minted(i) for i in range(25)])
    # An old-version row is stored as written and upcast on read: this one cannot be.
    store.append("group-p1", [NewEvent(type="RunFailed", data={"bogus": 1}, schema_version=1)])
    store.append("group-p1", [minted(i) for i in range(25, 28)])
    seen = []
    with pytest.raises(InvalidEvent, match="position 26"):
        for recorded, event in store.read_typed(batch_size=7):
            seen.append((recorded.position, event))
    assert [p for p, _ in seen] == list(range(1, 26))
    assert all(e == minted(i) for i, (_, e) in enumerate(seen))


def test_old_versions_are_upcast_on_the_same_path(store_url: str) -> None:
    store = open_store(store_url)
    old = {"rollout_id": "p1_g0", "attempt_index": 0, "reason": "timeout after 30s"}
    store.append("group-p1", [NewEvent(type="RunFailed", data=old, schema_version=1), minted(1)])
    [(_, first), (_, second)] = list(store.read_typed())
    assert isinstance(first, RunFailed) and first.rollout_id == "p1_g0"
    assert second == minted(1)


def test_pages_read_ahead_cover_the_range_and_stop_with_their_consumer(store_url: str) -> None:
    store = open_store(store_url)
    store.append("group-p1", [minted(i) for i in range(23)])
    pages = list(store.read_pages(3, 20, batch_size=5))
    assert [len(p) for p in pages] == [5, 5, 5, 2]
    assert [e.position for p in pages for e in p] == list(range(4, 21))
    assert [len(p) for p in store.read_pages(batch_size=23)] == [23]  # a full last page, then an empty one
    before = sys.getswitchinterval()
    reading = store.read_pages(batch_size=2)
    next(reading)
    assert sys.getswitchinterval() == min(before, READ_AHEAD_SWITCH_S)  # while the reader runs
    reading.close()  # the consumer stops early: the reader thread stops too
    assert not [t for t in threading.enumerate() if t.name == "ledger-read-ahead"]
    assert sys.getswitchinterval() == before
    with pytest.raises(ValueError):
        next(store.read_pages(batch_size=0))


def test_bulk_decode_gives_the_same_events(store_url: str) -> None:
    store = open_store(store_url)
    store.append("group-p1", [minted(i) for i in range(10)])
    store.append("trainer-t1", [RunFailed(rollout_id="p1_g0", attempt_index=0, reason="x", kind="deadline")])
    page = next(store.read_pages())
    decoded, error = decode_events(page)
    assert error is None and decode_in_bulk(page) == decoded


def test_the_collector_threshold_is_raised_only_while_replays_run() -> None:
    import gc

    from eventstore.bulk_reads import BULK_THRESHOLD0, fewer_collections

    before = gc.get_threshold()
    with fewer_collections():
        with fewer_collections():  # nested, as two replays at once
            assert gc.get_threshold()[0] == max(BULK_THRESHOLD0, before[0])
        assert gc.get_threshold()[0] == max(BULK_THRESHOLD0, before[0])
    assert gc.get_threshold() == before
    with pytest.raises(RuntimeError), fewer_collections():
        raise RuntimeError("a replay that fails")
    assert gc.get_threshold() == before
