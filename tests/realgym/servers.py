"""`serve_app`: an app of the test's own served in a thread (the real Gym's servers themselves are
started by `benchmarks.realgym.servers`, which the benchmark against the Gym's collector shares)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Final

import uvicorn
from starlette.types import ASGIApp

HERE: Final = Path(__file__).resolve().parent
STOP_TIMEOUT_S: Final = 20.0


@contextmanager
def serve_app(app: ASGIApp, startup_timeout_s: float = 30.0) -> Iterator[str]:
    """`app` served by uvicorn in a thread on a free loopback port; its URL; stopped on exit."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout_s
    try:
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test's app did not start")
            time.sleep(0.01)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(STOP_TIMEOUT_S)
        sock.close()
