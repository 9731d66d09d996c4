"""The `/run` call of a `GymClient`: a slot of the run pool, the request, and its answer read.

A worker of its own because `/run` is the one call that queues (one slot per connection of the run
pool, taken before the request goes out, so `on_slot` runs when the call has its connection) and the
one answer with two forms: the reply's JSON alone, or a completion frame that also carries the
attempt's receipt and token records (`protocol.completion`, checked by `trainer.gym.completed`).  A
plain Gym agent's reply is completed with the attempt's identity here, and in reduced mode kept.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from pydantic import TypeAdapter, ValidationError

from payloads.token_arrays import TokenArrays
from protocol.completion import COMPLETION_MEDIA_TYPE, CompletionFrameError, decode_completion
from protocol.digests import written_once
from protocol.wire import (
    ADOPT_ONLY_HEADER,
    CONTINUE_FROM_HEADER,
    RunRequest,
    gym_reply,
    validation_line,
)
from trainer.gym.answers import media_type, validated
from trainer.gym.completed import Completed, completion_parts
from trainer.gym.errors import AgentTimeoutError, BadResponseError, GymError, NotFoundError
from trainer.gym.facade import Facade
from trainer.gym.reply_body import decode_body

_JSON: TypeAdapter[Any] = TypeAdapter(Any)
_COMPLETION_MEDIA = COMPLETION_MEDIA_TYPE.encode()
# A completed attempt's receipt and token records in the /run answer; its JSON alone from other agents.
_ACCEPT_COMPLETION = ((b"Accept", _COMPLETION_MEDIA + b", application/json;q=0.5"),)
_ADOPT_ONLY = ((ADOPT_ONLY_HEADER.encode(), b"1"),)


def _continue_from(digest: str | None) -> tuple[tuple[bytes, bytes], ...]:
    return () if digest is None else ((CONTINUE_FROM_HEADER.encode(), digest.encode()),)


class Runs:
    """The `/run` calls of one client (`GymClient.run_completed` says what a call does).  `waiting`
    counts the calls waiting for a slot of the run pool."""

    def __init__(self, client: Facade, max_connections: int) -> None:
        self._client = client
        # One slot per connection of the run pool, taken before a /run is sent: a call that holds one
        # never waits inside the transport, so `run(on_slot=...)` runs when the call has its connection.
        self._slots = asyncio.Semaphore(max_connections)
        self.waiting = 0

    async def completed(
        self,
        request: RunRequest,
        *,
        timeout_s: float | None,
        adopt_only: bool,
        continue_from: str | None,
        on_slot: Callable[[], Awaitable[None]] | None,
        with_completion: bool,
    ) -> Completed:
        client = self._client
        await client.connect_quietly()
        self.waiting += 1
        try:
            async with asyncio.timeout(timeout_s):
                await self._slots.acquire()
        except TimeoutError:
            raise AgentTimeoutError(
                f"POST {client.base_url}/run: no run connection free within {timeout_s} s"
            ) from None
        finally:
            self.waiting -= 1
        try:
            if on_slot is not None:
                await on_slot()
            return await self._holding_slot(
                request, timeout_s, adopt_only, continue_from, with_completion and client.completion_in_run
            )
        finally:
            self._slots.release()

    async def _holding_slot(
        self,
        request: RunRequest,
        timeout_s: float | None,
        adopt_only: bool,
        continue_from: str | None,
        with_completion: bool,
    ) -> Completed:
        client = self._client
        key = (request.rollout_id, request.attempt_index)
        if client.reduced is not None:
            held = client.reduced.replay(*key)
            if held is not None:
                return Completed(held)
            if adopt_only:
                raise NotFoundError(f"{client.base_url} (reduced mode): no reply held for {key}; not re-run")
            client.reduced.posting(*key)
        try:
            answer = await client._send(
                client._run,
                "POST",
                "/run",
                body=request,
                timeout_s=timeout_s,
                extra_headers=(
                    *(_ADOPT_ONLY if adopt_only else _continue_from(continue_from)),
                    *client._trainer,
                    *(_ACCEPT_COMPLETION if with_completion else ()),
                ),
            )
        except GymError as exc:
            if client.reduced is not None:
                client.reduced.unanswered(*key, f"{type(exc).__name__}: {exc}")
            raise
        # One reply taken in: its lists of lists (a MoE reply's router choices) written once for every
        # pass that asks (the nesting check, the canonical JSON, the records' header).
        with written_once():
            body, receipt, tokens, framed = answer.body, None, None, False
            if media_type(answer) == _COMPLETION_MEDIA:
                try:
                    parts = decode_completion(body)
                except CompletionFrameError as exc:
                    raise BadResponseError(f"{client.base_url}/run: {exc}") from None
                body, framed = parts.reply, True
                receipt, tokens = completion_parts(client.base_url, parts, *key)
            payload = run_json(client.base_url, body)
            try:
                reply = gym_reply(payload, request.rollout_id, request.attempt_index)
            except ValidationError as exc:
                raise BadResponseError(
                    f"{client.base_url} /run: reply fails RunReply: {validation_line(exc, 'reply')}"
                ) from None
            if (reply.rollout_id, reply.attempt_index) != key:
                raise BadResponseError(
                    f"{client.base_url} /run answered for ({reply.rollout_id}, {reply.attempt_index}) "
                    f"instead of ({request.rollout_id}, {request.attempt_index})"
                )
            if client.reduced is not None:
                # Carried as a participant's frame would carry them: nothing to fetch, nothing made twice.
                kept = client.reduced.keep(reply)
                tokens = TokenArrays(kept.layout, kept.tokens)
                return Completed(reply, kept.receipt, tokens, kept.reply_json, kept.media_type)
            reply_json = bytes(body) if framed and reply.parsed_from(payload) else None
            return Completed(reply, receipt, tokens, reply_json)


def run_json(base_url: str, body: bytes | bytearray) -> Any:
    """A `/run` body's JSON: msgspec's parse (in C, four times pydantic's speed on a real Gym
    reply's 30,000 numbers), which gives the standard library's values for any JSON it reads, a
    MoE reply's router choices held as their text (`trainer.gym.reply_body`); where it refuses the
    body (no JSON, or a number past a double's range, which the standard library reads as
    infinity), pydantic's, for its exact value or refusal as before."""
    try:
        return decode_body(body)
    except msgspec.DecodeError:
        return validated(base_url, _JSON.validate_json, "JSON", body, "/run")
