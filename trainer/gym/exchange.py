"""One call to one agent on the wire: the request's bytes, its timeouts, and its answer checked.

The client's base URL is read once here (origin, path prefix, Host and bearer headers); each call then
costs one header list and one `LeanTransport.exchange`.  httpx's transport errors become the client's
typed ones (`AgentTimeoutError`, `ConnectionLostError`, `AgentUnavailableError`), a refusal becomes its
`GymError` (`trainer.gym.refusals`), and a 200 comes back whole (headers too) for its caller to read.
"""

from __future__ import annotations

import functools
import ssl
from collections.abc import Sequence
from urllib.parse import quote

import httpx
from pydantic import BaseModel

from trainer.gym.errors import AgentTimeoutError, AgentUnavailableError, ConnectionLostError
from trainer.gym.http_types import Reply, Timeouts, origin_of
from trainer.gym.refusals import raise_refused
from trainer.gym.transport import LeanTransport

DEFAULT_CONTROL_TIMEOUT_S = 60.0
DEFAULT_CONNECT_TIMEOUT_S = 10.0


@functools.cache
def _timeouts(total_s: float | None, connect_s: float) -> Timeouts:
    connect = connect_s if total_s is None else min(total_s, connect_s)
    return Timeouts(connect=connect, read=total_s, write=total_s, pool=total_s)


@functools.cache
def _default_ssl_context() -> ssl.SSLContext:
    # Loading the CA bundle costs tens of milliseconds; one context serves every client of the process.
    return httpx.create_ssl_context()


class Exchange:
    """The wire side of one `GymClient`: what every call to its agent sends, and how long it may take.

    Raises `ValueError` for a base URL that is not http(s).  `ssl_context`: the one given, else the
    process's default for an https agent, else None; the client's pools are built with it."""

    def __init__(
        self,
        base_url: str,
        *,
        token: str | None,
        run_timeout_s: float | None,
        control_timeout_s: float,
        connect_timeout_s: float,
        ssl_context: ssl.SSLContext | None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        url = httpx.URL(self.base_url)
        if url.scheme not in ("http", "https") or not url.host:
            raise ValueError(f"agent URL {base_url!r} is not an http(s) URL")
        self._origin = origin_of(url)
        self._prefix = url.raw_path.rstrip(b"/")
        host = (
            url.raw_host
            if url.port in (None, self._origin[2])
            else url.raw_host + b":" + str(url.port).encode()
        )
        self._headers: list[tuple[bytes, bytes]] = [
            (b"Host", host),
            (b"Accept", b"application/json"),
            (b"User-Agent", b"ledger-gym-client"),
        ]
        if token is not None:
            self._headers.append((b"Authorization", f"Bearer {token}".encode()))
        self.ssl_context = (
            ssl_context if ssl_context is not None or url.scheme != "https" else _default_ssl_context()
        )
        self._run_timeouts = Timeouts(connect_timeout_s, run_timeout_s, run_timeout_s, run_timeout_s)
        self._control_timeouts = _timeouts(control_timeout_s, connect_timeout_s)

    def timeouts(self, timeout_s: float | None, *, run_pool: bool) -> Timeouts:
        """A call's own `timeout_s` where it has one, else its pool's default (the run pool's: only
        the connect is bounded; the control pools': `control_timeout_s`)."""
        if timeout_s is not None:
            return _timeouts(timeout_s, DEFAULT_CONNECT_TIMEOUT_S)
        return self._run_timeouts if run_pool else self._control_timeouts

    async def call(
        self,
        pool: LeanTransport,
        method: str,
        path: str,
        *,
        body: BaseModel | None,
        timeouts: Timeouts,
        extra_headers: Sequence[tuple[bytes, bytes]],
    ) -> Reply:
        """One call; returns a 200 reply whole (headers too), raises a typed error otherwise."""
        what = f"{method} {self.base_url}{path}"
        content = b"" if body is None else body.model_dump_json(by_alias=True).encode()
        # An extra header replaces the base one of its name (an agent reads the first Accept it gets).
        replaced = {name.lower() for name, _ in extra_headers}
        headers = [h for h in self._headers if h[0].lower() not in replaced] if replaced else [*self._headers]
        headers += [*extra_headers, (b"Content-Length", str(len(content)).encode())]
        if body is not None:
            headers.append((b"Content-Type", b"application/json"))
        target = self._prefix + quote(path, safe="/").encode()
        try:
            reply = await pool.exchange(method, self._origin, target, headers, content, timeouts)
        except httpx.TimeoutException as exc:
            raise AgentTimeoutError(f"{what}: timed out ({type(exc).__name__})") from exc
        except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as exc:
            raise ConnectionLostError(f"{what}: connection lost before a complete reply ({exc})") from exc
        except httpx.TransportError as exc:
            raise AgentUnavailableError(f"{what}: agent unreachable ({type(exc).__name__}: {exc})") from exc
        if reply.status == 200:
            return reply  # its body parsed and validated in one pass by its reader (`answers.parse`)
        raise_refused(what, reply)
