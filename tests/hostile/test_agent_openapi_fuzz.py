"""schemathesis against the reference agent's OpenAPI document, on a real uvicorn on loopback.

Every route, valid and invalid inputs (positive and negative generation), with and without the bearer
token: no answer is a 5xx, every answer is JSON, a 2xx body parses as the route's wire model (extra
fields forbidden) and an error body carries `error` (and a `message` unless it is prepare's 409).

The agent serves no `/openapi.json` (`openapi_url=None`: no surface it does not need), so the
document is taken from the very FastAPI app the server runs (`app.openapi()`), which is what FastAPI
would serve.  `POST /debug/faults` is left out: `crash_after` and `hang` are faults by design (the
process exits, a run never ends); its bodies are fuzzed in-process in test_agent_payloads.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from pydantic import BaseModel, TypeAdapter
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from gym_agent.config import AgentConfig
from gym_agent.server import ThreadAgent, serve_in_thread
from participant.mount import ParticipantMiddleware
from protocol.wire import (
    AcknowledgeResponse,
    AgentStatus,
    Capabilities,
    CompletionReceipt,
    DebugRuns,
    DriverResponse,
    ErrorResponse,
    Health,
    NotReadyResponse,
    OkResponse,
    PhaseResponse,
    RetireResponse,
    RunReply,
    TokenEntry,
)

TOKEN = "fuzz-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
EXAMPLES = 12
FUZZ_EXCLUDED = frozenset({"/debug/faults"})

# What a 2xx answer of each route must parse as.
OK_MODELS: dict[str, Any] = {
    "/health": Health,
    "/run": RunReply,
    "/completion_receipt/{rollout_id}/{attempt_index}": CompletionReceipt,
    "/token_capture/{capture_key}": TypeAdapter(list[TokenEntry]),
    "/acknowledge": AcknowledgeResponse,
    "/retire": RetireResponse,
    "/checkpoint/prepare": PhaseResponse,
    "/checkpoint/commit": PhaseResponse,
    "/checkpoint/resume": PhaseResponse,
    "/checkpoint/abort": PhaseResponse,
    "/driver": DriverResponse,
    "/driver/release": DriverResponse,
    "/status": AgentStatus,
    "/capabilities": Capabilities,
    "/debug/runs": DebugRuns,
    "/debug/faults": OkResponse,
}


@pytest.fixture(scope="module")
def fuzz_agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ThreadAgent]:
    config = AgentConfig(
        name="fuzzed",
        state_dir=tmp_path_factory.mktemp("fuzz") / "fuzzed",
        token=TOKEN,
        zero_work=True,
        turns=(1, 2),
        log_level="error",
    )
    with serve_in_thread(config) as agent:
        yield agent


def _document(agent: ThreadAgent) -> dict[str, Any]:
    # The agent's own app (health, faults) with the participant mounted as its middleware, whose
    # routes are an app of their own (behind the direct path of a rollout's two calls, which answers
    # only what that app would): the document is both apps' paths.
    # Starlette's middleware list is typed for its own use, not for reading back: read it untyped.
    app: Any = agent.server.config.app
    routes = next(m.kwargs["routes"] for m in app.user_middleware if m.cls is ParticipantMiddleware)
    doc: dict[str, Any] = app.openapi()
    mounted: dict[str, Any] = routes.app.openapi()
    paths = {**doc["paths"], **mounted["paths"]}
    schemas = {
        **doc.get("components", {}).get("schemas", {}),
        **mounted.get("components", {}).get("schemas", {}),
    }
    doc = {
        **doc,
        "paths": {k: v for k, v in paths.items() if k not in FUZZ_EXCLUDED},
        "components": {"schemas": schemas},
    }
    # The agent answers a refused body with its own error shape ({"error", "message"}), not FastAPI's
    # default `HTTPValidationError`; document that, so schemathesis checks the shape actually sent.
    doc.setdefault("components", {}).setdefault("schemas", {})["AgentError"] = (
        ErrorResponse.model_json_schema()
    )
    for item in doc["paths"].values():
        for operation in item.values():
            if "422" in operation.get("responses", {}):
                operation["responses"]["422"]["content"]["application/json"]["schema"] = {
                    "$ref": "#/components/schemas/AgentError"
                }
    return doc


@pytest.fixture(scope="module")
def agent_schema(fuzz_agent: ThreadAgent) -> schemathesis.BaseSchema:
    schema = schemathesis.openapi.from_dict(_document(fuzz_agent))
    schema.config.update(base_url=fuzz_agent.url, request_timeout=20)
    schema.config.generation.update(
        modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE], max_examples=EXAMPLES, no_shrink=True
    )
    return schema


schema = schemathesis.pytest.from_fixture("agent_schema")


def _back_to_idle(url: str) -> None:
    """A fuzzed prepare closes admission; open it again so the next fuzzed /run does not wait."""
    status = httpx.get(f"{url}/status", headers=AUTH, timeout=20).json()
    active = status["active_checkpoint_id"]
    if active is None:
        return
    op = "resume" if status["phase"] == "committed_paused" else "abort"
    answer = httpx.post(f"{url}/checkpoint/{op}", json={"checkpoint_id": active}, headers=AUTH, timeout=20)
    assert answer.status_code == 200, answer.text


def _check_body(path: str, status: int, body: Any) -> None:
    if 200 <= status < 300:
        model = OK_MODELS[path]
        if isinstance(model, TypeAdapter):
            model.validate_python(body)
        else:
            assert issubclass(model, BaseModel)
            model.model_validate(body)
    elif status == 409 and isinstance(body, dict) and body.get("error") == "not_ready":
        NotReadyResponse.model_validate(body)
    else:
        ErrorResponse.model_validate(body)


@schema.parametrize()
@settings(deadline=None, suppress_health_check=list(HealthCheck), max_examples=EXAMPLES)
def test_every_route_survives_fuzzing(case: schemathesis.Case[Any], fuzz_agent: ThreadAgent) -> None:
    try:
        response = case.call(headers=AUTH, timeout=20)
        case.validate_response(response, checks=[not_a_server_error])
        content_type = (response.headers.get("content-type") or [""])[0]
        assert content_type.startswith("application/json"), response.text
        body = response.json()
        if response.status_code == 401:
            assert body["error"] == "unauthorized"
            assert TOKEN not in response.text
        else:
            _check_body(case.operation.path, response.status_code, body)
    finally:
        _back_to_idle(fuzz_agent.url)


def test_unauthenticated_fuzzing_changes_nothing(fuzz_agent: ThreadAgent, tmp_path: Path) -> None:
    """Without the token, fuzzed calls on every route are 401 and the agent's state does not move."""
    before = (
        httpx.get(f"{fuzz_agent.url}/status", headers=AUTH).json(),
        httpx.get(f"{fuzz_agent.url}/debug/runs", headers=AUTH).json(),
    )
    doc = _document(fuzz_agent)
    doc["paths"]["/debug/faults"] = {"post": {}}
    with httpx.Client(base_url=fuzz_agent.url, timeout=10) as client:
        for path, item in doc["paths"].items():
            if path == "/health":
                continue
            concrete = path.replace("{rollout_id}", "p1_g0").replace("{attempt_index}", "0")
            concrete = concrete.replace("{capture_key}", "p1_g0")
            for method in item:
                body = {"_ng_rollout_id": "p1_g0", "_ng_attempt_index": 0} if path == "/run" else {}
                for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": TOKEN}):
                    answer = client.request(
                        method.upper(), concrete, json=body if method == "post" else None, headers=headers
                    )
                    assert answer.status_code == 401, (method, path, answer.text)
    after = (
        httpx.get(f"{fuzz_agent.url}/status", headers=AUTH).json(),
        httpx.get(f"{fuzz_agent.url}/debug/runs", headers=AUTH).json(),
    )
    assert after == before
