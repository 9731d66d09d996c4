"""The event loop the trainer-side processes run on: uvloop where it is installed, else asyncio's.

A coordinator's event loop does little but socket I/O to the agents and hand-offs to the journal's
writer thread; uvloop does both in C.  Measured in the soak (`benchmarks/soak.py`): the trainer's
CPU per sealed rollout fell from 1.83-1.87 ms to 1.60-1.75 ms.  The agents (uvicorn) already pick
uvloop when it is installed.

`run_async` also sets the process's cyclic garbage collector for a trainer's work
(`tune_gc`): what is alive when the loop starts (modules, classes, the process's setup) is frozen out
of every later collection, and the first generation is collected every 10,000 allocations instead of
every 700.  A trainer makes little cyclic garbage (a 200-group soak collects a few thousand objects
in all) while its full collections walked every object of the process: measured in the soak at 9k
tokens, the collector's CPU 0.53 s -> 0.16 s (gc callbacks), 0.1-0.2 ms per sealed rollout.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

_T = TypeVar("_T")


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        import uvloop
    except ImportError:  # not on every platform: asyncio's own loop does the same, more slowly
        return None
    return uvloop.new_event_loop


# Allocations (minus deallocations) between two collections of the youngest generation.
GC_YOUNG_THRESHOLD = 10_000


def tune_gc() -> None:
    """Freezes what is alive now out of later collections and collects the youngest generation
    every `GC_YOUNG_THRESHOLD` allocations (the older generations' ratios are left as they are)."""
    gc.freeze()
    _, middle, oldest = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, middle, oldest)


def run_async(main: Coroutine[Any, Any, _T]) -> _T:
    """`asyncio.run(main)` on the fastest loop available, the collector set by `tune_gc`."""
    tune_gc()
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        return runner.run(main)


async def wait_at_most(waiting: Awaitable[object], timeout_s: float) -> None:
    """Awaits `waiting` for at most `timeout_s`; running out of time is not an error.

    `asyncio.timeout`, not `wait_for`: Python 3.11's `wait_for` can swallow a cancellation that
    arrives as the wait completes, and a cancelled loop around it would keep looping."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout_s):
            await waiting
