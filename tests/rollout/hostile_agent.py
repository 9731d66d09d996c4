"""A lying Gym agent: the reference agent behind an ASGI middleware that tampers with its answers.

Everything the agent does is real (runs, receipts, token capture, ACK checks); only the bytes of
selected answers are changed on their way out, as a broken or malicious agent would send them.

Rules see every answer as JSON: token records in their binary form are decoded for the rule and
encoded again after it; a `/run` answer that carries its receipt and token records
(`protocol.completion`) is taken apart, and each part goes through the rules of the route it would
otherwise have come from (`/run`, `/completion_receipt/...`, `/token_capture/...`), so a lie told in
either way of answering reaches the trainer the same.
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
from protocol.completion import COMPLETION_MEDIA_TYPE, decode_completion, encode_completion
from protocol.ids import capture_key
from protocol.token_codec import TOKENS_MEDIA_TYPE, decode_records, encode_records

_GARBAGE = b"<html>upstream error</html>"

Action = Callable[[Any], Any] | Literal["garbage", "hang_up"]


@dataclass
class Rule:
    """Tamper with the 200 answers of routes under `route` whose (path, JSON body) `match`.

    `action`: a function from the decoded body to the body sent instead (bytes: sent as they are),
    `"garbage"` (a body that is not JSON) or `"hang_up"` (half the body, then the connection is
    closed).  `times`: how many answers are tampered with (None: all of them).
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
        # A `/run` answer may carry the parts of a receipt's and a token fetch's answers too.
        routes = {r.route for r in self.rules}
        if path == "/run" and routes & {"/completion_receipt", "/token_capture"}:
            routes.add("/run")
        if scope["type"] != "http" or not any(path.startswith(route) for route in routes):
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
        media = _media_type(start)
        if media == COMPLETION_MEDIA_TYPE and start["status"] == 200:
            new = self._tamper_completion(body)
        else:
            new = self._tamper(path, start["status"], media, body)
        if new is None:
            await send(start)
            await send({"type": "http.response.body", "body": body})
            return
        if new == b"hang_up":
            await send(start)
            await send({"type": "http.response.body", "body": body[: len(body) // 2], "more_body": True})
            return  # uvicorn closes a connection whose response never finished
        headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
        headers.append((b"content-length", str(len(new)).encode()))
        await send({**start, "headers": headers})
        await send({"type": "http.response.body", "body": new})

    def _tamper(self, path: str, status: int, media: str, body: bytes) -> bytes | None:
        """The body a rule sends instead of `body` (b"hang_up": break off), or None: unchanged."""
        binary = media == TOKENS_MEDIA_TYPE
        try:
            decoded = decode_records(body) if binary else json.loads(body)
        except ValueError:
            decoded = None
        rule = next((r for r in self.rules if r.wants(path, status, decoded)), None)
        if rule is None:
            return None
        rule.hits += 1
        if rule.action == "hang_up":
            return b"hang_up"
        if rule.action == "garbage":
            return _GARBAGE
        changed = rule.action(decoded)
        if isinstance(changed, bytes):
            return changed  # the rule wrote the bytes itself
        return encode_records(changed) if binary else json.dumps(changed).encode()

    def _tamper_completion(self, body: bytes) -> bytes | None:
        parts = decode_completion(body)
        receipt = json.loads(parts.receipt)
        rid, n = receipt["rollout_id"], receipt["attempt_index"]
        new_reply = self._tamper("/run", 200, "application/json", parts.reply)
        new_receipt = self._tamper(f"/completion_receipt/{rid}/{n}", 200, "application/json", parts.receipt)
        new_tokens = self._tamper(
            f"/token_capture/{receipt.get('manifest_capture_key', capture_key(rid, n))}",
            200,
            TOKENS_MEDIA_TYPE,
            bytes(parts.tokens),
        )
        changed = (new_reply, new_receipt, new_tokens)
        if all(part is None for part in changed):
            return None
        if b"hang_up" in changed:
            return b"hang_up"  # the one answer the three parts share is broken off
        return encode_completion(
            new_reply or parts.reply, new_receipt or parts.receipt, new_tokens or bytes(parts.tokens)
        )


def _media_type(start: Message) -> str:
    for name, value in start.get("headers", []):
        if name.lower() == b"content-type":
            return str(value.decode("latin-1").split(";")[0].strip())
    return ""


@contextmanager
def serve_hostile(
    config: AgentConfig, rules: list[Rule], startup_timeout_s: float = 30.0
) -> Iterator[ThreadAgent]:
    """`gym_agent.server.serve_in_thread` with `Tamper(rules)` wrapped around the agent's app."""
    with serve_in_thread(config, startup_timeout_s, wrap=lambda app: Tamper(app, rules)) as agent:
        yield agent
