"""A lying Gym agent: the reference agent behind an ASGI middleware that tampers with its answers.

Everything the agent does is real (runs, receipts, token capture, ACK checks); only the bytes of
selected answers are changed on their way out, as a broken or malicious agent would send them.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gym_agent.config import AgentConfig
from gym_agent.server import ThreadAgent, serve_in_thread

Action = Callable[[Any], Any] | Literal["garbage", "hang_up"]


@dataclass
class Rule:
    """Tamper with the 200 answers of routes under `route` whose (path, JSON body) `match`.

    `action`: a function from the decoded body to the body sent instead, `"garbage"` (a body that is
    not JSON) or `"hang_up"` (half the body, then the connection is closed).  `times`: how many
    answers are tampered with (None: all of them).
    """

    route: str
    match: Callable[[str, Any], bool]
    action: Action
    times: int | None = None
    hits: int = 0

    def wants(self, path: str, status: int, body: Any) -> bool:
        if status != 200 or not path.startswith(self.route):
            return False
        if self.times is not None and self.hits >= self.times:
            return False
        return self.match(path, body)


class Tamper:
    def __init__(self, app: ASGIApp, rules: list[Rule]) -> None:
        self.app = app
        self.rules = rules

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not any(path.startswith(r.route) for r in self.rules):
            await self.app(scope, receive, send)
            return
        start: dict[str, Any] = {}
        chunks: list[bytes] = []

        async def capture(message: Message) -> None:
            if message["type"] == "http.response.start":
                start.update(message)
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))

        await self.app(scope, receive, capture)
        body = b"".join(chunks)
        try:
            decoded = json.loads(body)
        except ValueError:
            decoded = None
        rule = next((r for r in self.rules if r.wants(path, start["status"], decoded)), None)
        if rule is None:
            await send(start)
            await send({"type": "http.response.body", "body": body})
            return
        rule.hits += 1
        if rule.action == "hang_up":
            await send(start)
            await send({"type": "http.response.body", "body": body[: len(body) // 2], "more_body": True})
            return  # uvicorn closes a connection whose response never finished
        new = (
            b"<html>upstream error</html>"
            if rule.action == "garbage"
            else json.dumps(rule.action(decoded)).encode()
        )
        headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
        headers.append((b"content-length", str(len(new)).encode()))
        await send({**start, "headers": headers})
        await send({"type": "http.response.body", "body": new})


@contextmanager
def serve_hostile(
    config: AgentConfig, rules: list[Rule], startup_timeout_s: float = 30.0
) -> Iterator[ThreadAgent]:
    """`gym_agent.server.serve_in_thread` with `Tamper(rules)` wrapped around the agent's app."""
    with serve_in_thread(config, startup_timeout_s, wrap=lambda app: Tamper(app, rules)) as agent:
        yield agent
