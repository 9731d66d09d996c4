"""`ledger console`'s server: bind first (port 0 picks a free port), say where, then serve until
SIGINT or SIGTERM, which end it cleanly (exit status 0): open pages are closed, checks still running
are ended, the follower stops and the store is closed by the caller."""

from __future__ import annotations

import signal
import socket
from collections.abc import Callable
from typing import Final

import uvicorn

from console._app import ConsoleConfig, create_app
from eventstore import EventStore

DEFAULT_HOST: Final = "127.0.0.1"
DEFAULT_PORT: Final = 8080
CONSOLE_TOKEN_ENV: Final = "LEDGER_CONSOLE_TOKEN"
# Open pages (server-sent event streams) are cut after this long when the console stops.
GRACEFUL_S: Final = 2


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    return sock


def serve(
    store: EventStore, config: ConsoleConfig, host: str, port: int, announce: Callable[[str], None]
) -> int:
    """Serves the console on `host:port` until a stop signal; `announce` is told its URL once bound."""
    guard, _ = create_app(store, config)
    sock = bind(host, port)
    bound = sock.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(
            guard,
            log_level="warning",
            access_log=False,  # a URL may carry an id typed by someone; nothing of it goes to the log
            lifespan="on",
            timeout_graceful_shutdown=GRACEFUL_S,
            proxy_headers=False,
        )
    )
    # Before uvicorn takes the signals over (and after it gives them back: it raises a stop signal
    # again once it has shut down), a stop signal asks the server to stop: one that comes while the
    # console starts is not lost, and the one raised again ends in a normal return (exit status 0).
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: setattr(server, "should_exit", True))
    shown = f"[{host}]" if ":" in host else host
    announce(f"http://{shown}:{bound}/")
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    return 0 if server.started else 1


__all__ = ["CONSOLE_TOKEN_ENV", "DEFAULT_HOST", "DEFAULT_PORT", "bind", "serve"]
