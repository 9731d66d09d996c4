"""Request-size and list-length caps on every route of the reference agent, token or not.

tests/gym/test_guard.py covers the 401s of every route and the body cap of `/run`; here: the body cap
on every POST route (declared and streamed), the cap on `/acknowledge`'s list, and that a refused call
changes nothing.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest

from gym_agent.config import AgentConfig
from gym_agent.server import ThreadAgent, serve_in_thread
from protocol.wire import MAX_LIST_ITEMS

TOKEN = "caps-token"
AUTH = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
CAP = 64 * 1024  # a small cap for this agent, so the bodies stay cheap
POST_ROUTES = (
    "/run",
    "/acknowledge",
    "/retire",
    "/checkpoint/prepare",
    "/checkpoint/commit",
    "/checkpoint/resume",
    "/checkpoint/abort",
    "/debug/faults",
)


@pytest.fixture(scope="module")
def capped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ThreadAgent]:
    state: Path = tmp_path_factory.mktemp("caps")
    config = AgentConfig(
        name="capped",
        state_dir=state,
        token=TOKEN,
        zero_work=True,
        max_body_bytes=CAP,
        log_level="error",
    )
    with serve_in_thread(config) as agent:
        yield agent


@pytest.fixture
async def raw(capped: ThreadAgent) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=capped.url, timeout=20) as c:
        yield c


async def _state(raw: httpx.AsyncClient) -> tuple[object, object]:
    return (
        (await raw.get("/status", headers=AUTH)).json(),
        (await raw.get("/debug/runs", headers=AUTH)).json(),
    )


@pytest.mark.parametrize("path", POST_ROUTES)
async def test_every_post_route_caps_its_body(raw: httpx.AsyncClient, path: str) -> None:
    before = await _state(raw)
    big = json.dumps({"checkpoint_id": "c", "padding": "x" * (CAP + 1)}).encode()
    declared = await raw.post(path, content=big, headers=AUTH)
    assert declared.status_code == 413 and declared.json()["error"] == "payload_too_large"

    async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: the streaming cap catches it
        for i in range(0, len(big), 8192):
            yield big[i : i + 8192]

    streamed = await raw.post(path, content=chunks(), headers=AUTH)
    assert streamed.status_code == 413
    huge = await raw.post(path, content=b"x" * (CAP * 9), headers=AUTH)  # past the drain limit: hang up
    assert huge.status_code == 413
    assert await _state(raw) == before


@pytest.mark.parametrize("path", POST_ROUTES)
async def test_without_the_token_no_body_is_read(raw: httpx.AsyncClient, path: str) -> None:
    """Without the token the guard answers 401 before it reads any body, however large."""
    answer = await raw.post(path, content=b"x" * (CAP * 2), headers={"Content-Type": "application/json"})
    assert answer.status_code == 401


async def test_acknowledge_list_over_the_cap_is_422(tmp_path: Path) -> None:
    receipt = {
        "rollout_id": "p1_g0",
        "attempt_index": 0,
        "execution_generation": 1,
        "result_identity": "r-p1_g0",
        "result_digest": "sha256:" + "a" * 64,
        "manifest_capture_key": "p1_g0",
        "terminal_model_call_id": "call-1",
    }
    config = AgentConfig(name="listcap", state_dir=tmp_path, zero_work=True, log_level="error")
    with serve_in_thread(config) as agent:
        async with httpx.AsyncClient(base_url=agent.url, timeout=30) as client:
            body = {"executions": [{"agent_name": "listcap", "receipt": receipt}] * (MAX_LIST_ITEMS + 1)}
            answer = await client.post("/acknowledge", json=body)
            assert answer.status_code == 422, answer.text[:200]
            assert "executions" in answer.json()["message"]
            at_cap = await client.post(
                "/acknowledge", json={"executions": body["executions"][:MAX_LIST_ITEMS]}
            )
            assert at_cap.status_code == 200
            assert {r["error"] for r in at_cap.json()["results"]} == {"unknown_execution"}
