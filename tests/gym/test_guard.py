"""Refusals: 401 without/with a wrong token, 422 for malformed bodies and ids, 413 over the body cap.

A refused call changes nothing in the agent's state.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from gym_agent.server import ThreadAgent
from protocol.wire import MAX_BODY_BYTES
from tests.gym.conftest import TOKEN, fresh_id, run_request
from trainer.gym import GymClient, InvalidRequestError, UnauthorizedError

ROUTES: list[tuple[str, str, Any]] = [
    ("POST", "/run", {"_ng_rollout_id": "auth-run", "_ng_attempt_index": 0}),
    ("GET", "/completion_receipt/x/0", None),
    ("GET", "/token_capture/x", None),
    ("POST", "/acknowledge", {"executions": []}),
    ("POST", "/retire", {"rollout_id": "auth-retire", "attempt_index": 0}),
    ("POST", "/checkpoint/prepare", {"checkpoint_id": "ckpt-auth", "timeout_s": 1}),
    ("POST", "/checkpoint/commit", {"checkpoint_id": "ckpt-auth"}),
    ("POST", "/checkpoint/resume", {"checkpoint_id": "ckpt-auth"}),
    ("POST", "/checkpoint/abort", {"checkpoint_id": "ckpt-auth"}),
    ("GET", "/status", None),
    ("GET", "/capabilities", None),
    ("POST", "/debug/faults", {"crash_after": 0}),
    ("GET", "/debug/runs", None),
]


@pytest.fixture
async def raw(token_agent: ThreadAgent) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=token_agent.url, timeout=10, verify=False) as c:
        yield c


async def _snapshot(client: GymClient) -> tuple[object, object]:
    return (await client.status(), await client.debug_runs())


@pytest.mark.parametrize("method,path,body", ROUTES, ids=[f"{m} {p}" for m, p, _ in ROUTES])
@pytest.mark.parametrize("authorization", [None, "Bearer wrong", f"Bearer {TOKEN}x", TOKEN, f"Basic {TOKEN}"])
async def test_every_route_but_health_needs_the_token(
    raw: httpx.AsyncClient,
    token_client: GymClient,
    method: str,
    path: str,
    body: Any,
    authorization: str | None,
) -> None:
    before = await _snapshot(token_client)
    headers = {"Authorization": authorization} if authorization is not None else {}
    answer = await raw.request(method, path, json=body, headers=headers)
    assert answer.status_code == 401
    assert answer.json()["error"] == "unauthorized"
    assert TOKEN not in answer.text
    assert await _snapshot(token_client) == before


async def test_health_is_open_and_the_right_token_works(
    raw: httpx.AsyncClient, token_client: GymClient
) -> None:
    assert (await raw.get("/health")).status_code == 200
    rid = fresh_id()
    reply = await token_client.run(run_request(rid))
    assert reply.rollout_id == rid
    assert (await token_client.capabilities()).agent_name == "guarded"


async def test_client_raises_unauthorized(token_agent: ThreadAgent) -> None:
    async with GymClient(token_agent.url, "guarded", token="wrong") as c:
        with pytest.raises(UnauthorizedError):
            await c.status()
    async with GymClient(token_agent.url, "guarded") as c:
        with pytest.raises(UnauthorizedError):
            await c.run(run_request(fresh_id()))


async def test_token_is_never_logged(token_client: GymClient, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG):
        await token_client.run(run_request(fresh_id()))
        await token_client.status()
    assert TOKEN not in caplog.text
    assert TOKEN not in repr(token_client)


BAD_RUN_BODIES: list[Any] = [
    {"_ng_rollout_id": "ok", "_ng_attempt_index": -1},
    {"_ng_rollout_id": "bad id", "_ng_attempt_index": 0},
    {"_ng_rollout_id": "-leading-dash", "_ng_attempt_index": 0},
    {"_ng_rollout_id": "../etc", "_ng_attempt_index": 0},
    {"_ng_rollout_id": "", "_ng_attempt_index": 0},
    {"_ng_rollout_id": "x" * 201, "_ng_attempt_index": 0},
    {"_ng_rollout_id": "ok", "_ng_attempt_index": "zero"},
    {"_ng_rollout_id": "ok", "_ng_attempt_index": 1.5},
    {"_ng_rollout_id": "ok"},
    {"_ng_attempt_index": 0},
    [],
    "text",
]


def _nested(depth: int) -> dict[str, Any]:
    value: dict[str, Any] = {"leaf": 1}
    for _ in range(depth):
        value = {"a": value}
    return value


# A field the Gym owns (kept as an extra) nested deeper than any reply could carry back.
BAD_RUN_BODIES.append({"_ng_rollout_id": "ok", "_ng_attempt_index": 0, "agent_ref": _nested(80)})


@pytest.mark.parametrize("body", BAD_RUN_BODIES, ids=[json.dumps(b)[:40] for b in BAD_RUN_BODIES])
async def test_malformed_run_bodies_are_422(
    raw: httpx.AsyncClient, token_client: GymClient, body: Any
) -> None:
    before = await _snapshot(token_client)
    answer = await raw.post("/run", json=body, headers={"Authorization": f"Bearer {TOKEN}"})
    assert answer.status_code == 422, answer.text
    error = answer.json()
    assert error["error"] == "invalid_request" and error["message"]
    assert await _snapshot(token_client) == before


async def test_422_names_the_field(raw: httpx.AsyncClient) -> None:
    answer = await raw.post(
        "/run",
        json={"_ng_rollout_id": "bad id", "_ng_attempt_index": 0},
        headers={"Authorization": f"Bearer {TOKEN}"},
    )
    assert "_ng_rollout_id" in answer.json()["message"]


@pytest.mark.parametrize(
    "path",
    [
        "/completion_receipt/bad%20id/0",
        "/completion_receipt/a%2Fb/0",
        "/completion_receipt/ok/-1",
        "/completion_receipt/ok/x",
        "/token_capture/bad%20id",
        "/token_capture/.hidden",
    ],
)
async def test_malformed_ids_in_paths_are_422(raw: httpx.AsyncClient, path: str) -> None:
    answer = await raw.get(path, headers={"Authorization": f"Bearer {TOKEN}"})
    assert answer.status_code == 422, answer.text


@pytest.mark.parametrize(
    "path,body",
    [
        ("/retire", {"rollout_id": "x", "attempt_index": 0, "extra": True}),
        ("/retire", {"rollout_id": "x y", "attempt_index": 0}),
        ("/retire", {"rollout_id": "x", "attempt_index": 0, "checkpoint_id": "bad id"}),
        ("/checkpoint/prepare", {"checkpoint_id": "ckpt", "timeout_s": -1}),
        ("/checkpoint/prepare", {"checkpoint_id": "ckpt", "unknown": 1}),
        ("/checkpoint/commit", {}),
        ("/acknowledge", {"executions": [{"agent_name": "guarded", "receipt": {"rollout_id": "x"}}]}),
        ("/debug/faults", {"rollout_id": "x", "attempt_index": 0, "explode": True}),
        ("/debug/faults", {"crash_after": -1}),
    ],
)
async def test_malformed_control_bodies_are_422(
    raw: httpx.AsyncClient, token_client: GymClient, path: str, body: Any
) -> None:
    before = await _snapshot(token_client)
    answer = await raw.post(path, json=body, headers={"Authorization": f"Bearer {TOKEN}"})
    assert answer.status_code == 422, answer.text
    assert await _snapshot(token_client) == before


async def test_invalid_json_is_422(raw: httpx.AsyncClient) -> None:
    answer = await raw.post(
        "/run",
        content=b"{not json",
        headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"},
    )
    assert answer.status_code == 422


async def test_client_refuses_to_send_bad_ids() -> None:
    # The wire model refuses the id before any request leaves (never rewritten).
    with pytest.raises(ValueError):
        run_request("bad id")


async def test_client_maps_422(token_client: GymClient) -> None:
    with pytest.raises(InvalidRequestError):
        await token_client.completion_receipt("bad id", 0)


async def test_bodies_over_the_cap_are_413(raw: httpx.AsyncClient, token_client: GymClient) -> None:
    before = await _snapshot(token_client)
    auth = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    big = json.dumps(
        {"_ng_rollout_id": "big", "_ng_attempt_index": 0, "task": {"blob": "x" * MAX_BODY_BYTES}}
    ).encode()
    answer = await raw.post("/run", content=big, headers=auth)
    assert answer.status_code == 413
    assert answer.json()["error"] == "payload_too_large"

    async def chunks() -> AsyncIterator[bytes]:
        # No Content-Length: the streaming cap has to catch it.
        for i in range(0, len(big), 1 << 20):
            yield big[i : i + (1 << 20)]

    streamed = await raw.post("/run", content=chunks(), headers=auth)
    assert streamed.status_code == 413
    assert await _snapshot(token_client) == before
