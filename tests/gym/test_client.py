"""Client-side checks: garbage answers, unreachable agents, receipt verification."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from gym_agent.launcher import free_port
from protocol.digests import reply_digest
from protocol.ids import capture_key
from protocol.token_codec import TOKENS_MEDIA_TYPE, encode_records
from protocol.wire import ALL_FEATURES, CompletionReceipt, RunReply
from tests.gym.conftest import fresh_id, run_request
from trainer.gym import (
    AgentServerError,
    AgentUnavailableError,
    BadResponseError,
    CheckpointConflictError,
    GoneError,
    GymClient,
    NotReadyError,
    ReceiptMismatchError,
    verify_receipt,
)
from trainer.gym.transport import Origin, Reply, Timeouts


class _Canned:
    """A stand-in for the client's connection pools that answers from `handler` (no socket)."""

    def __init__(self, handler: Callable[[httpx.Request], httpx.Response]) -> None:
        self.handler = handler

    async def exchange(
        self, method: str, origin: Origin, target: bytes, headers: Any, body: bytes, timeouts: Timeouts
    ) -> Reply:
        scheme, host, port = origin
        request = httpx.Request(
            method, f"{scheme}://{host}:{port}{target.decode()}", headers=headers, content=body
        )
        response = self.handler(request)
        return Reply(response.status_code, response.headers.raw, response.read())

    async def aclose(self) -> None:
        pass


def _with_transport(client: GymClient, handler: Callable[[httpx.Request], httpx.Response]) -> GymClient:
    # Only the answers are faked here; the behaviour tests all talk to real agents.
    client._run = client._control = client._phases = _Canned(handler)  # type: ignore[assignment]
    return client


@pytest.mark.parametrize(
    "response",
    [
        httpx.Response(200, text="<html>oops</html>"),
        httpx.Response(200, json={"phase": "idle"}),
        httpx.Response(200, json={"results": "nope"}),
        httpx.Response(409, json={"error": "not_ready", "status": {}}),
        httpx.Response(418, json={"error": "teapot"}),
    ],
)
async def test_garbage_answers_are_bad_responses(response: httpx.Response) -> None:
    async with _with_transport(GymClient("http://agent", "a"), lambda _: response) as c:
        with pytest.raises(BadResponseError):
            await c.status()


async def test_a_reply_for_another_try_is_refused() -> None:
    other = {
        "_ng_rollout_id": "other",
        "_ng_attempt_index": 0,
        "id": "r-other",
        "response": {},
        "reward": 1.0,
        "mask_sample": False,
    }
    async with _with_transport(
        GymClient("http://agent", "a"), lambda _: httpx.Response(200, json=other)
    ) as c:
        with pytest.raises(BadResponseError, match="instead of"):
            await c.run(run_request("mine"))


async def test_error_names_map_to_typed_errors() -> None:
    answers = {
        "/retire": httpx.Response(409, json={"error": "CheckpointConflictError", "message": "m"}),
        "/run": httpx.Response(410, json={"error": "gone", "message": "m"}),
        "/status": httpx.Response(503, json={"error": "shutting_down", "message": "m"}),
        "/capabilities": httpx.Response(200, json={"agent_name": "a", "features": list(ALL_FEATURES)}),
    }
    async with _with_transport(GymClient("http://agent", "a"), lambda r: answers[r.url.path]) as c:
        with pytest.raises(CheckpointConflictError):
            await c.retire("x", 0)
        with pytest.raises(GoneError):
            await c.run(run_request("x"))
        with pytest.raises(AgentServerError):
            await c.status()


async def test_not_ready_carries_status_and_attempts(client: GymClient) -> None:
    status = (await client.status()).model_dump(mode="json")
    body = {
        "error": "not_ready",
        "status": status,
        "completed_unacknowledged_attempts": [{"rollout_id": "rD", "attempt_index": 0}],
    }
    async with _with_transport(GymClient("http://agent", "a"), lambda _: httpx.Response(409, json=body)) as c:
        with pytest.raises(NotReadyError) as err:
            await c.prepare("ckpt-A", timeout_s=1)
    assert [a.rollout_id for a in err.value.attempts] == ["rD"]
    assert err.value.status.execution_generation == status["execution_generation"]


async def test_unreachable_agent() -> None:
    async with GymClient(f"http://127.0.0.1:{free_port()}", "gone", connect_timeout_s=2) as c:
        with pytest.raises(AgentUnavailableError):
            await c.status()
        with pytest.raises(AgentUnavailableError):
            await c.run(run_request("x"))


async def test_verify_receipt(client: GymClient) -> None:
    rid = fresh_id()
    reply = await client.run(run_request(rid))
    receipt = await client.completion_receipt(rid, 0)
    verify_receipt(reply, receipt)
    # The digest is the canonical JSON of exactly what came over the wire.
    async with httpx.AsyncClient(base_url=client.base_url, verify=False) as raw:
        wire = (await raw.post("/run", json=run_request(rid).model_dump(mode="json"))).content
    assert reply_digest(json.loads(wire)) == receipt.result_digest

    tampered = RunReply.model_validate({**reply.model_dump(mode="json"), "reward": reply.reward + 1})
    with pytest.raises(ReceiptMismatchError, match="result_digest"):
        verify_receipt(tampered, receipt)
    foreign: CompletionReceipt = receipt.model_copy(update={"result_identity": "r-x"})
    with pytest.raises(ReceiptMismatchError, match="result_identity"):
        verify_receipt(reply, foreign)


class _Recording:
    """The client's real control pool, with what each exchange sent and got written down."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.seen: list[tuple[bytes, list[tuple[bytes, bytes]], Reply]] = []

    async def exchange(
        self, method: str, origin: Origin, target: bytes, headers: Any, body: bytes, timeouts: Timeouts
    ) -> Reply:
        reply: Reply = await self.inner.exchange(method, origin, target, headers, body, timeouts)
        self.seen.append((target, list(headers), reply))
        return reply

    async def aclose(self) -> None:
        await self.inner.aclose()


async def test_token_records_travel_in_the_binary_form(client: GymClient) -> None:
    """The trainer asks for the binary form with one Accept header, and a real agent answers in it
    (with two, the agent read the first, JSON, and the trainer parsed and re-encoded every token)."""
    rid = fresh_id("bin")
    await client.run(run_request(rid))
    recording = _Recording(client._control)
    client._control = recording  # type: ignore[assignment]
    arrays = await client.token_capture(capture_key(rid, 0))
    [(_target, headers, reply)] = [s for s in recording.seen if s[0].startswith(b"/token_capture/")]
    accepts = [v for k, v in headers if k.lower() == b"accept"]
    assert len(accepts) == 1 and accepts[0].startswith(TOKENS_MEDIA_TYPE.encode())
    content_type = next(v for k, v in reply.headers if k.lower() == b"content-type")
    assert content_type == TOKENS_MEDIA_TYPE.encode()
    assert bytes(arrays.buffer) == reply.body  # what came is what the trainer keeps: no re-encoding


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"schema_version": 9}, "schema_version 9"),
        ({"model_call_id": None}, "model_call_id"),
        # a string a float field would coerce to an infinity no JSON can write back
        ({"created_at": "INF"}, "created_at"),
    ],
)
async def test_binary_token_records_are_held_to_the_token_entry_rules(
    change: dict[str, Any], why: str
) -> None:
    record = {
        "rollout_id": "t_g0-a0",
        "model_call_id": "c1",
        "prompt_token_ids": [1, 2],
        "generation_token_ids": [3],
        "generation_log_probs": [-0.5],
        **change,
    }
    body = encode_records([record])

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=body, headers={"content-type": TOKENS_MEDIA_TYPE})

    client = _with_transport(GymClient("http://127.0.0.1:9", "a"), handler)
    with pytest.raises(BadResponseError, match=why):
        await client.token_capture("t_g0-a0")
