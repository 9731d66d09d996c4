"""The event loop the trainer-side processes run on: uvloop where it is installed, else asyncio's.

A coordinator's event loop does little but socket I/O to the agents and hand-offs to the journal's
writer thread; uvloop does both in C.  Measured in the soak (`benchmarks/soak.py`): the trainer's
CPU per sealed rollout fell from 1.83-1.87 ms to 1.60-1.75 ms.  The agents (uvicorn) already pick
uvloop when it is installed.

`run_async` also sets the process's cyclic garbage collector for a trainer's work
(`protocol.collector.tune_gc`, the agent's setting too): what is alive when the loop starts (modules,
classes, the process's setup) is frozen out of every later collection, and the first generation is
collected every 10,000 allocations instead of every 700.  A trainer makes little cyclic garbage (a
200-group soak collects a few thousand objects in all) while its full collections walked every
object of the process: measured in the soak at 9k tokens, the collector's CPU 0.53 s -> 0.16 s (gc
callbacks), 0.1-0.2 ms per sealed rollout.

It also pins glibc's mmap threshold (`tune_malloc`): a buffer of `MMAP_THRESHOLD` bytes or more
(a reply, a token record, a payload batch) is mapped for itself and returned to the system when
freed.  Left dynamic, glibc raises the threshold to the size of the first such buffer freed, and
from then on those buffers come from the heap, whose high-water stays resident: the trainer's RSS
stepped up with each burst of intake while its Python objects stayed flat (docs/performance.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import platform
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from protocol.collector import tune_gc

_T = TypeVar("_T")


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        import uvloop
    except ImportError:  # not on every platform: asyncio's own loop does the same, more slowly
        return None
    return uvloop.new_event_loop


# Bytes from which glibc maps an allocation for itself (and unmaps it when freed); mallopt's own.
MMAP_THRESHOLD = 64 * 1024
_M_MMAP_THRESHOLD = -3


def tune_malloc() -> bool:
    """Pins glibc's mmap threshold at `MMAP_THRESHOLD` (which also stops it rising).  False, and
    nothing set, on another C library or where MALLOC_MMAP_THRESHOLD_ already names one."""
    if platform.libc_ver()[0] != "glibc" or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))


def run_async(main: Coroutine[Any, Any, _T]) -> _T:
    """`asyncio.run(main)` on the fastest loop available, the collector set by `tune_gc`, glibc's
    mmap threshold by `tune_malloc`."""
    tune_gc()
    tune_malloc()
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        return runner.run(main)


async def wait_at_most(waiting: Awaitable[object], timeout_s: float) -> None:
    """Awaits `waiting` for at most `timeout_s`; running out of time is not an error.

    `asyncio.timeout`, not `wait_for`: Python 3.11's `wait_for` can swallow a cancellation that
    arrives as the wait completes, and a cancelled loop around it would keep looping."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout_s):
            await waiting
