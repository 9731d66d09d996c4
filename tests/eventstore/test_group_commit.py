"""Group commit on both backends: appends that arrive together share one write, and each is still
written or refused on its own.  Phases advance by gates (a write held open), never by timing."""

from __future__ import annotations

import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from functools import partial
from typing import Any

import pytest

from eventstore import (
    AppendOutcomeUnknown,
    AppendResult,
    EventStore,
    Fence,
    Fenced,
    NewEvent,
    StoreBusy,
    WrongExpectedVersion,
    open_store,
)
from eventstore.events import AttemptMinted
from eventstore.group_commit import GroupCommit, Waiter, take_batch, worth_waiting
from eventstore.recorder import CheckedAppend


def minted(i: int, group: str = "p1") -> AttemptMinted:
    return AttemptMinted(rollout_id=f"{group}_g{i}", generation_index=i)


class HeldWrites:
    """Wraps the store's group write: the first write waits on `release` until the test lets it go."""

    def __init__(self, store: EventStore, **limits: Any) -> None:
        self.store = store
        self.entered = threading.Event()
        self.release = threading.Event()
        self.sizes: list[int] = []
        self.first = True
        store.group_commit = GroupCommit(self.write, **limits)

    def write(self, appends: list[CheckedAppend]) -> list[AppendResult | Exception]:
        self.sizes.append(len(appends))
        if self.first:
            self.first = False
            self.entered.set()
            assert self.release.wait(30)
        return self.store._append_each(appends)


def until(condition: Callable[[], bool]) -> None:
    """A gate: waits (bounded) for another thread to reach a state, whatever the speeds."""
    deadline = time.monotonic() + 30
    while not condition():
        assert time.monotonic() < deadline, "gate not reached"
        time.sleep(0.005)


def waiting(store: EventStore, n: int) -> Callable[[], bool]:
    """The gate `until` waits on: `n` appends queued behind the write in progress."""
    return lambda: store.group_commit.waiting == n


def run(fn: Callable[[], Any], out: dict[str, Any], key: str) -> threading.Thread:
    def target() -> None:
        try:
            out[key] = fn()
        except BaseException as exc:
            out[key] = exc

    thread = threading.Thread(target=target)
    thread.start()
    return thread


def test_appends_that_arrive_together_share_one_write_and_are_refused_alone(store_url: str) -> None:
    store = open_store(store_url)
    store.append("trainer-t1", [minted(0, "t")])
    store.append("trainer-t1", [minted(1, "t")])  # the epoch is now version 1
    held = HeldWrites(store)
    out: dict[str, Any] = {}
    threads = [run(lambda: store.append("group-a", [minted(0, "a")], -1), out, "a")]
    assert held.entered.wait(30)
    later = {
        "b": lambda: store.append("group-b", [minted(0, "b"), minted(1, "b")], -1),
        "wrong": lambda: store.append("group-a", [minted(9, "a")], 5),
        "stale": lambda: store.append("group-c", [minted(0, "c")], fence=Fence("trainer-t1", 0)),
        "d": lambda: store.append("group-a", [minted(1, "a")], fence=Fence("trainer-t1", 1)),
    }
    for key, fn in later.items():
        threads.append(run(fn, out, key))
        queued = len(threads) - 1
        until(waiting(store, queued))
    held.release.set()
    for t in threads:
        t.join(60)

    assert held.sizes == [1, 4]  # the four that arrived during the first write went in one
    assert isinstance(out["wrong"], WrongExpectedVersion) and out["wrong"].actual == 0
    assert isinstance(out["stale"], Fenced) and out["stale"].actual == 1
    assert out["a"].positions == [3]
    assert out["b"].positions == [4, 5] and out["d"].positions == [6] and out["d"].stream_version == 1
    assert [e.position for e in store.read_all()] == [1, 2, 3, 4, 5, 6]
    assert store.stream_version("group-c") == -1 and store.verify_chain() is None
    assert store.group_commit.stats.largest == 4


def test_one_event_id_twice_in_a_group_goes_in_two_writes(store_url: str) -> None:
    store = open_store(store_url)
    held = HeldWrites(store)
    event = NewEvent.of(minted(0), event_id=uuid.uuid4())
    out: dict[str, Any] = {}
    threads = [run(lambda: store.append("group-x", [minted(0, "x")]), out, "x")]
    assert held.entered.wait(30)
    threads.append(run(lambda: store.append("group-p1", [event]), out, "first"))
    until(lambda: store.group_commit.waiting == 1)
    threads.append(run(lambda: store.append("group-p1", [event]), out, "retry"))
    until(lambda: store.group_commit.waiting == 2)
    held.release.set()
    for t in threads:
        t.join(60)
    assert held.sizes == [1, 1, 1]
    assert not out["first"].idempotent and out["retry"].idempotent
    assert out["retry"].positions == out["first"].positions == [2]


def test_a_full_queue_refuses_with_nothing_written(store_url: str) -> None:
    store = open_store(store_url)
    held = HeldWrites(store, max_waiting=1, wait_s=0.5)
    out: dict[str, Any] = {}
    leader = run(lambda: store.append("group-a", [minted(0, "a")]), out, "a")
    assert held.entered.wait(30)
    queued = run(lambda: store.append("group-b", [minted(0, "b")]), out, "b")
    until(lambda: store.group_commit.waiting == 1)
    with pytest.raises(StoreBusy, match="nothing was written"):  # no room in the queue
        store.append("group-c", [minted(0, "c")])
    queued.join(60)  # the write in flight is held past its deadline: never taken, nothing written
    assert isinstance(out["b"], StoreBusy)
    held.release.set()
    leader.join(60)
    assert isinstance(out["a"], AppendResult)  # the leader waits on its own write
    assert store.stream_version("group-b") == -1 and store.stream_version("group-c") == -1
    stats = store.group_commit.stats
    assert stats.busy + stats.timed_out == 2 and stats.appends == 1


def test_a_waiter_whose_write_does_not_answer_learns_the_outcome_is_unknown(store_url: str) -> None:
    """B and C go in one write that hangs: the one not leading it gives up at its deadline, told that
    the append may be written, and a retry with the same ids finds it in the log."""
    store = open_store(store_url)
    gates = [threading.Event(), threading.Event()]
    entered = [threading.Event(), threading.Event()]
    calls: list[int] = []

    def held(appends: list[CheckedAppend]) -> list[AppendResult | Exception]:
        call = len(calls)
        calls.append(len(appends))
        if call < 2:
            entered[call].set()
            assert gates[call].wait(60)
        return store._append_each(appends)

    store.group_commit = GroupCommit(held, wait_s=5.0)
    events = {k: NewEvent.of(minted(0, k), event_id=uuid.uuid4()) for k in "bc"}
    out: dict[str, Any] = {}
    threads = [run(lambda: store.append("group-a", [minted(0, "a")]), out, "a")]
    assert entered[0].wait(30)
    for k in "bc":
        threads.append(run(partial(store.append, f"group-{k}", [events[k]]), out, k))
        queued = len(threads) - 1
        until(waiting(store, queued))
    gates[0].set()
    assert entered[1].wait(30)  # B and C in one write, held
    until(lambda: sum(isinstance(out.get(k), AppendOutcomeUnknown) for k in "bc") == 1)
    gates[1].set()
    for t in threads:
        t.join(60)
    assert calls == [1, 2]
    unknown = next(k for k in "bc" if isinstance(out[k], AppendOutcomeUnknown))
    retry = store.append(f"group-{unknown}", [events[unknown]])
    assert retry.idempotent and store.stream_version(f"group-{unknown}") == 0


def test_take_batch_keeps_order_caps_size_and_splits_repeated_ids() -> None:
    def waiter(*ids: str) -> Waiter:
        return Waiter(CheckedAppend("s", [], -2, None, 0.0), list(ids))

    a, b, c, d = waiter("1"), waiter("2"), waiter("1"), waiter("3")
    queue = deque([a, b, c, d])
    assert take_batch(queue, 10) == [a, b]  # c repeats a's id: it waits for the next write
    assert take_batch(queue, 1) == [c]
    assert take_batch(queue, 10) == [d] and not queue
    twice = deque([waiter("5", "5"), waiter("6")])
    assert len(take_batch(twice, 10)) == 1 and len(twice) == 1
    with pytest.raises(ValueError):
        GroupCommit(lambda a: [], max_batch=0)


def test_a_leader_waits_only_for_appends_on_their_way() -> None:
    assert not worth_waiting(queued=1, arriving=0, last_write=1, max_batch=128)  # a lone writer
    assert worth_waiting(queued=1, arriving=2, last_write=1, max_batch=128)  # others being prepared
    assert worth_waiting(queued=3, arriving=0, last_write=8, max_batch=128)  # the last write's writers
    assert not worth_waiting(queued=8, arriving=0, last_write=8, max_batch=128)
    assert not worth_waiting(queued=4, arriving=5, last_write=8, max_batch=4)  # a full write goes


def test_leadership_passes_to_the_oldest_queued_append_write_after_write(store_url: str) -> None:
    """Five appends queue behind a held write, at most two a write: they go oldest first in three
    more writes, each led by the oldest append left, and every one is answered."""
    store = open_store(store_url)
    held = HeldWrites(store, max_batch=2)
    out: dict[str, Any] = {}
    threads = [run(lambda: store.append("group-a", [minted(0, "a")]), out, "a")]
    assert held.entered.wait(30)
    for i in range(5):
        threads.append(run(partial(store.append, f"group-q{i}", [minted(0, f"q{i}")]), out, f"q{i}"))
        until(waiting(store, i + 1))
    held.release.set()
    for t in threads:
        t.join(60)
    assert held.sizes == [1, 2, 2, 1]
    assert [out[f"q{i}"].positions for i in range(5)] == [[2], [3], [4], [5], [6]]
    assert store.group_commit.waiting == 0 and store.group_commit.stats.writes == 4
