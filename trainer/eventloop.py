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

It also pins glibc's mmap threshold (`tune_malloc`): a buffer of `MMAP_THRESHOLD` (1 MiB) or more
(a payload batch, a large reply) is mapped for itself and returned to the system when freed.  Left
dynamic, glibc raises the threshold to the size of the first such buffer freed, and from then on
those buffers come from the heap, whose high-water stays resident: the trainer's RSS stepped up with
each burst of intake while its Python objects stayed flat (docs/performance.md).  The pin was 64 KiB
first; that mapped and faulted in afresh every HTTP body, token record and driver copy of an attempt
(page faults were 35 % of the trainer's CPU at 64k tokens, `munmap` 9 %).  Under 1 MiB they now come
from the heap, and the trim threshold (`TRIM_THRESHOLD`, 16 MiB) keeps free() from shrinking the
heap's top after every burst only for the next to grow it again.

And it trims the heap every `TRIM_EVERY_S` (`trim_heap`: glibc's `malloc_trim(0)`).  A burst of
intake frees thousands of buffers under the threshold (a reply's canonical bytes, its output text,
the JSON parser's buffers) at once; glibc keeps the freed pages inside the heap (it gives back only
its top): sampled with `mallinfo2` over a 2,000-group soak at 9k, the bytes in use fell back to
26-30 MiB between bursts while the heap's free bytes rose from about 10 to 40-65 MiB, so RSS grew
with fragmentation, not with anything held (docs/performance.md).  A trim walks the heap and
returns those pages, off the attempts' path.
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


# Bytes from which glibc maps an allocation for itself (and unmaps it when freed), and the free top
# of the heap past which free() gives it back; mallopt's own parameter numbers.
MMAP_THRESHOLD = 1024 * 1024
TRIM_THRESHOLD = 16 * 1024 * 1024
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def tune_malloc() -> bool:
    """Pins glibc's mmap threshold at `MMAP_THRESHOLD` (which also stops it rising) and its trim
    threshold at `TRIM_THRESHOLD`.  Each is left to the environment where its variable
    (MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_) names one; False, and nothing set, on another C
    library or where the environment names both."""
    if platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    wanted = {
        _M_MMAP_THRESHOLD: ("MALLOC_MMAP_THRESHOLD_", MMAP_THRESHOLD),
        _M_TRIM_THRESHOLD: ("MALLOC_TRIM_THRESHOLD_", TRIM_THRESHOLD),
    }
    set_here = [mallopt(param, value) for param, (name, value) in wanted.items() if name not in os.environ]
    return bool(set_here) and all(set_here)


# How often the loop gives the heap's free pages back (`trim_heap`): a timer, off every attempt's path.
TRIM_EVERY_S = 2.0
_trims = 0


def _malloc_trim() -> Callable[[int], int] | None:
    if platform.libc_ver()[0] != "glibc":
        return None
    try:
        trim: Callable[[int], int] = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int  # type: ignore[attr-defined]
    return trim


_TRIM = _malloc_trim()


def trim_heap() -> bool:
    """glibc's `malloc_trim(0)`: the free pages inside the heap (not only its top) go back to the
    system.  True if any did; False, and nothing done, on another C library."""
    global _trims
    if _TRIM is None:
        return False
    _trims += 1
    return bool(_TRIM(0))


def heap_trims() -> int:
    """How many times this process trimmed its heap (`trim_heap`)."""
    return _trims


async def _trim_heap_every(period_s: float) -> None:
    while True:
        await asyncio.sleep(period_s)
        trim_heap()


async def _trimming(main: Coroutine[Any, Any, _T], period_s: float) -> _T:
    trimmer = asyncio.create_task(_trim_heap_every(period_s), name="heap-trim")
    try:
        return await main
    finally:
        trimmer.cancel()


def run_async(main: Coroutine[Any, Any, _T], *, trim_every_s: float = TRIM_EVERY_S) -> _T:
    """`asyncio.run(main)` on the fastest loop available, the collector set by `tune_gc`, glibc's
    mmap threshold by `tune_malloc`, and the heap trimmed every `trim_every_s` (`trim_heap`)."""
    tune_gc()
    tune_malloc()
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        return runner.run(_trimming(main, trim_every_s))


async def wait_at_most(waiting: Awaitable[object], timeout_s: float) -> None:
    """Awaits `waiting` for at most `timeout_s`; running out of time is not an error.

    `asyncio.timeout`, not `wait_for`: Python 3.11's `wait_for` can swallow a cancellation that
    arrives as the wait completes, and a cancelled loop around it would keep looping."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout_s):
            await waiting
