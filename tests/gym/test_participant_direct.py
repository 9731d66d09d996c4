"""A rollout's two calls of a participant (`POST /run`, `POST /acknowledge`) are answered straight
from ASGI when plainly well formed (`participant.direct`): every answer, refusals included, is the
one the routes' FastAPI app gives, and only the well-formed calls skip the app.

Two agents alike (the Gym-like agent of test_participant.py, each with its own state), one with the
direct path and one whose participant routes are the FastAPI app alone, both served on loopback, are
sent the same calls one after the other; their answers are compared status, type and body."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from starlette.types import ASGIApp, Receive, Scope, Send

from participant import mount_participant
from participant.direct import DirectRoutes
from participant.mount import ParticipantMiddleware
from protocol.wire import ADOPT_ONLY_HEADER, CONTINUE_FROM_HEADER, TRAINER_HEADER
from tests.gym.test_participant import gym_like_agent, row, serve

JSON = {"content-type": "application/json"}


class Counting:
    """An ASGI app's calls, counted by path."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.paths: list[str] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            self.paths.append(scope["path"])
        await self.app(scope, receive, send)


def _mounted(state_dir: Path, *, direct: bool) -> tuple[FastAPI, Counting]:
    """A Gym-like agent with the participant mounted; `direct=False`: its routes are the FastAPI app
    alone.  The counter sees every call that reaches that app."""
    app = gym_like_agent([])
    participant = mount_participant(app, agent_name="a", state_dir=state_dir)
    # Starlette builds its middleware at the first call: what is set here is what serves.  (Its list
    # is typed for its own use, not for reading back: read it untyped.)
    middleware: list[Any] = app.user_middleware
    entry = next(m for m in middleware if m.cls is ParticipantMiddleware)
    routes: Any = entry.kwargs["routes"]
    assert isinstance(routes, DirectRoutes) and routes.app is participant.routes
    counting = Counting(participant.routes)
    if direct:
        routes.app = counting
    else:
        entry.kwargs["routes"] = counting
    return app, counting


@pytest.fixture
def agents(tmp_path: Path) -> Iterator[tuple[tuple[str, Counting], tuple[str, Counting]]]:
    with ExitStack() as stack:
        served = []
        for name, direct in (("direct", True), ("app", False)):
            app, counting = _mounted(tmp_path / name, direct=direct)
            served.append((stack.enter_context(serve(app)), counting))
        yield served[0], served[1]


def _answer(url: str, path: str, body: bytes | None, headers: list[tuple[str, str]]) -> tuple[int, str, Any]:
    reply = httpx.post(url + path, content=body, headers=headers, timeout=30)
    kind = reply.headers.get("content-type", "")
    try:
        content: Any = reply.json()
    except ValueError:
        content = reply.content
    return reply.status_code, kind, content


def _acks(*receipts: dict[str, Any]) -> bytes:
    return json.dumps({"executions": [{"agent_name": "a", "receipt": r} for r in receipts]}).encode()


def _body(rid: str, **extra: Any) -> bytes:
    return json.dumps({**row(rid).model_dump(mode="json", by_alias=True), **extra}).encode()


TOO_LONG = "t" * 201
RUNS: list[tuple[str, bytes | None, list[tuple[str, str]]]] = [
    ("a well-formed row", _body("w_g0"), [*JSON.items()]),
    ("the same row again (a replay)", _body("w_g0"), [*JSON.items()]),
    ("adopt-only, a try never started", _body("n_g0"), [*JSON.items(), (ADOPT_ONLY_HEADER, "1")]),
    (
        "continue-from out of its pattern",
        _body("c_g0"),
        [*JSON.items(), (CONTINUE_FROM_HEADER, "sha256:xyz")],
    ),
    ("a trainer header past its length", _body("t_g0"), [*JSON.items(), (TRAINER_HEADER, TOO_LONG)]),
    ("a trainer header that is no id", _body("u_g0"), [*JSON.items(), (TRAINER_HEADER, "not an id!")]),
    (
        "a trainer header given twice",
        _body("v_g0"),
        [*JSON.items(), (TRAINER_HEADER, "a"), (TRAINER_HEADER, "b")],
    ),
    ("the bound trainer", _body("x_g0"), [*JSON.items(), (TRAINER_HEADER, "trainer-1")]),
    ("another trainer", _body("y_g0"), [*JSON.items(), (TRAINER_HEADER, "trainer-2")]),
    ("a body that is not JSON", b"{not json", [*JSON.items()]),
    ("JSON that is no row", b'{"responses_create_params": {}}', [*JSON.items()]),
    ("a JSON list", b"[1, 2]", [*JSON.items()]),
    ("nested past the parser", b"[" * 100_000 + b"]" * 100_000, [*JSON.items()]),
    ("an empty body", b"", [*JSON.items()]),
    ("no content type", _body("z_g0"), []),
    ("another content type", _body("p_g0"), [("content-type", "text/plain")]),
    ("a +json content type", _body("q_g0"), [("content-type", "application/vnd.gym+json")]),
    ("a try the agent fails", _body("f_g0", expected_answer="fail"), [*JSON.items()]),
]


def test_every_run_call_is_answered_as_the_app_answers_it(
    agents: tuple[tuple[str, Counting], tuple[str, Counting]],
) -> None:
    (direct, _), (app, _) = agents
    for what, body, headers in RUNS:
        assert _answer(direct, "/run", body, headers) == _answer(app, "/run", body, headers), what


def test_only_well_formed_calls_skip_the_app(
    agents: tuple[tuple[str, Counting], tuple[str, Counting]],
) -> None:
    (direct, counting), _ = agents
    for _what, body, headers in RUNS:
        _answer(direct, "/run", body, headers)
    # The app heard the calls the direct path was not sure of, and no other.
    assert counting.paths == ["/run"] * 10
    receipt = httpx.get(direct + "/completion_receipt/w_g0/0", timeout=30).json()
    acked = _answer(direct, "/acknowledge", _acks(receipt), [*JSON.items()])
    assert acked[0] == 200 and acked[2]["results"][0]["acknowledged"] is True, acked
    assert counting.paths == ["/run"] * 10 + ["/completion_receipt/w_g0/0"]


def test_every_acknowledge_call_is_answered_as_the_app_answers_it(
    agents: tuple[tuple[str, Counting], tuple[str, Counting]],
) -> None:
    answers = []
    for url, _ in agents:
        assert _answer(url, "/run", _body("k_g0"), [*JSON.items()])[0] == 200
        receipt = httpx.get(url + "/completion_receipt/k_g0/0", timeout=30).json()
        # Each agent's own receipt (its incarnation is its own); their answers must agree.
        wrong = {**receipt, "result_digest": "sha256:" + "0" * 64}
        calls: list[tuple[bytes, list[tuple[str, str]]]] = [
            (_acks(receipt), [*JSON.items()]),
            (_acks(receipt), [*JSON.items()]),  # idempotent
            (_acks(wrong), [*JSON.items()]),
            (json.dumps({"executions": "none"}).encode(), [*JSON.items()]),
            (_acks(receipt), [*JSON.items(), (TRAINER_HEADER, TOO_LONG)]),
            (_acks(receipt), [*JSON.items(), (TRAINER_HEADER, "trainer-9")]),
            (_acks(receipt), [*JSON.items(), (TRAINER_HEADER, "trainer-8")]),
        ]
        answers.append([_answer(url, "/acknowledge", body, headers) for body, headers in calls])
    assert answers[0] == answers[1]
    statuses = [status for status, _, _ in answers[0]]
    assert statuses == [200, 200, 200, 422, 422, 200, 409], answers[0]
