"""One concern's blocking calls, run in a thread of its own: the log's reads and writes
(`trainer.logview`), the payload store's puts and reads (`trainer.payload_io`).

`asyncio.to_thread` hands each call to the loop's shared pool: a `concurrent.futures` future chained
to an asyncio one, the pool's locks and idle-thread semaphore, and a pool thread woken per call.
Each try makes about two such calls (its batch of log rows, its batch of payloads), and at a tiny
try's few milliseconds the hand-off was a tenth of the trainer's CPU.  A private thread per concern
takes its calls off a `SimpleQueue` (C) in order and sets each answer on the loop with one
`call_soon_threadsafe`; while calls keep coming it never sleeps between them.  Its calls run one at a
time, in the order made, as the concern's own worker (Temporal's wiring: one private worker per
concern).  The thread ends after `IDLE_S` without a call and starts again on the next; where no
thread can start (the interpreter exiting, its last steps the owner's close at exit) the call runs
in the caller's thread.  Each call runs in a copy of the caller's context, as `to_thread` runs it.
A forked child starts with none of its parent's threads: every private thread there begins afresh
(its queue, its lock, no thread), so a child's first call starts its own instead of waiting on a
queue that no thread of the child reads.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import os
import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any, Final, TypeVar

_T = TypeVar("_T")

# A thread with no call for this long ends (a trainer's idle objects hold no threads).
IDLE_S: Final = 2.0


def _settle(future: asyncio.Future[Any], ok: bool, value: Any) -> None:
    if future.done():  # its awaiter was cancelled meanwhile: the answer has no taker
        return
    if ok:
        future.set_result(value)
    else:
        future.set_exception(value)


class PrivateThread:
    """The blocking calls of one concern (`name` names its thread), one at a time, in order."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._fresh()
        _EVERY.add(self)

    def _fresh(self) -> None:
        """No thread, an empty queue and a free lock (a new one, or a forked child's)."""
        self._calls: queue.SimpleQueue[tuple[Callable[[], Any], asyncio.Future[Any], Any, Any]] = (
            queue.SimpleQueue()
        )
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    async def run(self, fn: Callable[[], _T]) -> _T:
        """`fn()` in the private thread, its answer (or its exception) here."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[_T] = loop.create_future()
        context = contextvars.copy_context()
        with self._lock:
            if self._thread is None:
                thread = threading.Thread(target=self._serve, name=self._name, daemon=True)
                try:
                    thread.start()
                    self._thread = thread
                except RuntimeError:  # no new thread (the interpreter exiting): this call runs here
                    pass
            queued = self._thread is not None
            if queued:
                self._calls.put((fn, future, loop, context))
        if not queued:
            return context.run(fn)
        return await future

    def _serve(self) -> None:
        while True:
            try:
                fn, future, loop, context = self._calls.get(timeout=IDLE_S)
            except queue.Empty:
                with self._lock:  # a call put meanwhile is taken by this thread, not stranded
                    if self._calls.empty():
                        self._thread = None
                        return
                continue
            try:
                ok, value = True, context.run(fn)
            except BaseException as exc:  # delivered to the awaiting coroutine, as a pool would
                ok, value = False, exc
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody awaits the answer
                loop.call_soon_threadsafe(_settle, future, ok, value)


# Every private thread of this process, so that a forked child starts each afresh: the parent's thread
# is not in the child, and a lock the parent held at the fork would stay held there.
_EVERY: weakref.WeakSet[PrivateThread] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for worker in list(_EVERY):
        worker._fresh()


os.register_at_fork(after_in_child=_after_fork_in_child)

__all__ = ["IDLE_S", "PrivateThread"]
