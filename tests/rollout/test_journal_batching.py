"""Group commit in the journal: concurrent appends share a transaction, and nothing else changes."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import pytest

from eventstore import EventStore, NewEvent
from eventstore.errors import EventIdConflict
from eventstore.events import AttemptMinted, Event, GroupReserved
from projections.ledger import LedgerState
from tests.rollout.conftest import PROMPT, gid
from trainer.errors import FencedOff
from trainer.journal import Journal
from trainer.journal_batch import new_event


def reserved(g: str) -> list[Event]:
    return [
        GroupReserved(group_id=g, prompt_ref=PROMPT, agent_name="a", expected_generations=8, mode="sibling"),
        AttemptMinted(rollout_id=f"{g}_g0", generation_index=0),
    ]


def minted(g: str, i: int) -> AttemptMinted:
    return AttemptMinted(rollout_id=f"{g}_g{i}", generation_index=i)


async def test_concurrent_appends_share_transactions_and_builds_see_their_own_stream(
    store: EventStore,
) -> None:
    journal = Journal(store)
    await journal.load()
    groups = [gid("gc") for _ in range(20)]
    await asyncio.gather(*(journal.append(f"group-{g}", reserved(g)) for g in groups))
    assert journal.batches < journal.appends == 20

    seen: dict[str, list[int]] = {g: [] for g in groups}

    def next_sibling(g: str) -> Callable[[LedgerState], list[Event]]:
        def build(ledger: LedgerState) -> list[Event]:
            # Two appends to one stream never share a batch: each sees the one before it.
            n = len(ledger.groups[g].siblings)
            seen[g].append(n)
            return [minted(g, n)]

        return build

    await asyncio.gather(*(journal.append(f"group-{g}", next_sibling(g)) for g in groups for _ in range(3)))
    for g in groups:
        assert seen[g] == [1, 2, 3]
        assert [e.stream_version for e in store.read_stream(f"group-{g}")] == [0, 1, 2, 3, 4]
        assert journal.versions[f"group-{g}"] == 4
    assert store.verify_chain() is None


async def test_a_refused_append_fails_alone_and_a_fence_stops_what_follows_it(store: EventStore) -> None:
    journal = Journal(store)
    await journal.load()
    before, fenced, after = gid("gc"), gid("gc"), gid("gc")
    for g in (before, fenced, after):
        await journal.append(f"group-{g}", reserved(g))

    def refuses(ledger: LedgerState) -> list[Event]:
        raise ValueError("nothing to write here")

    # Another writer moves `fenced` on; this journal has not folded it, so only the store refuses.
    store.append(f"group-{fenced}", [NewEvent.of(minted(fenced, 5))])
    results = await asyncio.gather(
        journal.append(f"group-{before}", [minted(before, 1)]),
        journal.append(f"group-{after}", refuses),
        journal.append(f"group-{fenced}", [minted(fenced, 1)]),
        journal.append(f"group-{after}", [minted(after, 1)]),
        return_exceptions=True,
    )
    assert isinstance(results[0], list) and len(results[0]) == 1
    assert isinstance(results[1], ValueError)
    assert isinstance(results[2], FencedOff) and journal.fenced is results[2]
    assert isinstance(results[3], FencedOff)
    assert [e.stream_version for e in store.read_stream(f"group-{before}")] == [0, 1, 2]
    assert [e.stream_version for e in store.read_stream(f"group-{after}")] == [0, 1]
    with pytest.raises(FencedOff):
        await journal.append(f"group-{before}", [minted(before, 2)])


async def test_fixed_appends_and_builds_to_one_stream_chain_in_one_batch(store: EventStore) -> None:
    journal = Journal(store)
    await journal.load()
    g = gid("gc")
    await journal.append(f"group-{g}", reserved(g))
    seen: list[int] = []

    def after_them(ledger: LedgerState) -> list[Event]:
        n = len(ledger.groups[g].siblings)
        seen.append(n)
        return [minted(g, n)]

    batches = journal.batches
    await asyncio.gather(
        *(journal.append(f"group-{g}", [minted(g, i)]) for i in range(1, 6)),
        journal.append(f"group-{g}", after_them),
        journal.append(f"group-{g}", after_them),
    )
    # One transaction (the siblings' replies of a prompt group hold and seal together): each build
    # saw every earlier append of the batch to its stream, through the look-ahead.
    assert journal.batches - batches == 1
    assert seen == [6, 7]
    assert [e.stream_version for e in store.read_stream(f"group-{g}")] == list(range(9))
    assert [e.data["generation_index"] for e in store.read_stream(f"group-{g}", from_version=2)] == [
        1, 2, 3, 4, 5, 6, 7
    ]  # fmt: skip
    assert store.verify_chain() is None
    # The look-ahead folded copies: the journal's own ledger is exactly the log's.
    fresh = Journal(store)
    await fresh.load()
    assert journal.ledger == fresh.ledger
    assert journal.ledger_projection.state_hash(journal.ledger) == fresh.ledger_projection.state_hash(
        fresh.ledger
    )


async def test_a_build_that_looked_ahead_is_built_again_when_the_append_before_it_is_refused(
    store: EventStore,
) -> None:
    journal = Journal(store)
    await journal.load()
    g, other = gid("gc"), gid("gc")
    for group in (g, other):
        await journal.append(f"group-{group}", reserved(group))
    stream = f"group-{g}"
    # Another stream already holds the id the first append below will give its event: the store
    # refuses it (an id conflict, not a fence), so the batch is written again one by one.
    taken = new_event(stream, journal.versions[stream] + 1, minted(g, 5), journal.writer)
    store.append(f"group-{other}", [taken])
    seen: list[int] = []

    def next_sibling(ledger: LedgerState) -> list[Event]:
        n = len(ledger.groups[g].siblings)
        seen.append(n)
        return [minted(g, n)]

    results = await asyncio.gather(
        journal.append(stream, [minted(g, 5)]),
        journal.append(stream, next_sibling),
        return_exceptions=True,
    )
    assert isinstance(results[0], EventIdConflict)
    # First built behind the refused append (2 siblings), then again on the log as it is (1).
    assert seen == [2, 1]
    assert results[1] == [minted(g, 1)]
    assert [e.data["generation_index"] for e in store.read_stream(stream, from_version=1)] == [0, 1]
    assert journal.fenced is None


async def test_settle_waits_for_an_append_whose_caller_was_cancelled_mid_write(
    store: EventStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A caller cancelled while its batch is in the database: the write goes on, and `settle` returns
    only once it is in the log and folded (recovery reading the projections after it sees it)."""
    journal = Journal(store)
    await journal.load()
    g = gid("gc")
    entered, release = threading.Event(), threading.Event()
    real = store.append_batch

    def gated(*args: Any, **kwargs: Any) -> Any:
        entered.set()
        assert release.wait(30), "the test's gate was never opened"
        return real(*args, **kwargs)

    monkeypatch.setattr(store, "append_batch", gated)
    caller = asyncio.create_task(journal.append(f"group-{g}", reserved(g)))
    assert await asyncio.to_thread(entered.wait, 30)
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    settling = asyncio.create_task(journal.settle())
    await asyncio.sleep(0.05)
    assert not settling.done() and g not in journal.ledger.groups  # the write is still in the database
    release.set()
    await asyncio.wait_for(settling, 30)
    assert g in journal.ledger.groups
    assert [e.type for e in store.read_stream(f"group-{g}")] == ["GroupReserved", "AttemptMinted"]
