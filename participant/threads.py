"""A Gym server's app served by uvicorn in a thread of this process (the reference agent's and the
resources server's `serve_in_thread`, for tests and one-process runs): how long its stop may take,
and, where it does not end in that time, where the thread is.

A stop takes 0.2 s here (uvicorn's 0.1 s tick, then its 0.1 s pause for connections to close), and at
most the server's graceful-shutdown time more for calls still open; a machine with every core busy
can stall a thread for seconds beyond that, and a stop missed there would fail a test that proved
nothing about the server (a CI run did, at 10 s)."""

from __future__ import annotations

import sys
import threading
import traceback
from pathlib import Path
from typing import Final

STOP_TIMEOUT_S: Final = 60.0


def stop_thread(thread: threading.Thread, what: str, timeout_s: float) -> None:
    """Waits up to `timeout_s` for `thread` (its server told to exit) to end; RuntimeError naming
    `what` and the frames the thread is in when it has not."""
    thread.join(timeout_s)
    if thread.is_alive():
        raise RuntimeError(
            f"{what} did not stop within {timeout_s} s; its thread was at: {where_thread_is(thread)}"
        )


def where_thread_is(thread: threading.Thread, frames: int = 6) -> str:
    """The innermost `frames` frames of a live thread's stack, on one line, innermost first."""
    frame = sys._current_frames().get(thread.ident or -1)
    if frame is None:
        return "(ended)"
    stack = traceback.extract_stack(frame)[-frames:]
    return " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(stack))
