"""Fenced appends on both backends: an append carries `Fence(stream, version)` and is written only if
that stream is at exactly that version, atomically with the write."""

from __future__ import annotations

import contextlib
import threading
import uuid
from collections.abc import Callable

import pytest

from eventstore import EventStore, ExpectedVersion, Fence, Fenced, NewEvent, open_store
from eventstore.events import AttemptMinted, TrainerRestored

TRAINER = "trainer-t1"


def minted(i: int, group: str = "p1") -> AttemptMinted:
    return AttemptMinted(rollout_id=f"{group}_g{i}", generation_index=i)


def epoch(trainer: str = "t1") -> TrainerRestored:
    return TrainerRestored(cut_position=None, checkpoint_id=None, plan={}, trainer_id=trainer)


def take_epoch(store: EventStore, stream: str = TRAINER) -> int:
    """An owner's epoch: the version its own append leaves on the trainer stream."""
    return store.append(stream, [epoch()]).stream_version


def test_fence_holds_on_every_append_path(store_url: str) -> None:
    store = open_store(store_url)
    mine = Fence(TRAINER, take_epoch(store))
    assert mine.version == 0
    one = store.append("group-p1", [minted(0)], ExpectedVersion.NO_STREAM, fence=mine)
    batch = store.append_batch(
        [("group-p1", [minted(1)], 0), ("group-p2", [minted(0, "p2")], -1)], fence=mine
    )
    with store.transaction() as tx:
        in_tx = tx.append_batch([("group-p3", [minted(0, "p3")], -1, mine)])
        in_tx += [tx.append("group-p3", [minted(1, "p3")], 0, fence=mine)]
    assert one.positions == [2]
    assert [r.positions for r in batch] == [[3], [4]]
    assert [r.positions for r in in_tx] == [[5], [6]]
    assert store.head() == 6 and store.verify_chain() is None


def test_stale_owner_is_fenced_off_and_writes_nothing(store_url: str) -> None:
    store = open_store(store_url)
    stale = Fence(TRAINER, take_epoch(store))
    store.append("group-p1", [minted(0)], fence=stale)
    newer = Fence(TRAINER, take_epoch(store))  # a newer owner takes the trainer over
    head = store.head()

    attempts: list[Callable[[], object]] = [
        lambda: store.append("group-p1", [minted(1)], fence=stale),
        lambda: store.append_batch([("group-p1", [minted(1)], 0)], blobs=[b'{"x":1}'], fence=stale),
        lambda: _in_transaction(store, stale),
    ]
    for attempt in attempts:
        with pytest.raises(Fenced) as refused:
            attempt()
        assert (refused.value.stream_id, refused.value.expected, refused.value.actual) == (TRAINER, 0, 1)
        assert refused.value.appending_to == "group-p1"
        assert "nothing was written" in str(refused.value)
        assert store.head() == head
        assert store.stream_version("group-p1") == 0
    assert store.get_blob("sha256:" + "0" * 64) is None
    assert [e.position for e in store.read_all()] == [1, 2, 3]

    # A fence on a stream that does not exist yet holds at NO_STREAM, and not at 0.
    store.append("group-p2", [minted(0, "p2")], fence=Fence("trainer-new", ExpectedVersion.NO_STREAM))
    with pytest.raises(Fenced):
        store.append("group-p2", [minted(1, "p2")], fence=Fence("trainer-new", 0))
    # The newer owner goes on.
    assert store.append("group-p1", [minted(1)], 0, fence=newer).stream_version == 1


def _in_transaction(store: EventStore, fence: Fence) -> None:
    with store.transaction() as tx:
        tx.append("group-p1", [minted(1)], fence=fence)


def test_batch_with_one_fenced_off_append_names_it_and_writes_nothing(store_url: str) -> None:
    store = open_store(store_url)
    stale = Fence(TRAINER, take_epoch(store))
    take_epoch(store)
    ok = Fence(TRAINER, 1)
    appends = [
        ("group-p1", [minted(0)], -1, ok),
        ("group-p2", [minted(0, "p2")], -1, stale),
        ("group-p3", [minted(0, "p3")], -1, None),
    ]
    with pytest.raises(Fenced) as refused:
        store.append_batch(appends)
    assert refused.value.appending_to == "group-p2" and refused.value.actual == 1
    assert store.head() == 2
    # Without the fenced-off append the others go through, as each would alone.
    results = store.append_batch([appends[0], appends[2]])
    assert [r.positions for r in results] == [[3], [4]]


def test_fence_sees_the_batch_s_earlier_appends(store_url: str) -> None:
    """Taking the epoch and fencing on it in one batch: each append sees what the earlier ones leave."""
    store = open_store(store_url)
    results = store.append_batch(
        [
            (TRAINER, [epoch()], ExpectedVersion.NO_STREAM),
            ("group-p1", [minted(0)], ExpectedVersion.NO_STREAM, Fence(TRAINER, 0)),
        ]
    )
    assert [r.positions for r in results] == [[1], [2]]
    with pytest.raises(Fenced):
        store.append_batch(
            [
                (TRAINER, [epoch()], 0),
                ("group-p1", [minted(1)], 0, Fence(TRAINER, 0)),  # the epoch above moved it to 1
            ]
        )
    assert store.head() == 2


def test_retry_of_a_committed_fenced_append_is_idempotent(store_url: str) -> None:
    """A retry after a lost commit answer is answered from the log, even when its own write moved the fence."""
    store = open_store(store_url)
    fence = Fence(TRAINER, take_epoch(store))
    event = NewEvent.of(epoch(), event_id=uuid.uuid4())
    first = store.append(TRAINER, [event], 0, fence=fence)
    again = store.append(TRAINER, [event], 0, fence=fence)
    batch_again = store.append_batch([(TRAINER, [event], 0, fence)])
    assert again.idempotent and again.positions == first.positions
    assert batch_again[0].idempotent and batch_again[0].positions == first.positions
    with pytest.raises(Fenced):  # a new event under the same, now stale, fence
        store.append(TRAINER, [epoch()], fence=fence)


def test_fence_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError):
        Fence("", 0)
    with pytest.raises(ValueError):
        Fence(TRAINER, ExpectedVersion.ANY)


def test_concurrent_owners_never_write_under_a_moved_fence(store_url: str) -> None:
    """Four owners take the trainer over in turn and append fenced work, all at once.

    Whatever the interleaving, every work event the log holds was written while the trainer stream
    was at the epoch it was fenced on, and every refusal names a newer epoch.
    """
    store = open_store(store_url)
    take_epoch(store)
    rounds, writers = 12, 4
    start = threading.Barrier(writers)
    refusals: list[Fenced] = []
    errors: list[BaseException] = []

    def owner(w: int) -> None:
        try:
            start.wait(30)
            for i in range(rounds):
                current = store.stream_version(TRAINER)
                try:  # take over: expected version makes the epoch itself a compare-and-set
                    mine = store.append(TRAINER, [epoch(f"w{w}")], current).stream_version
                except Exception:
                    continue
                for j in range(2):
                    event = NewEvent.of(minted(j, f"w{w}r{i}"), metadata={"epoch": mine})
                    try:
                        store.append(f"group-w{w}", [event], fence=Fence(TRAINER, mine))
                    except Fenced as exc:
                        refusals.append(exc)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=owner, args=(w,)) for w in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and not any(t.is_alive() for t in threads)

    trainer_version = -1
    work = 0
    for ev in store.read_all():
        if ev.stream_id == TRAINER:
            trainer_version = ev.stream_version
        else:
            work += 1
            assert ev.metadata["epoch"] == trainer_version, ev.position
    assert all(r.actual > r.expected for r in refusals)
    assert work + len(refusals) > 0 and store.verify_chain() is None


def _owner_process(url: str, w: int, rounds: int) -> None:
    store = open_store(url)
    for i in range(rounds):
        current = store.stream_version(TRAINER)
        try:
            mine = store.append(TRAINER, [epoch(f"w{w}")], current).stream_version
        except Exception:
            continue
        for j in range(2):
            event = NewEvent.of(minted(j, f"w{w}r{i}"), metadata={"epoch": mine})
            with contextlib.suppress(Fenced):
                store.append(f"group-w{w}", [event], fence=Fence(TRAINER, mine))


def test_owner_processes_never_write_under_a_moved_fence(pg_url: str) -> None:
    """The same race between four processes on one PostgreSQL log (the append lock, not a Python lock)."""
    import multiprocessing as mp

    from eventstore import upgrade_database

    upgrade_database(pg_url)
    store = open_store(pg_url)
    take_epoch(store)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_owner_process, args=(pg_url, w, 10)) for w in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(180)
    assert all(p.exitcode == 0 for p in procs)
    trainer_version = -1
    for ev in store.read_all():
        if ev.stream_id == TRAINER:
            trainer_version = ev.stream_version
        else:
            assert ev.metadata["epoch"] == trainer_version, ev.position
    assert trainer_version >= 1 and store.verify_chain() is None
