"""The reference Gym agent: its own routes (health, fault injection) and episodes, with the participant
library mounted for everything the hand-off protocol needs."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Annotated

from fastapi import Body, FastAPI
from fastapi.responses import JSONResponse, Response
from starlette.types import ASGIApp

from gym_agent.config import AgentConfig
from gym_agent.episode import HEARTBEAT_S, Environment
from gym_agent.faults import FaultInjector, FaultRequest
from gym_agent.tools import ToolBelt
from participant import ExecutionRegistry, RunSession, mount_participant
from participant.routes import install_json_errors
from protocol.wire import DebugRuns, Health, OkResponse, RunReply, RunRequest
from workers.policy import load_policy

log = logging.getLogger("gym_agent")


class EpisodeRunner:
    """Plays a try as one of the environment's episodes, with the fault the try started with."""

    def __init__(
        self, environment: Environment, faults: FaultInjector, *, resumes: bool = False, cuts: bool = False
    ) -> None:
        self.environment = environment
        self.faults = faults
        # Whether it saves a continuation at each boundary and carries on from one (docs/turns.md).
        self.resumes = resumes
        # Whether it cuts model calls at token boundaries when a checkpoint parks them (gym_agent.decode).
        self.cuts = cuts

    async def __call__(self, request: RunRequest, session: RunSession) -> RunReply:
        resumed = session.resumed if self.resumes else None
        return await self.environment.play(
            request,
            fault=self.faults.fault_of(request),
            at_boundary=session.at_boundary,
            record=session.record,
            heartbeat=session.heartbeat,
            lineage=session.lineage,
            resumed=resumed.state if resumed is not None else None,
            commit_turn=session.commit_turn if self.resumes else None,
            at_cut=session.at_cut if self.cuts else None,
            earlier=resumed.tokens if resumed is not None else (),
        )


def create_app(config: AgentConfig) -> tuple[ASGIApp, ExecutionRegistry]:
    """Builds the app (the agent's routes with the participant mounted) and the registry it serves;
    takes this start's identity (execution generation and incarnation)."""
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
        inline_tokens=config.inline_tokens,
        call_seconds=config.call_seconds,
        tool_seconds=config.tool_seconds,
        prompt_tokens=config.prompt_tokens,
        gen_tokens=config.gen_tokens,
    )
    faults = FaultInjector()
    tools = ToolBelt(config.resources_url, config.resources) if config.resources_url else None
    environment.tools = tools

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        executor.shutdown(wait=False, cancel_futures=True)
        if tools is not None:
            await tools.close()

    app = FastAPI(title=f"reference Gym agent {config.name}", lifespan=lifespan, openapi_url=None)
    install_json_errors(app)

    participant = mount_participant(
        app,
        agent_name=config.name,
        state_dir=config.resolved_state_dir,
        token=config.token_value(),
        max_body_bytes=config.max_body_bytes,
        runner=EpisodeRunner(
            environment, faults, resumes=config.turn_continuation, cuts=config.generation_cuts
        ),
        hooks=faults,
        deliver=faults.deliver,
        guard="all",
        heartbeat_s=HEARTBEAT_S,
        continuations=config.turn_continuation,
        generation_cuts=config.generation_cuts,
        restorer=tools.restore if tools is not None else None,
    )
    reg = participant.registry

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse(
            Health(
                agent_name=config.name,
                execution_generation=reg.generation,
                execution_incarnation=reg.incarnation,
            ).model_dump()
        )

    @app.get("/metrics", include_in_schema=False)
    async def metrics() -> Response:
        from gym_agent.metrics import render

        body, content_type = render(config.name, reg.status(), reg.debug_runs())
        return Response(body, media_type=content_type)

    @app.post("/debug/faults")
    async def debug_faults(request: Annotated[FaultRequest, Body()]) -> JSONResponse:
        faults.apply(request)
        return JSONResponse(OkResponse().model_dump())

    @app.get("/debug/runs")
    async def debug_runs() -> JSONResponse:
        return JSONResponse(DebugRuns(runs=reg.debug_runs()).model_dump())

    return app, reg
