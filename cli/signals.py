"""SIGINT and SIGTERM alike: what `timeout`, Slurm and Kubernetes send first is treated as Ctrl-C.

A long-running asyncio command runs through `run_until_stopped`: the first signal sets the `stop`
event it is given, and the command winds down on its own terms (it decides or aborts what it opened,
stops its children, and says in one line what it left); a second signal cancels it at once (its
`finally` blocks still stop its children).  Either way it exits with the status a shell gives a
command that signal ended (128 + its number: 130 for SIGINT, 143 for SIGTERM).
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable, Coroutine
from typing import Any, Final, TypeVar

_T = TypeVar("_T")
STOP_SIGNALS: Final = (signal.SIGINT, signal.SIGTERM)


class StopRequest(asyncio.Event):
    """Set by the first SIGINT or SIGTERM; `signum` says which."""

    def __init__(self) -> None:
        super().__init__()
        self.signum: int | None = None

    @property
    def exit_code(self) -> int:
        """What a shell reports for a command that this signal ended: 128 + its number."""
        return 128 + (self.signum if self.signum is not None else signal.SIGINT)


class Interrupted(Exception):
    """The command was cancelled at once by a second signal."""

    def __init__(self, exit_code: int) -> None:
        super().__init__(f"stopped at once (exit status {exit_code})")
        self.exit_code = exit_code


def run_until_stopped(main: Callable[[StopRequest], Coroutine[Any, Any, _T]]) -> _T:
    """`main(stop)` on the trainer's event loop, the first SIGINT or SIGTERM setting `stop` and a
    second cancelling `main` (`Interrupted`).  Returns what `main` returns, or raises what it raises,
    after a stop as otherwise (it may report what it left)."""
    from trainer.eventloop import run_async

    stop = StopRequest()

    async def guarded() -> _T:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None

        def on_signal(signum: int) -> None:
            if stop.is_set():
                task.cancel()
                return
            stop.signum = signum
            stop.set()

        for sig in STOP_SIGNALS:
            loop.add_signal_handler(sig, on_signal, sig)
        try:
            return await main(stop)
        finally:
            for sig in STOP_SIGNALS:
                loop.remove_signal_handler(sig)

    try:
        return run_async(guarded())
    except asyncio.CancelledError:
        if not stop.is_set():
            raise
        raise Interrupted(stop.exit_code) from None
