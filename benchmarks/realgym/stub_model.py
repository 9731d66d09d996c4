"""A stub model server for the real Gym (runs in the nemo-gym 0.7.0 env): `POST /v1/responses` answers
a fixed `NeMoGymResponse`, no LLM.  A conversation without a tool result gets a `get_weather` call,
one with a tool result gets the final assistant message; both items carry token ids, log probs and
MoE `routed_experts`, as a model server returning token information does.  The tokens are those of
a consistent tokenizer (`render`): a call's prompt is its input rendered, its generation its output
item rendered, so the next call's prompt extends the previous call's whole sequence (the real
consumer resolves every call onto one chain).  `--fail-every N` answers HTTP 500 to every Nth call
(an environment failure the agent's /run surfaces).

By default an item renders to 3-6 tokens (the tiny case).  `--prompt-tokens P --gen-tokens G` give a
rollout of the agent's two model calls real sizes: a user or system message renders to P tokens, each
item the model generates to G / 2 (so the first call's prompt holds P tokens and the rollout
generates G), ids of a 151,936-token vocabulary and float32 log probabilities, drawn from the item's
digest (the same item, the same tokens) and kept once drawn.

`--routes lists` (the default) answers `routed_experts` as nested lists, a `[[e1, e2]]` per generated
token; `--routes envelope` as NeMo RL's generation worker ships them for router replay: one string,
`nrlre1:int16:<tokens>x1x2:<base64 of the int16 array>`, which 0.7.0's `RoutedExperts` accepts
beside the lists and passes on untouched.

    python stub_model.py --port PORT [--fail-every N] [--prompt-tokens P --gen-tokens G] [--routes envelope]
"""

from __future__ import annotations

import argparse
import base64
import functools
import hashlib
import itertools
import json
import random
import struct
import time
from dataclasses import dataclass
from typing import Any

import orjson
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from nemo_gym.openai_utils import NeMoGymResponse

VOCAB = 151_936


@dataclass(frozen=True)
class Sizes:
    """Tokens an item renders to by what it is: a user's or system's message, a generated item."""

    prompt: int
    generated: int

    def of(self, item: dict[str, Any]) -> int | None:
        if item.get("type") == "function_call" or item.get("role") == "assistant":
            return self.generated
        if item.get("role") in ("user", "system", "developer"):
            return self.prompt
        return None  # a tool's output: a few tokens


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            _text(part.get("text", "")) if isinstance(part, dict) else str(part) for part in content
        )
    return ""


def render(item: dict[str, Any], sizes: Sizes | None = None) -> list[int]:
    """The item's tokens, as a tokenizer with a chat template would give them: a function of what the
    item says only (its role, text, tool name, arguments, call id, output), not of ids, status or token
    fields, so the item the model generated renders to its own generation when the agent sends it back."""
    said = {k: item.get(k) for k in ("role", "name", "arguments", "call_id", "output")}
    said["type"] = "message" if "role" in item else item.get("type")  # a message's type may be implied
    said["text"] = _text(item.get("content"))
    digest = hashlib.sha256(json.dumps(said, sort_keys=True).encode()).digest()
    size = sizes.of(item) if sizes is not None else None
    if size is None:
        return [2 + b for b in digest[: 3 + digest[0] % 4]]
    return list(_drawn(digest, size))


@functools.lru_cache(maxsize=4096)
def _drawn(digest: bytes, n: int) -> tuple[int, ...]:
    draw = random.Random(digest)
    return tuple(2 + draw.randrange(VOCAB - 2) for _ in range(n))


@functools.lru_cache(maxsize=64)
def _log_probs(n: int) -> list[float]:
    """A float32 log probability per token, as a model server returns them (written with their 17
    digits), most of them near zero as a confident model's are."""
    draw = random.Random(n)
    return [struct.unpack("f", struct.pack("f", -draw.expovariate(4.0)))[0] for _ in range(n)]


def _routes(n: int) -> list[list[list[int]]]:
    """Each generated token's router choice: one MoE layer, two experts of 8."""
    return [[[i % 8, (i + 3) % 8]] for i in range(n)]


@functools.lru_cache(maxsize=64)
def routes_envelope(n: int) -> str:
    """`_routes(n)` as NeMo RL's `nrlre1` envelope: dtype, shape, then the C-ordered int16 array in
    base64."""
    flat = [e for token in _routes(n) for layer in token for e in layer]
    return f"nrlre1:int16:{n}x1x2:" + base64.b64encode(struct.pack(f"<{len(flat)}h", *flat)).decode()


def token_fields(prompt: list[int], generated: list[int], envelope: bool = False) -> dict[str, Any]:
    n = len(generated)
    return {
        "prompt_token_ids": prompt,
        "generation_token_ids": generated,
        "generation_log_probs": [-0.25 * (i + 1) for i in range(n)] if n < 16 else _log_probs(n),
        "routed_experts": routes_envelope(n) if envelope else _routes(n),
    }


def answer(
    body: dict[str, Any], call: int, sizes: Sizes | None = None, envelope: bool = False
) -> dict[str, Any]:
    given = body.get("input")
    items = given if isinstance(given, list) else [{"role": "user", "content": given or ""}]
    prompt = [1] + [t for i in items if isinstance(i, dict) for t in render(i, sizes)]
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
    item |= token_fields(prompt, render(item, sizes), envelope)
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


def build(fail_every: int, sizes: Sizes | None = None, envelope: bool = False) -> FastAPI:
    app = FastAPI()
    calls = itertools.count(1)
    answered = [0]

    @app.get("/")
    async def liveness() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/stats")
    async def stats() -> dict[str, int]:
        """Model calls answered so far (a benchmark counts a run's calls a rollout)."""
        return {"calls": answered[0]}

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        call = next(calls)
        if fail_every and call % fail_every == 0:
            return JSONResponse({"error": "stub model failure (injected)"}, status_code=500)
        # orjson: the stub's own cost stays small beside the agent's at real sizes.
        body = orjson.dumps(answer(orjson.loads(await request.body()), call, sizes, envelope))
        answered[0] += 1
        return Response(body, media_type="application/json")

    return app


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--fail-every", type=int, default=0)
    parser.add_argument("--prompt-tokens", type=int, default=0, help="A user's message's tokens.")
    parser.add_argument(
        "--gen-tokens", type=int, default=0, help="Tokens generated over a rollout's two calls."
    )
    parser.add_argument(
        "--routes",
        choices=("lists", "envelope"),
        default="lists",
        help="routed_experts as nested lists, or as NeMo RL's nrlre1 envelope.",
    )
    args = parser.parse_args()
    sized = Sizes(args.prompt_tokens, max(1, args.gen_tokens // 2)) if args.gen_tokens else None
    uvicorn.run(
        build(args.fail_every, sized, args.routes == "envelope"),
        host="127.0.0.1",
        port=args.port,
        log_level="warning",
    )
