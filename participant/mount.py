"""`mount_participant(app, agent_name=..., state_dir=...)`: the whole participant side onto an existing
FastAPI Gym agent, in one call, without changing the agent's code.

The call adds one ASGI middleware in front of the agent.  It answers the participant routes itself
(their own FastAPI app, behind the bearer-token and body-size guard) and sends every other path to
the agent unchanged.  A `POST /run` goes through the execution registry: a new try is run by calling
the agent's own `/run` in-process (the agent sees exactly the row it was sent), a try already known is
joined or replayed, an adopt-only call never starts one.  The agent's reply is kept with the try's
identity filled in, and its token records are read off the reply (`protocol.tokens`).

    app = SimpleAgent(...).setup_webserver()          # any FastAPI app with a POST /run
    mount_participant(app, agent_name="simple_agent", state_dir=Path("/var/lib/gym/simple_agent"))
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal

from fastapi import FastAPI
from pydantic import ValidationError
from pydantic_core import from_json
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from participant.continuations import ContinuationStore
from participant.direct import DirectRoutes
from participant.errors import RunnerFailed
from participant.executions import ExecutionRegistry, Hooks, Restorer, Runner, RunSession
from participant.generation import next_identity
from participant.guard import GuardMiddleware, replayed
from participant.replies import ParsedReply
from participant.routes import Deliver, is_participant_path, participant_routes
from payloads._store import PayloadStore
from protocol.routes import loads_holding_routes
from protocol.token_codec import reply_output_of
from protocol.wire import MAX_BODY_BYTES, RunReply, RunRequest, gym_reply, validation_line

RUN_PATH: Final = "/run"
# What a call the participant makes to the agent's own /run keeps of the request that started it.
_SCOPE_KEYS: Final = ("asgi", "http_version", "scheme", "server", "client", "root_path", "app", "state")


class AgentRunError(RunnerFailed):
    """The agent's own `/run` answered something other than a 200 reply: the try failed."""


async def _never_disconnects() -> Message:
    """What a `/run` driven from inside the agent receives after its body: never a disconnect (the try
    runs until it finishes or is retired)."""
    await asyncio.Event().wait()
    raise AssertionError("unreachable")


def agent_body_json(raw: bytes) -> Any:
    """The JSON of the agent's own `/run` body; ValueError where it is none.  pydantic's parser (jiter,
    in Rust): json's values (integers past 64 bits exact, NaN read), about 3x faster on a reply
    carrying its calls' token arrays (benchmarks/gym_reply.py).  A MoE reply's router choices are held
    as their text (`protocol.routes`), as the trainer holds them: never 16,000 small lists at 9k
    tokens, parsed, walked by every collection while the try waits for its ACK, and freed after it."""
    return loads_holding_routes(raw, _from_json, reply_output_of)


def _from_json(text: bytes | bytearray | memoryview) -> Any:
    """pydantic's parse of `text` (a view taken as its bytes: jiter reads no view)."""
    return from_json(text.tobytes() if isinstance(text, memoryview) else text)


class AsgiRunner:
    """Runs a try through the agent's own `POST /run`, in-process (no socket, no second server)."""

    def __init__(self) -> None:
        self.inner: ASGIApp | None = None
        self._template: dict[str, Any] = {}

    def remember(self, scope: Scope) -> None:
        self._template = {k: scope[k] for k in _SCOPE_KEYS if k in scope}

    async def __call__(self, request: RunRequest, session: RunSession) -> RunReply:
        if self.inner is None:
            raise RuntimeError("the participant middleware was never built")
        body = request.model_dump_json(by_alias=True, exclude_unset=True).encode()
        scope: dict[str, Any] = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "scheme": "http",
            "root_path": "",
            **self._template,
            "method": "POST",
            "path": RUN_PATH,
            "raw_path": RUN_PATH.encode(),
            "query_string": b"",
            "headers": [
                (b"host", b"participant"),
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
        receive = replayed(body, _never_disconnects)

        status = 0
        chunks: list[bytes] = []

        async def send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))

        try:
            await self.inner(scope, receive, send)
        except Exception as exc:
            raise AgentRunError(f"the agent's /run raised {type(exc).__name__}: {exc}") from exc
        raw = b"".join(chunks)
        if status != 200:
            raise AgentRunError(f"the agent's /run answered HTTP {status}: {raw[:300]!r}")
        try:
            payload = agent_body_json(raw)
        except ValueError as exc:
            raise AgentRunError(f"the agent's /run answered a body that is not JSON: {raw[:200]!r}") from exc
        try:
            return gym_reply(payload, request.rollout_id, request.attempt_index, as_type=ParsedReply)
        except ValidationError as exc:
            raise AgentRunError(
                f"the agent's /run answered no reply: {validation_line(exc, 'reply')}"
            ) from None


@dataclass(frozen=True)
class Guarding:
    token: str | None
    max_body_bytes: int
    open_paths: frozenset[str]
    # "participant": the guard covers the participant's routes only (a Gym agent calls its own routes
    # without a token); "all": every path but `open_paths` (the reference agent).
    scope: Literal["participant", "all"]


class ParticipantMiddleware:
    def __init__(
        self,
        app: ASGIApp,
        *,
        registry: ExecutionRegistry,
        routes: ASGIApp,
        runner: AsgiRunner | None,
        guarding: Guarding,
    ) -> None:
        self.inner = app
        self.registry = registry
        self.runner = runner
        if runner is not None:
            runner.inner = app
        self.routes = GuardMiddleware(
            routes,
            token=guarding.token,
            max_body_bytes=guarding.max_body_bytes,
            open_paths=guarding.open_paths,
        )
        self.agent: ASGIApp = app
        if guarding.scope == "all":
            self.agent = GuardMiddleware(
                app,
                token=guarding.token,
                max_body_bytes=guarding.max_body_bytes,
                open_paths=guarding.open_paths,
            )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self.inner(scope, self._closing_on_shutdown(receive), send)
            return
        if scope["type"] != "http" or not is_participant_path(scope["path"]):
            await self.agent(scope, receive, send)
            return
        if self.runner is not None:
            self.runner.remember(scope)
        # The routes are an app of their own: give them a copy, the agent's scope stays untouched.
        await self.routes(dict(scope), receive, send)

    def _closing_on_shutdown(self, receive: Receive) -> Receive:
        async def wrapped() -> Message:
            message = await receive()
            if message["type"] == "lifespan.shutdown":
                # Open /run calls answer 503 at once instead of holding the server's shutdown.
                self.registry.close()
            return message

        return wrapped


@dataclass(frozen=True)
class Participant:
    """What `mount_participant` set up: the registry (this process's tries) and its identity."""

    registry: ExecutionRegistry
    routes: FastAPI

    @property
    def generation(self) -> int:
        return self.registry.generation

    @property
    def incarnation(self) -> str:
        return self.registry.incarnation


def mount_participant(
    app: FastAPI,
    *,
    agent_name: str,
    state_dir: Path,
    token: str | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    runner: Runner | None = None,
    hooks: Hooks | None = None,
    deliver: Deliver | None = None,
    open_paths: frozenset[str] = frozenset({"/health"}),
    guard: Literal["participant", "all"] = "participant",
    heartbeat_s: float | None = None,
    continuations: bool = False,
    generation_cuts: bool = False,
    payload_store: PayloadStore | None = None,
    restorer: Restorer | None = None,
) -> Participant:
    """Mounts the participant onto `app` (before it starts serving) and returns it.

    `state_dir` keeps the agent's identity (taken here: one generation and incarnation per process start), the
    durable execution evidence and the checkpoint artefacts.  By default a try runs through the
    agent's own `POST /run`; `runner` replaces that (the reference agent plays its episodes with
    boundaries to park at).  `hooks` and `deliver` are the reference agent's fault-injection points.
    `heartbeat_s` is the runner's promise to report progress of every live try at least that often
    (`RunSession.heartbeat`, a boundary, a token record): a prepare then judges a try that went longer
    without progress stuck.  The agent's own `/run` makes no such promise (None): its tries are waited
    for until the trainer's last resort.

    `continuations=True` is a runner's declaration that it resumes tries at turn boundaries
    (`RunSession.commit_turn`, `RunSession.resumed`; docs/turns.md): the agent then keeps their
    continuations (in `payload_store`, by default a directory under `state_dir`) and declares
    `turn_continuation` in `/capabilities`.  `restorer` restores export/restore resources on a resume.
    `generation_cuts=True` is a runner's declaration that it cuts a model call in progress at a
    durable token boundary when its try is asked to park (`RunSession.at_cut`): `generation_cut`.
    """
    identity = next_identity(state_dir)
    asgi_runner: AsgiRunner | None = None
    if runner is None:
        asgi_runner = runner = AsgiRunner()
    registry = ExecutionRegistry(
        agent_name=agent_name,
        generation=identity.generation,
        incarnation=identity.incarnation,
        runner=runner,
        state_dir=state_dir,
        hooks=hooks,
        heartbeat_s=heartbeat_s,
        continuations=ContinuationStore(state_dir, identity.generation, payload_store)
        if continuations
        else None,
        restorer=restorer,
        generation_cuts=generation_cuts,
    )
    routes, answers = participant_routes(registry, deliver=deliver)
    app.add_middleware(
        ParticipantMiddleware,
        registry=registry,
        routes=DirectRoutes(routes, answers),
        runner=asgi_runner,
        guarding=Guarding(token, max_body_bytes, open_paths, guard),
    )
    return Participant(registry=registry, routes=routes)
