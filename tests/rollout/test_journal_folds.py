"""The journal's threads do its I/O and the event loop folds: a coroutine reading the ledger between
two awaits never sees it change, however the writer's thread is scheduled meanwhile."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from eventstore import EventStore, NewEvent, RecordedEvent
from eventstore.errors import EventIdConflict
from eventstore.events import Event
from projections.ledger import LedgerProjection, LedgerState
from tests.rollout.conftest import gid
from tests.rollout.test_journal_batching import minted, reserved
from trainer.journal import Journal
from trainer.journal_batch import new_event
from trainer.logview import CATCH_UP_PAGE

# A safety net for a broken journal, never reached when it works: every wait below is on a gate.
GATE_S = 30.0


class ThreadsSeen(LedgerProjection):
    """The ledger projection, noting the thread of every event it folds."""

    def __init__(self) -> None:
        super().__init__()
        self.threads: set[int] = set()
        self.folded = 0

    def apply(self, state: LedgerState, event: RecordedEvent, decoded: Event) -> None:
        self.threads.add(threading.get_ident())
        self.folded += 1
        super().apply(state, event, decoded)


async def test_a_loop_over_the_ledger_sees_no_fold_while_the_writer_thread_finishes_a_write(
    store: EventStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    journal = Journal(store)
    await journal.load()
    first, second = gid("fold"), gid("fold")
    await journal.append(f"group-{first}", reserved(first))

    inside, go = threading.Event(), threading.Event()
    append_batch = store.append_batch

    def gated(*args: Any, **kwargs: Any) -> Any:
        inside.set()
        assert go.wait(GATE_S), "the reader never let the write go on"
        return append_batch(*args, **kwargs)

    monkeypatch.setattr(store, "append_batch", gated)
    pending = asyncio.create_task(journal.append(f"group-{second}", reserved(second)))
    assert await asyncio.to_thread(inside.wait, GATE_S), "the writer never reached the store"

    # Half way through a loop over the groups (no await inside, as the coordinator's are), the
    # writer's thread writes the second group and does all it does after that: it holds the
    # journal's thread lock for the whole of its call, so taking the lock waits for its end.
    seen: list[str] = []
    for group_id in journal.ledger.groups:
        go.set()
        with journal._thread_lock:
            pass
        seen.append(group_id)
    assert seen == [first]  # a fold in the thread: "dictionary changed size during iteration"
    assert second not in journal.ledger.groups

    assert await pending == reserved(second)
    assert [*journal.ledger.groups] == [first, second]
    fresh = Journal(store)
    await fresh.load()
    assert journal.ledger == fresh.ledger


async def test_every_fold_runs_on_the_event_loop(store: EventStore) -> None:
    seen = ThreadsSeen()
    journal = Journal(store, ledger_projection=seen)
    loop_thread = threading.get_ident()
    # Another writer's events: the load folds pages of them, more than one page.
    other = gid("fold")
    store.append(f"group-{other}", [NewEvent.of(e) for e in reserved(other)])
    store.append(f"group-{other}", [NewEvent.of(minted(other, i)) for i in range(1, CATCH_UP_PAGE + 2)], 1)
    await journal.load()
    assert seen.folded == CATCH_UP_PAGE + 3
    assert len(journal.ledger.groups[other].siblings) == CATCH_UP_PAGE + 2

    # Its own appends (folded from the rows the store handed back), concurrent ones in a batch, one
    # after another writer's row (a catch-up), and a batch refused and written one by one.
    mine = [gid("fold") for _ in range(3)]
    await asyncio.gather(*(journal.append(f"group-{g}", reserved(g)) for g in mine))
    store.append(f"group-{other}", [NewEvent.of(minted(other, CATCH_UP_PAGE + 2))], CATCH_UP_PAGE + 2)
    await journal.append(f"group-{mine[0]}", [minted(mine[0], 1)])
    assert len(journal.ledger.groups[other].siblings) == CATCH_UP_PAGE + 3
    # Another stream holds the id the next append gives its event: the store refuses the batch.
    stream = f"group-{mine[1]}"
    taken = new_event(stream, journal.versions[stream] + 1, minted(mine[1], 5), journal.writer)
    store.append(f"group-{other}", [taken], CATCH_UP_PAGE + 3)
    results = await asyncio.gather(
        journal.append(stream, [minted(mine[1], 5)]),
        journal.append(f"group-{mine[2]}", [minted(mine[2], 1)]),
        return_exceptions=True,
    )
    assert isinstance(results[0], EventIdConflict)
    assert results[1] == [minted(mine[2], 1)]
    assert journal.fenced is None
    await journal.catch_up()

    assert seen.threads == {loop_thread}
    fresh = Journal(store)
    await fresh.load()
    assert journal.ledger == fresh.ledger
