"""A subscription's poll reads one page, whatever the length of the tail behind it (a subscriber
catching up on a long log reads it once, not once per poll)."""

from __future__ import annotations

from typing import Any

from eventstore import open_store
from eventstore.events import AttemptMinted


def test_a_poll_reads_one_page_of_a_long_tail(store_url: str) -> None:
    store = open_store(store_url)
    try:
        store.append(
            "group-p1", [AttemptMinted(rollout_id=f"p1_g{i}", generation_index=i) for i in range(50)]
        )
        reads: list[int] = []
        fetch = store.recorder.fetch_records

        def counted(*args: Any, **kwargs: Any) -> Any:  # the real read, counted
            found = fetch(*args, **kwargs)
            reads.append(len(found))
            return found

        store.recorder.fetch_records = counted  # type: ignore[method-assign]
        sub = store.subscribe("tailer", from_position=0)
        pages = []
        while batch := sub.poll(max_events=10):
            pages.append([e.position for e in batch])
        assert pages == [list(range(n, n + 10)) for n in range(1, 51, 10)]
        # One read a page, and the one that found nothing more: 50 rows read in all, not 150.
        assert reads == [10] * 5 + [0]
    finally:
        store.close()
