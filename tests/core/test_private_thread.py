"""`trainer.private_thread.PrivateThread`: one concern's blocking calls in a thread of its own, one
at a time and in the order made; answers and exceptions delivered to their awaiters; the caller's
context seen; a cancelled awaiter costs the next call nothing; the thread ends when idle and comes
back for the next call; where no thread can start, the call runs in the caller's thread; a forked
child starts its own."""

from __future__ import annotations

import asyncio
import contextvars
import functools
import os
import select
import threading
from typing import Any
from unittest import mock

import pytest

from trainer import private_thread
from trainer.private_thread import PrivateThread

_WHO: contextvars.ContextVar[str] = contextvars.ContextVar("_WHO", default="nobody")


async def test_calls_run_one_at_a_time_in_order_in_one_thread_of_their_own() -> None:
    worker = PrivateThread("test-worker")
    seen: list[tuple[int, str]] = []
    running = threading.Semaphore(1)  # a second call running alongside the first would fail to take it

    def call(n: int) -> int:
        assert running.acquire(blocking=False), "two calls at once"
        try:
            seen.append((n, threading.current_thread().name))
            return n * n
        finally:
            running.release()

    answers = await asyncio.gather(*(worker.run(functools.partial(call, n)) for n in range(200)))
    assert answers == [n * n for n in range(200)]
    assert [n for n, _ in seen] == list(range(200))
    assert {name for _, name in seen} == {"test-worker"}


async def test_an_exception_reaches_its_awaiter_and_the_thread_serves_on() -> None:
    worker = PrivateThread("test-worker")

    def fails() -> None:
        raise KeyError("gone")

    with pytest.raises(KeyError, match="gone"):
        await worker.run(fails)
    assert await worker.run(lambda: 7) == 7


async def test_the_call_sees_the_callers_context() -> None:
    worker = PrivateThread("test-worker")
    _WHO.set("the trainer")
    assert await worker.run(_WHO.get) == "the trainer"


async def test_a_cancelled_awaiter_leaves_the_next_call_served() -> None:
    worker = PrivateThread("test-worker")
    gate, done = threading.Event(), threading.Event()

    def blocked() -> str:
        gate.wait(10)
        done.set()
        return "late"

    waiting = asyncio.ensure_future(worker.run(blocked))
    await asyncio.sleep(0)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    gate.set()
    assert await worker.run(lambda: "next") == "next"  # after the cancelled call, in order
    assert done.is_set()


async def test_the_thread_ends_when_idle_and_comes_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(private_thread, "IDLE_S", 0.05)
    worker = PrivateThread("test-worker")
    first = await worker.run(threading.get_ident)
    gone = threading.Event()
    for _ in range(200):
        if worker._thread is None:
            gone.set()
            break
        await asyncio.sleep(0.02)
    assert gone.is_set(), "the idle thread did not end"
    assert not any(t.ident == first and t.is_alive() for t in threading.enumerate())
    assert await worker.run(lambda: threading.current_thread().name) == "test-worker"


async def test_with_no_thread_to_start_the_call_runs_in_the_callers_thread() -> None:
    worker = PrivateThread("test-worker")
    refused = RuntimeError("can't create new thread at interpreter shutdown")
    with mock.patch.object(threading.Thread, "start", side_effect=refused):
        here: Any = await worker.run(threading.get_ident)
    assert here == threading.get_ident()
    assert await worker.run(lambda: threading.current_thread().name) == "test-worker"


async def test_a_forked_child_gets_its_own_thread() -> None:
    """The parent's thread is not in a forked child: the child's first call starts the child's own
    (it does not wait on a queue that no thread of the child reads)."""
    worker = PrivateThread("test-worker")
    assert await worker.run(os.getpid) == os.getpid()  # the parent's thread is up
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: one call through the same worker, with a deadline of its own
        try:
            try:
                answer = str(asyncio.run(asyncio.wait_for(worker.run(os.getpid), 20)))
            except TimeoutError:
                answer = "no answer within 20 s"
            os.write(write, answer.encode())
        finally:
            os._exit(0)
    os.close(write)
    try:
        ready, _, _ = select.select([read], [], [], 60)
        said = os.read(read, 100).decode() if ready else "the child said nothing within 60 s"
    finally:
        os.close(read)
        os.waitpid(pid, 0)
    assert said == str(pid)
    assert await worker.run(os.getpid) == os.getpid()  # the parent's own serves on
