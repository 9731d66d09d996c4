"""Stopping an agent served in a thread: a stop that cannot end in time says where the thread is."""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
import pytest
from starlette.types import ASGIApp, Receive, Scope, Send

from gym_agent.config import AgentConfig
from gym_agent.server import serve_in_thread


class HoldTheLoop:
    """Blocks the agent's event loop on `/hold` until the gate opens (a stall the test controls)."""

    def __init__(self, app: ASGIApp, entered: threading.Event, gate: threading.Event) -> None:
        self.app, self.entered, self.gate = app, entered, gate

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] == "/hold":
            self.entered.set()
            self.gate.wait(60)  # on purpose in the loop's thread: nothing else there can run
        await self.app(scope, receive, send)


def test_a_stop_that_misses_its_deadline_names_the_frame_it_waits_in(tmp_path: Path) -> None:
    entered, gate = threading.Event(), threading.Event()
    config = AgentConfig(name="held", state_dir=tmp_path, zero_work=True, log_level="error")
    with serve_in_thread(config, wrap=lambda app: HoldTheLoop(app, entered, gate)) as agent:
        caller = threading.Thread(
            target=lambda: httpx.get(f"{agent.url}/hold", timeout=60), name="hold-caller"
        )
        caller.start()
        assert entered.wait(30)
        try:
            with pytest.raises(RuntimeError) as missed:
                agent.stop(timeout_s=0.2)
            message = str(missed.value)
            assert message.startswith("agent held did not stop within 0.2 s; its thread was at: ")
            assert "test_thread_agent.py" in message and "__call__" in message
            assert "\n" not in message
        finally:
            gate.set()
        agent.stop()
        assert not agent.thread.is_alive()
        caller.join(60)
