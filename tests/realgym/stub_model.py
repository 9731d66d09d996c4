"""A stub model server for the real Gym (runs in the nemo-gym 0.7.0 env): `POST /v1/responses` answers
a fixed `NeMoGymResponse`, no LLM.  A conversation without a tool result gets a `get_weather` call,
one with a tool result gets the final assistant message; both items carry token ids, log probs and
MoE `routed_experts`, as a model server returning token information does.  The tokens are those of
a consistent tokenizer (`render`): a call's prompt is its input rendered, its generation its output
item rendered, so the next call's prompt extends the previous call's whole sequence (the real
consumer resolves every call onto one chain).  `--fail-every N` answers HTTP 500 to every Nth call
(an environment failure the agent's /run surfaces).

    python stub_model.py --port PORT [--fail-every N]
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import time
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from nemo_gym.openai_utils import NeMoGymResponse


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            _text(part.get("text", "")) if isinstance(part, dict) else str(part) for part in content
        )
    return ""


def render(item: dict[str, Any]) -> list[int]:
    """The item's tokens, as a tokenizer with a chat template would give them: a function of what the
    item says only (its role, text, tool name, arguments, call id, output), not of ids, status or token
    fields, so the item the model generated renders to its own generation when the agent sends it back."""
    said = {k: item.get(k) for k in ("role", "name", "arguments", "call_id", "output")}
    said["type"] = "message" if "role" in item else item.get("type")  # a message's type may be implied
    said["text"] = _text(item.get("content"))
    digest = hashlib.sha256(json.dumps(said, sort_keys=True).encode()).digest()
    return [2 + b for b in digest[: 3 + digest[0] % 4]]


def token_fields(prompt: list[int], generated: list[int]) -> dict[str, Any]:
    n = len(generated)
    return {
        "prompt_token_ids": prompt,
        "generation_token_ids": generated,
        "generation_log_probs": [-0.25 * (i + 1) for i in range(n)],
        "routed_experts": [[[i % 8, (i + 3) % 8]] for i in range(n)],
    }


def answer(body: dict[str, Any], call: int) -> dict[str, Any]:
    given = body.get("input")
    items = given if isinstance(given, list) else [{"role": "user", "content": given or ""}]
    prompt = [1] + [t for i in items if isinstance(i, dict) for t in render(i)]
    has_tool_result = any(isinstance(i, dict) and i.get("type") == "function_call_output" for i in items)
    if has_tool_result:
        item: dict[str, Any] = {
            "type": "message",
            "id": f"msg-{call}",
            "role": "assistant",
            "status": "completed",
            "content": [{"type": "output_text", "text": "It is cold in sf.", "annotations": []}],
        }
    else:
        item = {
            "type": "function_call",
            "id": f"fc-{call}",
            "call_id": f"call-{call}",
            "name": "get_weather",
            "arguments": '{"city": "sf"}',
            "status": "completed",
        }
    item |= token_fields(prompt, render(item))
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
