"""A stub model server for the real Gym (runs in the nemo-gym 3.12 env): `POST /v1/responses` answers
a fixed `NeMoGymResponse`, no LLM.  A conversation without a tool result gets a `get_weather` call,
one with a tool result gets the final assistant message; both items carry token ids, log probs and
MoE `routed_experts`, as a model server returning token information does.  `--fail-every N` answers
HTTP 500 to every Nth call (an environment failure the agent's /run surfaces).

    python stub_model.py --port PORT [--fail-every N]
"""

from __future__ import annotations

import argparse
import itertools
import time
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from nemo_gym.openai_utils import NeMoGymResponse


def token_fields(seed: int, n: int) -> dict[str, Any]:
    return {
        "prompt_token_ids": [seed % 97, 11, 12],
        "generation_token_ids": [100 + seed % 50 + i for i in range(n)],
        "generation_log_probs": [-0.25 * (i + 1) for i in range(n)],
        "routed_experts": [[[i % 8, (i + 3) % 8]] for i in range(n)],
    }


def answer(body: dict[str, Any], call: int) -> dict[str, Any]:
    items = body.get("input") if isinstance(body.get("input"), list) else []
    has_tool_result = any(isinstance(i, dict) and i.get("type") == "function_call_output" for i in items)
    if has_tool_result:
        item: dict[str, Any] = {
            "type": "message",
            "id": f"msg-{call}",
            "role": "assistant",
            "status": "completed",
            "content": [{"type": "output_text", "text": "It is cold in sf.", "annotations": []}],
            **token_fields(call, 4),
        }
    else:
        item = {
            "type": "function_call",
            "id": f"fc-{call}",
            "call_id": f"call-{call}",
            "name": "get_weather",
            "arguments": '{"city": "sf"}',
            "status": "completed",
            **token_fields(call, 3),
        }
    response = {
        "id": f"resp-{call}",
        "created_at": time.time(),
        "model": "stub-policy",
        "object": "response",
        "output": [item],
        "parallel_tool_calls": False,
        "tool_choice": "auto",
        "tools": [],
    }
    return NeMoGymResponse.model_validate(response).model_dump(mode="json")


def build(fail_every: int) -> FastAPI:
    app = FastAPI()
    calls = itertools.count(1)

    @app.get("/")
    async def liveness() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/v1/responses")
    async def responses(request: Request) -> JSONResponse:
        call = next(calls)
        if fail_every and call % fail_every == 0:
            return JSONResponse({"error": "stub model failure (injected)"}, status_code=500)
        return JSONResponse(answer(await request.json(), call))

    return app


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--fail-every", type=int, default=0)
    args = parser.parse_args()
    uvicorn.run(build(args.fail_every), host="127.0.0.1", port=args.port, log_level="warning")
