"""The trainer's payload puts are group-committed: puts queued while a store call runs go in the next
call together, each caller gets exactly its own claims, and a failed call fails every put it carried."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Mapping

import pytest

from payloads import (
    InMemoryPayloadStore,
    PayloadClaim,
    PayloadPlane,
    PayloadStoreError,
    PayloadStoreUnavailable,
)
from trainer.errors import CoordinatorStopped
from trainer.payload_io import MAX_BATCH_BYTES, PayloadIO

MEDIA = "application/octet-stream"


class GatedStore(InMemoryPayloadStore):
    """Records every put_many call; the first waits for `release` (set from the test's loop), so the
    test decides what is queued behind it instead of racing the thread."""

    def __init__(self) -> None:
        super().__init__("gated")
        self.calls: list[list[str]] = []
        self.entered = threading.Event()
        self.release = threading.Event()
        self.fail_with: Exception | None = None

    def put_many(self, items: Mapping[str, bytes]) -> None:
        self.calls.append(list(items))
        if len(self.calls) == 1:
            self.entered.set()
            assert self.release.wait(30), "the test never released the first put"
        if self.fail_with is not None:
            raise self.fail_with
        super().put_many(items)


async def _queued_behind_first(
    store: GatedStore, io: PayloadIO, n: int
) -> list[asyncio.Task[list[PayloadClaim]]]:
    first = asyncio.create_task(io.put([(b"first", MEDIA)]))
    assert await asyncio.to_thread(store.entered.wait, 30)
    rest = [asyncio.create_task(io.put([(f"p{i}".encode(), MEDIA), (b"shared", MEDIA)])) for i in range(n)]
    for _ in range(3):  # every put is queued (none of them can reach the store: the writer is busy)
        await asyncio.sleep(0)
    return [first, *rest]


async def test_puts_queued_during_a_store_call_go_in_one_call_each_with_its_own_claims() -> None:
    store = GatedStore()
    io = PayloadIO(PayloadPlane(store), outage_budget_s=1.0)
    tasks = await _queued_behind_first(store, io, 8)
    store.release.set()
    claims = await asyncio.gather(*tasks)
    # One call for the first, ONE for the eight queued behind it (without batching: nine calls).
    assert len(store.calls) == 2
    assert io.put_calls == 2 and io.puts == 9
    assert [len(c) for c in claims] == [1, *[2] * 8]
    plane = PayloadPlane(store)
    for i, (own, shared) in enumerate(claims[1:]):
        assert plane.get(own) == f"p{i}".encode()  # the caller's own payload, durable, in its order
        assert plane.get(shared) == b"shared"
    assert plane.get(claims[0][0]) == b"first"


async def test_a_failed_store_call_fails_every_put_it_carried_and_the_next_put_runs() -> None:
    store = GatedStore()
    io = PayloadIO(PayloadPlane(store), outage_budget_s=1.0)
    store.fail_with = RuntimeError("a bug in the store call")
    tasks = await _queued_behind_first(store, io, 3)
    store.release.set()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert all(isinstance(r, RuntimeError) for r in results), results
    store.fail_with = None
    [claim] = await io.put([(b"after", MEDIA)])
    assert PayloadPlane(store).get(claim) == b"after"


async def test_a_put_refused_for_good_stops_every_put_once_with_one_reason() -> None:
    """A store that refuses for good (a path that is not a directory, a read-only one, a file past the
    size limit, permissions) keeps nothing more: the puts it carried and every later one get the same
    `CoordinatorStopped` naming the refusal, and `on_stop` hears it once (the coordinator stops)."""
    store = GatedStore()
    heard: list[CoordinatorStopped] = []
    io = PayloadIO(PayloadPlane(store), outage_budget_s=30.0, on_stop=heard.append)
    store.fail_with = PayloadStoreError("storing payloads under /x: Read-only file system")
    tasks = await _queued_behind_first(store, io, 3)
    store.release.set()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert len(heard) == 1 and all(r is heard[0] for r in results), results
    assert str(heard[0]) == (
        "the payload store refused to store payloads: storing payloads under /x: Read-only file system; "
        "the coordinator stopped"
    )
    store.fail_with = None
    calls = len(store.calls)
    with pytest.raises(CoordinatorStopped) as later:
        await io.put([(b"after", MEDIA)])
    assert later.value is heard[0] and len(store.calls) == calls  # refused without a store call


async def test_a_cancelled_put_is_left_out_of_the_batch_and_the_others_are_answered() -> None:
    store = GatedStore()
    io = PayloadIO(PayloadPlane(store), outage_budget_s=1.0)
    first, *rest = await _queued_behind_first(store, io, 3)
    rest[1].cancel()
    store.release.set()
    await first
    done = await asyncio.gather(*rest, return_exceptions=True)
    assert isinstance(done[1], asyncio.CancelledError)
    answered = [done[0], done[2]]
    assert [len(c) if isinstance(c, list) else c for c in answered] == [2, 2]
    assert len(store.calls) == 2 and len(store.calls[1]) == 3  # p0, shared, p2: p1 never sent


async def test_an_outage_past_the_budget_stops_every_queued_put() -> None:
    store = GatedStore()
    stops: list[CoordinatorStopped] = []
    io = PayloadIO(PayloadPlane(store), outage_budget_s=0.0, on_stop=stops.append)
    store.fail_with = PayloadStoreUnavailable("the store is away")
    tasks = await _queued_behind_first(store, io, 2)
    store.release.set()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert all(isinstance(r, CoordinatorStopped) for r in results), results
    assert len(stops) == 1
    with pytest.raises(CoordinatorStopped):
        await io.put([(b"later", MEDIA)])


async def test_a_burst_of_real_sized_payloads_is_stored_in_calls_of_bounded_bytes() -> None:
    """The trainer's memory holds what one store call carries (copied again on its way to the store):
    forty 9k-token rollouts' payloads (about 133 KB each) queued at once go in calls of at most
    MAX_BATCH_BYTES, every caller still answered with its own claims."""
    store = GatedStore()
    io = PayloadIO(PayloadPlane(store), outage_budget_s=1.0)
    first = asyncio.create_task(io.put([(b"first", MEDIA)]))
    assert await asyncio.to_thread(store.entered.wait, 30)
    size = 133_000
    assert 40 * size > MAX_BATCH_BYTES  # without the bound the burst would be one call
    burst = [asyncio.create_task(io.put([(bytes([i]) * size, MEDIA)])) for i in range(40)]
    for _ in range(3):
        await asyncio.sleep(0)
    store.release.set()
    await first
    claims = await asyncio.gather(*burst)
    sizes = [sum(len(store.get(d)) for d in call) for call in store.calls[1:]]
    assert len(sizes) >= 2 and max(sizes) <= MAX_BATCH_BYTES and sum(sizes) == 40 * size
    assert all(PayloadPlane(store).get(c) == bytes([i]) * size for i, [c] in enumerate(claims))


async def test_a_put_with_the_callers_own_claims_batches_with_the_others_and_is_stored_under_them() -> None:
    store = GatedStore()
    io = PayloadIO(PayloadPlane(store), outage_budget_s=1.0)
    first = asyncio.create_task(io.put([(b"first", MEDIA)]))
    assert await asyncio.to_thread(store.entered.wait, 30)
    own = [io.claim(b"tokens", MEDIA), io.claim(b"reply", "application/json")]
    claimed = asyncio.create_task(io.put([(b"tokens", MEDIA), (b"reply", "application/json")], claims=own))
    plain = asyncio.create_task(io.put([(b"other", MEDIA)]))
    for _ in range(3):
        await asyncio.sleep(0)
    store.release.set()
    assert await claimed == own
    [other] = await plain
    await first
    assert len(store.calls) == 2  # the claimed put and the plain one in one call
    plane = PayloadPlane(store)
    assert [plane.get(c) for c in own] == [b"tokens", b"reply"] and plane.get(other) == b"other"


async def test_claims_that_do_not_describe_their_items_are_refused_before_anything_is_stored() -> None:
    store = GatedStore()
    io = PayloadIO(PayloadPlane(store), outage_budget_s=1.0)
    with pytest.raises(ValueError, match="one claim per item"):
        await io.put([(b"abc", MEDIA)], claims=[io.claim(b"abcd", MEDIA)])
    with pytest.raises(ValueError, match="one claim per item"):
        await io.put([(b"abc", MEDIA)], claims=[io.claim(b"abc", "application/json")])
    assert store.calls == []
