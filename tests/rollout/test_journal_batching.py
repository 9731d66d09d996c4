"""Group commit in the journal: concurrent appends share a transaction, and nothing else changes."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from eventstore import EventStore, NewEvent
from eventstore.events import AttemptMinted, Event, GroupReserved
from projections.ledger import LedgerState
from tests.rollout.conftest import PROMPT, gid
from workers.rollout.errors import FencedOff
from workers.rollout.journal import Journal


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


async def test_fixed_appends_to_one_stream_chain_in_one_batch_and_a_build_waits_for_them(
    store: EventStore,
) -> None:
    journal = Journal(store)
    await journal.load()
    g = gid("gc")
    await journal.append(f"group-{g}", reserved(g))
    seen: list[int] = []

    def after_them(ledger: LedgerState) -> list[Event]:
        seen.append(len(ledger.groups[g].siblings))
        return [minted(g, 7)]

    batches = journal.batches
    await asyncio.gather(
        *(journal.append(f"group-{g}", [minted(g, i)]) for i in range(1, 6)),
        journal.append(f"group-{g}", after_them),
    )
    # Five fixed appends went out together (the siblings' dispatches of a group); the build could
    # not join them, since it must see them folded, and did see all five.
    assert journal.batches - batches == 2
    assert seen == [6]
    assert [e.stream_version for e in store.read_stream(f"group-{g}")] == list(range(8))
    assert [e.data["generation_index"] for e in store.read_stream(f"group-{g}", from_version=2)] == [
        1, 2, 3, 4, 5, 7
    ]  # fmt: skip
    assert store.verify_chain() is None
