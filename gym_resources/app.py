"""The reference resources server's routes (`protocol.resources`): list, call, export, restore, release.

Every change is journaled durably (`<state dir>/resources.jsonl`, group commit) before it is answered,
so a key answered `applied` is in the journal, and a server restarted with its state directory kept
answers a repeat of it from the record.  Changes are applied one at a time (one lock): a key is applied
once even when two tries send it together."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Annotated, Any

from fastapi import Body, FastAPI
from fastapi import Path as PathParam
from fastapi.responses import JSONResponse

from gym_resources.book import JOURNAL_FILE, RESOURCES, Book, ClassError, ToolError, journal_line
from participant.durable import GroupCommitFile
from participant.errors import AgentError, NotFoundError
from participant.routes import install_json_errors
from protocol.errors import INVALID_REQUEST
from protocol.ids import ID_PATTERN, MAX_ID_LENGTH
from protocol.resources import (
    ResourceList,
    RestoreRequest,
    Revision,
    SessionRequest,
    ToolCall,
)

NamePath = Annotated[str, PathParam(pattern=ID_PATTERN, min_length=1, max_length=MAX_ID_LENGTH)]


class RefusedError(AgentError):
    status_code = 422
    error = INVALID_REQUEST


class ConflictError(AgentError):
    status_code = 409
    error = "resource_class"


def create_app(state_dir: Path) -> FastAPI:
    state_dir.mkdir(parents=True, exist_ok=True)
    book = Book.recover(state_dir)  # FileDamaged: the server does not start
    journal: GroupCommitFile | None = None
    lock = asyncio.Lock()

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        nonlocal journal
        journal = GroupCommitFile(state_dir / JOURNAL_FILE)
        try:
            yield
        finally:
            journal.close()

    app = FastAPI(title="reference resources server", lifespan=lifespan, openapi_url=None)
    install_json_errors(app)
    app.state.book = book

    async def durable(line: dict[str, Any] | None) -> None:
        if line is not None:
            assert journal is not None
            await journal.commit(journal_line(line))

    def known(name: str) -> None:
        if name not in RESOURCES:
            raise NotFoundError(f"no resource {name!r} (this server has {', '.join(sorted(RESOURCES))})")

    @app.get("/resources")
    async def resources() -> JSONResponse:
        return JSONResponse(
            ResourceList(resources=[r.info() for r in RESOURCES.values()]).model_dump(mode="json")
        )

    @app.post("/resources/{name}/call")
    async def call(name: NamePath, body: Annotated[ToolCall, Body()]) -> JSONResponse:
        known(name)
        async with lock:
            try:
                result, line = book.call(
                    name, body.session, body.key, body.tool, body.arguments, body.attempt_index
                )
            except ToolError as exc:
                raise RefusedError(str(exc)) from None
            await durable(line)
        return JSONResponse(result.model_dump(mode="json"))

    @app.post("/resources/{name}/export")
    async def export(name: NamePath, body: Annotated[SessionRequest, Body()]) -> JSONResponse:
        known(name)
        try:
            revision = book.export(name, body.session)
        except ClassError as exc:
            raise ConflictError(str(exc)) from None
        return JSONResponse(Revision(revision=revision).model_dump(mode="json"))

    @app.post("/resources/{name}/restore")
    async def restore(name: NamePath, body: Annotated[RestoreRequest, Body()]) -> JSONResponse:
        known(name)
        async with lock:
            try:
                reverted, line = book.restore(name, body.session, body.revision)
            except ClassError as exc:
                raise ConflictError(str(exc)) from None
            await durable(line or None)
        return JSONResponse(Revision(revision=body.revision, reverted=reverted).model_dump(mode="json"))

    @app.post("/resources/{name}/release")
    async def release(name: NamePath, body: Annotated[SessionRequest, Body()]) -> JSONResponse:
        known(name)
        async with lock:
            await durable(book.release(name, body.session))
        return JSONResponse(Revision(revision=0).model_dump(mode="json"))

    return app
