"""The event loop the trainer-side processes run on: uvloop where it is installed, else asyncio's.

A coordinator's event loop does little but socket I/O to the agents and hand-offs to the journal's
writer thread; uvloop does both in C.  Measured in the soak (`benchmarks/soak.py`): the trainer's
CPU per sealed rollout fell from 1.83-1.87 ms to 1.60-1.75 ms.  The agents (uvicorn) already pick
uvloop when it is installed.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

_T = TypeVar("_T")


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        import uvloop
    except ImportError:  # not on every platform: asyncio's own loop does the same, more slowly
        return None
    return uvloop.new_event_loop


def run_async(main: Coroutine[Any, Any, _T]) -> _T:
    """`asyncio.run(main)` on the fastest loop available."""
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        return runner.run(main)


async def wait_at_most(waiting: Awaitable[object], timeout_s: float) -> None:
    """Awaits `waiting` for at most `timeout_s`; running out of time is not an error.

    `asyncio.timeout`, not `wait_for`: Python 3.11's `wait_for` can swallow a cancellation that
    arrives as the wait completes, and a cancelled loop around it would keep looping."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout_s):
            await waiting
