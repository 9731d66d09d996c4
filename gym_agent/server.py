"""Running an agent: in the foreground (the CLI, the subprocess launcher) or in a thread (fast tests)."""

from __future__ import annotations

import logging
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import cast

import uvicorn
from starlette.types import ASGIApp

from gym_agent.app import create_app
from gym_agent.config import AgentConfig
from participant import ExecutionRegistry
from participant.threads import STOP_TIMEOUT_S, stop_thread
from protocol.collector import tune_gc
from protocol.logsafety import install_log_masking

log = logging.getLogger("gym_agent")


class AgentServer(uvicorn.Server):
    """uvicorn, plus: stop the runs first, so open /run calls answer at once instead of holding shutdown."""

    def __init__(self, config: uvicorn.Config, registry: ExecutionRegistry) -> None:
        super().__init__(config)
        self.registry = registry

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.registry.close()
        await super().shutdown(sockets=sockets)


def build_server(config: AgentConfig) -> AgentServer:
    """Builds the server (not started); mounting the participant takes this start's identity."""
    app, registry = create_app(config)
    uv_config = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        log_level=config.log_level,
        access_log=config.access_log,
        lifespan="on",
        timeout_graceful_shutdown=max(1, round(config.graceful_shutdown_s)),
        # Many long /run calls stay open at once; keep-alive idles are cheap.
        backlog=4096,
        # The agent reads no client address (its trainer is named by a header, its callers are not
        # told apart by address): uvicorn's X-Forwarded-* middleware would only check every request's
        # peer against its trusted list (2.5 % of an agent's CPU in a 9k soak, py-spy).
        proxy_headers=False,
    )
    log.info(
        "agent %s starting, execution_generation %d, incarnation %s",
        config.name,
        registry.generation,
        registry.incarnation,
    )
    return AgentServer(uv_config, registry)


def run_server(config: AgentConfig) -> int:
    """Serves until SIGTERM/SIGINT; returns the exit status (0 after a clean stop)."""
    import torch

    torch.set_num_threads(config.model_threads)
    install_log_masking()
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    server = build_server(config)
    tune_gc()
    # uvicorn re-raises the stop signal after its graceful shutdown; a no-op handler turns that into a
    # normal return, so a SIGTERM'd agent exits with status 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    server.run()
    return 0 if server.started else 1


@dataclass
class ThreadAgent:
    """An agent served by uvicorn in a background thread of this process (same loopback HTTP)."""

    config: AgentConfig
    server: AgentServer
    thread: threading.Thread
    port: int

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.port}"

    @property
    def registry(self) -> ExecutionRegistry:
        return self.server.registry

    @property
    def generation(self) -> int:
        return self.server.registry.generation

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        self.server.should_exit = True
        stop_thread(self.thread, f"agent {self.config.name}", timeout_s)


@contextmanager
def serve_in_thread(
    config: AgentConfig,
    startup_timeout_s: float = 30.0,
    wrap: Callable[[ASGIApp], ASGIApp] | None = None,
) -> Iterator[ThreadAgent]:
    """Serves `config` in a thread on a socket bound here (port 0 picks a free one); stops on exit.

    `crash_after` faults end the whole process, so crash tests use `gym_agent.launcher.AgentProcess`.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((config.host, config.port))
    sock.listen(4096)
    port = sock.getsockname()[1]
    config = config.model_copy(update={"port": port})
    server = build_server(config)
    if wrap is not None:  # e.g. a test's hostile layer around the real agent
        server.config.app = wrap(cast(ASGIApp, server.config.app))
    thread = threading.Thread(
        target=server.run, kwargs={"sockets": [sock]}, name=f"agent-{config.name}", daemon=True
    )
    thread.start()
    agent = ThreadAgent(config=config, server=server, thread=thread, port=port)
    deadline = time.monotonic() + startup_timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            sock.close()
            raise RuntimeError(f"agent {config.name} failed to start")
        time.sleep(0.005)
    try:
        yield agent
    finally:
        agent.stop()
        sock.close()
