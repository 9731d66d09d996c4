"""Fewer garbage-collector passes while a replay builds millions of objects.

CPython runs a generation-0 collection every 700 container allocations, and every so often a full
one over every live object.  A replay allocates a model per event and keeps growing projection
states: the collector then ran more than the decoding itself (measured in benchmarks/eventstore.py:
decoding alone went from 77k to 148k-183k events/s with the collector off).  While any replay runs
the generation-0 threshold is raised, not switched off, so reference cycles are still collected,
just in larger batches; the last replay to finish puts the thresholds back.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

# Container allocations between generation-0 collections during a replay (CPython's default: 700).
# A collection walks the young objects still alive, i.e. about the page in hand, whatever the
# threshold; so the fewer collections the less walking: typed replay 240k -> 267k events/s going
# from 200,000 to 1,000,000 (benchmarks/eventstore.py, one run side by side).
BULK_THRESHOLD0 = 1_000_000

_lock = threading.Lock()
_active = 0
_saved: tuple[int, int, int] | None = None


@contextmanager
def fewer_collections() -> Iterator[None]:
    """Raises the collector's generation-0 threshold for the duration (nestable, thread-safe)."""
    global _active, _saved
    with _lock:
        if _active == 0:
            _saved = gc.get_threshold()
            gc.set_threshold(max(BULK_THRESHOLD0, _saved[0]), *_saved[1:])
        _active += 1
    try:
        yield
    finally:
        with _lock:
            _active -= 1
            if _active == 0 and _saved is not None:
                gc.set_threshold(*_saved)
                _saved = None
