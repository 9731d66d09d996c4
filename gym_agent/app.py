"""The reference Gym agent's routes (FastAPI), built around one `ExecutionRegistry`."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import Body, FastAPI, Path, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from gym_agent.config import AgentConfig
from gym_agent.episode import Environment
from gym_agent.errors import AgentError
from gym_agent.executions import ExecutionRegistry
from gym_agent.faults import FaultRequest
from gym_agent.guard import GuardMiddleware
from protocol.errors import INVALID_REQUEST
from protocol.ids import ID_PATTERN, MAX_ID_LENGTH
from protocol.wire import (
    ALL_FEATURES,
    AcknowledgeRequest,
    AcknowledgeResponse,
    Capabilities,
    CheckpointRequest,
    DebugRuns,
    Health,
    OkResponse,
    PrepareRequest,
    RetireRequest,
    RunRequest,
    WireModel,
)
from workers.policy import load_policy

log = logging.getLogger("gym_agent")

IdPath = Annotated[str, Path(pattern=ID_PATTERN, min_length=1, max_length=MAX_ID_LENGTH)]
AttemptPath = Annotated[int, Path(ge=0, le=1_000_000)]


def _json(model: WireModel | list[Any] | dict[str, Any], status_code: int = 200) -> JSONResponse:
    content = model.model_dump(mode="json") if isinstance(model, WireModel) else model
    return JSONResponse(content, status_code=status_code)


class DroppedReply(Response):
    """The drop_reply fault: announce the whole reply, send half of it, and hang up.

    Returning without finishing the body makes uvicorn close the connection, so the client sees a
    broken connection (not a short 200) while the try stays COMPLETED with its reply stored.
    """

    def __init__(self, reply: dict[str, Any]) -> None:
        super().__init__(content=json.dumps(reply).encode(), media_type="application/json")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        await send(
            {"type": "http.response.body", "body": self.body[: len(self.body) // 2], "more_body": True}
        )


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err.get("loc", ()))
        parts.append(f"{loc}: {err.get('msg', 'invalid')}")
    return "; ".join(parts) or "invalid request"


def create_app(config: AgentConfig, generation: int) -> tuple[ASGIApp, ExecutionRegistry]:
    """Builds the ASGI app (routes behind the auth/size guard) and the registry it serves."""
    # One model thread per agent: model calls queue like they would on one inference server, and many
    # agents in one test process do not multiply torch's thread pools.
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"policy-{config.name}")
    environment = Environment(
        load_policy(config.policy),
        executor,
        seed=config.seed,
        turns=config.turns,
        temperature=config.temperature,
        delay_s=config.delay_s,
        zero_work=config.zero_work,
    )
    reg = ExecutionRegistry(
        agent_name=config.name,
        generation=generation,
        environment=environment,
        state_dir=config.resolved_state_dir,
    )

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        reg.close()
        executor = reg.environment.executor
        if isinstance(executor, ThreadPoolExecutor):
            executor.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title=f"reference Gym agent {config.name}", lifespan=lifespan, openapi_url=None)

    @app.exception_handler(AgentError)
    async def _agent_error(_: Request, exc: AgentError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse({"error": INVALID_REQUEST, "message": _validation_message(exc)}, status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        name = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return JSONResponse({"error": name, "message": str(exc.detail)}, status_code=exc.status_code)

    @app.get("/health")
    async def health() -> JSONResponse:
        return _json(Health(agent_name=config.name, execution_generation=reg.generation))

    @app.post("/run")
    async def run(request: RunRequest) -> Response:
        outcome = await reg.run(request)
        if outcome.drop:
            log.info("drop_reply fault: breaking off the reply of %s", request.rollout_id)
            return DroppedReply(outcome.reply)
        return JSONResponse(outcome.reply)

    @app.get("/completion_receipt/{rollout_id:path}/{attempt_index}")
    async def completion_receipt(rollout_id: IdPath, attempt_index: AttemptPath) -> JSONResponse:
        return _json(reg.completion_receipt(rollout_id, attempt_index))

    @app.get("/token_capture/{capture_key:path}")
    async def token_capture(capture_key: IdPath) -> JSONResponse:
        return _json([e.model_dump(mode="json") for e in reg.token_capture(capture_key)])

    @app.post("/acknowledge")
    async def acknowledge(request: AcknowledgeRequest) -> JSONResponse:
        return _json(AcknowledgeResponse(results=reg.acknowledge(request)))

    @app.post("/retire")
    async def retire(request: RetireRequest) -> JSONResponse:
        return _json(reg.retire(request))

    @app.post("/checkpoint/prepare")
    async def prepare(request: PrepareRequest) -> JSONResponse:
        return _json(await reg.prepare(request.checkpoint_id, request.timeout_s))

    @app.post("/checkpoint/commit")
    async def commit(request: CheckpointRequest) -> JSONResponse:
        return _json(await reg.commit(request.checkpoint_id))

    @app.post("/checkpoint/resume")
    async def resume(request: CheckpointRequest) -> JSONResponse:
        return _json(reg.resume(request.checkpoint_id))

    @app.post("/checkpoint/abort")
    async def abort(request: CheckpointRequest) -> JSONResponse:
        return _json(reg.abort(request.checkpoint_id))

    @app.get("/status")
    async def status() -> JSONResponse:
        return _json(reg.status())

    @app.get("/metrics", include_in_schema=False)
    async def metrics() -> Response:
        from gym_agent.metrics import render

        body, content_type = render(config.name, reg.status(), reg.debug_runs())
        return Response(body, media_type=content_type)

    @app.get("/capabilities")
    async def capabilities() -> JSONResponse:
        return _json(Capabilities(agent_name=config.name, features=list(ALL_FEATURES)))

    @app.post("/debug/faults")
    async def debug_faults(request: Annotated[FaultRequest, Body()]) -> JSONResponse:
        reg.set_faults(request)
        return _json(OkResponse())

    @app.get("/debug/runs")
    async def debug_runs() -> JSONResponse:
        return _json(DebugRuns(runs=reg.debug_runs()))

    guarded = GuardMiddleware(
        app,
        token=config.token_value(),
        max_body_bytes=config.max_body_bytes,
        open_paths=frozenset({"/health"}),
    )
    return guarded, reg
