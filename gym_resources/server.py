"""Serving the reference resources server: in the foreground (`ledger gym resources`) or in a thread."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import uvicorn
from starlette.types import ASGIApp

from gym_resources.app import create_app
from participant.threads import STOP_TIMEOUT_S, stop_thread


def _config(state_dir: Path, host: str, port: int, log_level: str) -> uvicorn.Config:
    return uvicorn.Config(
        create_app(state_dir), host=host, port=port, log_level=log_level, access_log=False, lifespan="on"
    )


def run_server(state_dir: Path, host: str, port: int, log_level: str = "info") -> int:
    server = uvicorn.Server(_config(state_dir, host, port, log_level))
    server.run()
    return 0 if server.started else 1


@dataclass
class ThreadResources:
    server: uvicorn.Server
    thread: threading.Thread
    host: str
    port: int

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        self.server.should_exit = True
        stop_thread(self.thread, "the resources server", timeout_s)


@contextmanager
def serve_in_thread(
    state_dir: Path,
    host: str = "127.0.0.1",
    startup_timeout_s: float = 30.0,
    wrap: Callable[[ASGIApp], ASGIApp] | None = None,
) -> Iterator[ThreadResources]:
    """Serves the resources over `state_dir` on a free loopback port (`wrap`: a test's layer around
    the app, e.g. a gate); stops on exit."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    sock.listen(256)
    port = sock.getsockname()[1]
    server = uvicorn.Server(_config(state_dir, host, port, "warning"))
    if wrap is not None:
        server.config.app = wrap(cast(ASGIApp, server.config.app))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="resources", daemon=True)
    thread.start()
    served = ThreadResources(server, thread, host, port)
    deadline = time.monotonic() + startup_timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            sock.close()
            raise RuntimeError("the resources server failed to start")
        time.sleep(0.005)
    try:
        yield served
    finally:
        served.stop()
        sock.close()
