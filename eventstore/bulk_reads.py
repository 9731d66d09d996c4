"""Interpreter settings while bulk reads run: fewer garbage-collector passes, prompter GIL hand-offs.

Both are process-wide, so each is changed while at least one replay or read-ahead needs it and put
back by the last one to finish (nestable, thread-safe; `WhileAny`).

The collector: CPython runs a generation-0 collection every 700 container allocations, and every so
often a full one over every live object.  A replay allocates a model per event and keeps growing
projection states: the collector then ran more than the decoding itself (measured in
benchmarks/eventstore.py: decoding alone went from 77k to 148k-183k events/s with the collector
off).  While any replay runs the generation-0 threshold is raised, not switched off, so reference
cycles are still collected, just in larger batches.

The switch interval: a read-ahead thread (eventstore/read_ahead.py) waits for the server without
the GIL, but needs it back for a moment each time data arrives, and the decoding thread holds it for
up to the interpreter's switch interval (5 ms) before it must let go: the reader spent most of a
page's transfer waiting.  While any read-ahead runs the interval is at most 1 ms: typed replay of
1,000,000 events 296k -> 319k events/s (three alternations in one process, 5 ms against 1 ms;
0.2 ms was slower again, 305k).
"""

from __future__ import annotations

import gc
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Generic, TypeVar

T = TypeVar("T")

# Container allocations between generation-0 collections during a replay (CPython's default: 700).
# A collection walks the young objects still alive, i.e. about the page in hand, whatever the
# threshold; so the fewer collections the less walking: typed replay 240k -> 267k events/s going
# from 200,000 to 1,000,000 (benchmarks/eventstore.py, one run side by side).
BULK_THRESHOLD0 = 1_000_000
# The interpreter's switch interval while a read-ahead runs (CPython's default: 0.005 s).
READ_AHEAD_SWITCH_S = 0.001


class WhileAny(Generic[T]):
    """A process-wide setting changed while at least one holder is inside `held()`."""

    def __init__(self, get: Callable[[], T], put: Callable[[T], None], during: Callable[[T], T]) -> None:
        self._get, self._put, self._during = get, put, during
        self._lock = threading.Lock()
        self._active = 0
        self._saved: T | None = None

    @contextmanager
    def held(self) -> Iterator[None]:
        with self._lock:
            if self._active == 0:
                self._saved = self._get()
                self._put(self._during(self._saved))
            self._active += 1
        try:
            yield
        finally:
            with self._lock:
                self._active -= 1
                if self._active == 0 and self._saved is not None:
                    self._put(self._saved)
                    self._saved = None


_COLLECTOR = WhileAny(
    gc.get_threshold,
    lambda t: gc.set_threshold(*t),
    lambda saved: (max(BULK_THRESHOLD0, saved[0]), *saved[1:]),
)
_SWITCHES = WhileAny(sys.getswitchinterval, sys.setswitchinterval, lambda s: min(s, READ_AHEAD_SWITCH_S))


def fewer_collections() -> AbstractContextManager[None]:
    """Raises the collector's generation-0 threshold for the duration (nestable, thread-safe)."""
    return _COLLECTOR.held()


def prompt_switches() -> AbstractContextManager[None]:
    """Lowers the interpreter's switch interval to `READ_AHEAD_SWITCH_S` for the duration."""
    return _SWITCHES.held()
