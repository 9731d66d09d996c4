"""The participant's routes, as a FastAPI app of their own (own error format, own validation), so
mounting them changes nothing of the agent's app: `/run` (through the registry), completion receipts,
token capture, acknowledge, retire, the checkpoint phases, status and capabilities."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Annotated, Any

import orjson
from fastapi import FastAPI, Header, Path, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from participant.driver import DriverBinding, trainer_of_header
from participant.errors import AgentError
from participant.executions import ExecutionRegistry
from protocol.completion import COMPLETION_MEDIA_TYPE, encode_completion
from protocol.digests import DIGEST_PATTERN
from protocol.errors import INTERNAL_ERROR, INVALID_REQUEST, METHOD_NOT_ALLOWED, NOT_FOUND
from protocol.ids import ID_PATTERN, MAX_ATTEMPT_INDEX, MAX_ID_LENGTH
from protocol.token_codec import TOKENS_MEDIA_TYPE, encode_entries
from protocol.wire import (
    ADOPT_ONLY_HEADER,
    CONTINUE_FROM_HEADER,
    TRAINER_HEADER,
    AcknowledgeRequest,
    AcknowledgeResponse,
    Capabilities,
    CheckpointRequest,
    DriverRequest,
    PrepareRequest,
    RetireRequest,
    RunRequest,
    WireModel,
    validation_line,
)

log = logging.getLogger("participant")

IdPath = Annotated[str, Path(pattern=ID_PATTERN, min_length=1, max_length=MAX_ID_LENGTH)]
# The trainer a coordinator's call names (absent: not checked; "" the unnamed trainer).
TrainerHeader = Annotated[str | None, Header(alias=TRAINER_HEADER, max_length=MAX_ID_LENGTH)]
AttemptPath = Annotated[int, Path(ge=0, le=MAX_ATTEMPT_INDEX)]

# Paths the participant answers; every other path goes to the agent's own app.
PARTICIPANT_PATHS = frozenset(
    {"/run", "/acknowledge", "/retire", "/status", "/capabilities", "/driver", "/driver/release"}
    | {f"/checkpoint/{op}" for op in ("prepare", "commit", "resume", "abort")}
)
PARTICIPANT_PREFIXES = ("/completion_receipt/", "/token_capture/")

# Replaces the JSON answer of a live `/run` delivery (the reference agent's drop_reply fault).  The
# reply's values are JSON's, but for a MoE reply's router choices where the agent's own `/run` wrote
# the reply (the in-process runner, `participant.mount`): those may be a `RoutesText`
# (`protocol.routes.lists_of` gives its lists).
Deliver = Callable[[RunRequest, dict[str, Any]], Response | None]


def is_participant_path(path: str) -> bool:
    return path in PARTICIPANT_PATHS or path.startswith(PARTICIPANT_PREFIXES)


class _OrjsonResponse(JSONResponse):
    """JSON written by orjson (the body of a long token list or reply: 10-20x the standard library)."""

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


def _json(model: WireModel | list[Any] | dict[str, Any], status_code: int = 200) -> JSONResponse:
    content = model.model_dump(mode="json") if isinstance(model, WireModel) else model
    return _OrjsonResponse(content, status_code=status_code)


def agent_error_response(exc: AgentError) -> JSONResponse:
    """A refusal of the participant's (`AgentError`), as every route answers it."""
    return JSONResponse(exc.body(), status_code=exc.status_code)


def internal_error_response(title: str, exc: Exception) -> JSONResponse:
    """A failure no route expected, logged and answered as a 500 of `{"error", "message"}`."""
    log.error("internal error answering %s", title, exc_info=exc)
    return JSONResponse({"error": INTERNAL_ERROR, "message": f"{type(exc).__name__}: {exc}"}, status_code=500)


def install_json_errors(app: FastAPI) -> None:
    """Every refusal and failure of `app` answers `{"error": NAME, "message": ...}`, a 500 included."""

    @app.exception_handler(AgentError)
    async def _agent_error(_: Request, exc: AgentError) -> JSONResponse:
        return agent_error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(
            {"error": INVALID_REQUEST, "message": validation_line(exc, "request")}, status_code=422
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        name = {404: NOT_FOUND, 405: METHOD_NOT_ALLOWED}.get(exc.status_code, "http_error")
        return JSONResponse({"error": name, "message": str(exc.detail)}, status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        return internal_error_response(app.title, exc)


class Answers:
    """What the two routes every rollout calls answer (`/run`, `/acknowledge`), however the call
    reaches them: through the FastAPI app, or straight from ASGI (`participant.direct`)."""

    def __init__(self, reg: ExecutionRegistry, deliver: Deliver | None) -> None:
        self.reg = reg
        self.deliver = deliver
        self.driver = DriverBinding(reg.agent_name, reg.state_dir)

    def driven_by(self, trainer: str | None) -> None:
        """One trainer per agent: a call naming another trainer than the bound one is refused."""
        if trainer is not None:
            self.driver.check(trainer_of_header(trainer))

    async def run(
        self,
        request: RunRequest,
        adopt_only: str | None,
        continue_from: str | None,
        trainer: str | None,
        accept: str,
    ) -> Response:
        self.driven_by(trainer)
        outcome = await self.reg.run(request, adopt_only=adopt_only == "1", continue_from=continue_from)
        if outcome.live and self.deliver is not None:
            special = self.deliver(request, outcome.reply)
            if special is not None:
                return special
        if COMPLETION_MEDIA_TYPE in accept and outcome.receipt is not None:
            # The trainer's own client: the receipt and token records it would fetch next, in this body.
            frame = encode_completion(
                outcome.reply_json,
                orjson.dumps(outcome.receipt.model_dump(mode="json")),
                encode_entries(outcome.tokens),
            )
            return Response(frame, media_type=COMPLETION_MEDIA_TYPE)
        return Response(outcome.reply_json, media_type="application/json")

    async def acknowledge(self, request: AcknowledgeRequest, trainer: str | None) -> JSONResponse:
        self.driven_by(trainer)
        return _json(AcknowledgeResponse(results=await self.reg.acknowledge(request)))


def participant_app(reg: ExecutionRegistry, *, deliver: Deliver | None = None) -> FastAPI:
    """The routes over `reg`.  Every answer is JSON, a 500 included."""
    return participant_routes(reg, deliver=deliver)[0]


def participant_routes(reg: ExecutionRegistry, *, deliver: Deliver | None = None) -> tuple[FastAPI, Answers]:
    """The routes over `reg` as a FastAPI app, and the answers of its two per-rollout routes."""
    app = FastAPI(title=f"checkpoint participant {reg.agent_name}", openapi_url=None)
    install_json_errors(app)
    answers = Answers(reg, deliver)
    driver, driven_by = answers.driver, answers.driven_by

    @app.post("/driver")
    async def bind(request: DriverRequest) -> JSONResponse:
        return _json(driver.bind(request.trainer_id))

    @app.post("/driver/release")
    async def release(request: DriverRequest) -> JSONResponse:
        return _json(driver.release(request.trainer_id, reg.status()))

    @app.post("/run")
    async def run(
        request: RunRequest,
        adopt_only: Annotated[str | None, Header(alias=ADOPT_ONLY_HEADER)] = None,
        continue_from: Annotated[
            str | None, Header(alias=CONTINUE_FROM_HEADER, pattern=DIGEST_PATTERN)
        ] = None,
        trainer: TrainerHeader = None,
        accept: Annotated[str, Header()] = "application/json",
    ) -> Response:
        return await answers.run(request, adopt_only, continue_from, trainer, accept)

    @app.get("/completion_receipt/{rollout_id:path}/{attempt_index}")
    async def completion_receipt(rollout_id: IdPath, attempt_index: AttemptPath) -> JSONResponse:
        return _json(reg.completion_receipt(rollout_id, attempt_index))

    @app.get("/token_capture/{capture_key:path}")
    async def token_capture(
        capture_key: IdPath, accept: Annotated[str, Header()] = "application/json"
    ) -> Response:
        entries = reg.token_capture(capture_key)
        if TOKENS_MEDIA_TYPE in accept:  # the trainer's own client: the binary form, no JSON at all
            return Response(encode_entries(entries), media_type=TOKENS_MEDIA_TYPE)
        return _json([e.record() for e in entries])

    @app.post("/acknowledge")
    async def acknowledge(request: AcknowledgeRequest, trainer: TrainerHeader = None) -> JSONResponse:
        return await answers.acknowledge(request, trainer)

    @app.post("/retire")
    async def retire(request: RetireRequest, trainer: TrainerHeader = None) -> JSONResponse:
        driven_by(trainer)
        return _json(await reg.retire(request))

    @app.post("/checkpoint/prepare")
    async def prepare(request: PrepareRequest, trainer: TrainerHeader = None) -> JSONResponse:
        driven_by(trainer)
        return _json(await reg.prepare(request.checkpoint_id, request.timeout_s, request.carry_completed))

    @app.post("/checkpoint/commit")
    async def commit(request: CheckpointRequest, trainer: TrainerHeader = None) -> JSONResponse:
        driven_by(trainer)
        return _json(await reg.commit(request.checkpoint_id))

    @app.post("/checkpoint/resume")
    async def resume(request: CheckpointRequest, trainer: TrainerHeader = None) -> JSONResponse:
        driven_by(trainer)
        return _json(reg.resume(request.checkpoint_id))

    @app.post("/checkpoint/abort")
    async def abort(request: CheckpointRequest, trainer: TrainerHeader = None) -> JSONResponse:
        driven_by(trainer)
        return _json(reg.abort(request.checkpoint_id))

    @app.get("/status")
    async def status() -> JSONResponse:
        return _json(reg.status())

    @app.get("/capabilities")
    async def capabilities() -> JSONResponse:
        return _json(
            Capabilities(
                agent_name=reg.agent_name, execution_incarnation=reg.incarnation, features=reg.features()
            )
        )

    return app, answers
