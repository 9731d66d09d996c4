"""The two calls every rollout makes of a participant, `POST /run` and `POST /acknowledge`, answered
straight from ASGI when they are plainly well formed; every other call, and any of these two that
is not, goes to the routes' FastAPI app, which answers it as it always has.

Why: a FastAPI call's own machinery (its middleware stack, the route's match, the solving of its
parameters, the body read again) was about a quarter of what mounting the participant added to a
tiny rollout's agent CPU, measured with the real Gym agent (docs/performance.md).  What is answered
here is what the app would answer, by construction: the same body parse (`json.loads`, as
Starlette's `Request.json`) and model validation (`validate_python`, as FastAPI's), the same
handler (`routes.Answers`) and the same error bodies (`routes.agent_error_response`,
`routes.internal_error_response`).  A call this path is not sure of (a header given twice or out of
its pattern, a body that does not parse or validate, another content type) is handed to the app
with its body replayed, so its refusal is the app's own, word for word.
"""

from __future__ import annotations

import email.message
import json
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Final

from fastapi import FastAPI
from pydantic import BaseModel
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from participant.errors import AgentError
from participant.guard import replayed
from participant.routes import Answers, agent_error_response, internal_error_response
from protocol.digests import DIGEST_PATTERN
from protocol.ids import MAX_ID_LENGTH
from protocol.wire import (
    ADOPT_ONLY_HEADER,
    CONTINUE_FROM_HEADER,
    TRAINER_HEADER,
    AcknowledgeRequest,
    RunRequest,
)

# The headers the two routes read, as ASGI names them (lower case bytes).
_ADOPT_ONLY: Final = ADOPT_ONLY_HEADER.encode()
_CONTINUE_FROM: Final = CONTINUE_FROM_HEADER.encode()
_TRAINER: Final = TRAINER_HEADER.encode()
_ACCEPT: Final = b"accept"
_CONTENT_TYPE: Final = b"content-type"
_READ: Final = frozenset({_ADOPT_ONLY, _CONTINUE_FROM, _TRAINER, _ACCEPT, _CONTENT_TYPE})
_DIGEST: Final = re.compile(DIGEST_PATTERN.removeprefix("^").removesuffix("$"))

Headers = dict[bytes, str]


@dataclass(frozen=True)
class _Route:
    model: type[BaseModel]
    # The call's answer from its validated body and its headers; None: the app should answer it.
    answer: Callable[[Answers, Any, Headers], Awaitable[Response] | None]


def _trainer(headers: Headers) -> tuple[bool, str | None]:
    """(whether the header is one the app would take, its value)."""
    value = headers.get(_TRAINER)
    return value is None or len(value) <= MAX_ID_LENGTH, value


def _run(answers: Answers, request: RunRequest, headers: Headers) -> Awaitable[Response] | None:
    ok, trainer = _trainer(headers)
    continue_from = headers.get(_CONTINUE_FROM)
    if not ok or (continue_from is not None and _DIGEST.fullmatch(continue_from) is None):
        return None
    accept = headers.get(_ACCEPT, "application/json")
    return answers.run(request, headers.get(_ADOPT_ONLY), continue_from, trainer, accept)


def _acknowledge(
    answers: Answers, request: AcknowledgeRequest, headers: Headers
) -> Awaitable[Response] | None:
    ok, trainer = _trainer(headers)
    return answers.acknowledge(request, trainer) if ok else None


ROUTES: Final[dict[str, _Route]] = {
    "/run": _Route(RunRequest, _run),
    "/acknowledge": _Route(AcknowledgeRequest, _acknowledge),
}


def _headers(scope: Scope) -> Headers | None:
    """The headers the routes read (latin-1, as Starlette decodes them); None when one is given
    more than once (which of them counts is the app's to say)."""
    found: Headers = {}
    for name, value in scope["headers"]:
        if name in _READ:
            if name in found:
                return None
            found[name] = value.decode("latin-1")
    return found


def _is_json(content_type: str | None) -> bool:
    """A content type FastAPI reads the body of as JSON (`application/json`, `application/*+json`);
    a call without one is the app's to judge (its strictness about a missing type is its own)."""
    if not content_type:
        return False
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (
        subtype == "json" or subtype.endswith("+json")
    )


class DirectRoutes:
    """`app` (the participant's routes), with its two per-rollout calls answered directly."""

    def __init__(self, app: FastAPI, answers: Answers) -> None:
        self.app: ASGIApp = app
        self.title = app.title  # what a 500 of the app's names
        self.answers = answers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = ROUTES.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if route is None:
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away before its body was whole: nobody to answer
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        answering = self._answering(route, scope, body)
        if answering is None:
            await self.app(scope, replayed(body, receive), send)
            return
        try:
            response = await answering
        except AgentError as exc:
            response = agent_error_response(exc)
        except Exception as exc:  # as the app's own handler of the unexpected answers it
            response = internal_error_response(self.title, exc)
        await response(scope, receive, send)

    def _answering(self, route: _Route, scope: Scope, body: bytes) -> Awaitable[Response] | None:
        headers = _headers(scope)
        if headers is None or not body or not _is_json(headers.get(_CONTENT_TYPE)):
            return None
        try:
            request = route.model.__pydantic_validator__.validate_python(
                json.loads(body), from_attributes=True
            )
        except Exception:  # not JSON (or nested past the parser), or not the route's body: the app says why
            return None
        return route.answer(self.answers, request, headers)


__all__ = ["ROUTES", "DirectRoutes"]
