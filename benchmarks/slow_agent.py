"""A slow Gym agent for client benchmarks: each `/run` is held open a while, as real environments are.

It answers the three calls the trainer makes per try with bodies that pass the wire models
(`RunReply`, `CompletionReceipt`, a `TokenEntry` list), from templates built once, so the agent's
own CPU stays small beside the client's.  Its HTTP is framed by hand: this is a load generator,
not a server anyone should reuse (it trusts its one client).

    python -m benchmarks.slow_agent --port 8123 --hold-s 2.0

prints `ready` on stdout once it listens; stops on SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import resource
import signal
from typing import cast

from protocol.digests import reply_digest
from protocol.wire import ALL_FEATURES, Capabilities, CompletionReceipt, RunReply, TokenEntry
from trainer.eventloop import run_async

_RID = "ridplaceholder0"


def _templates() -> tuple[str, str, str]:
    reply = RunReply(
        rollout_id=_RID,
        attempt_index=0,
        responses_create_params={"input": [{"role": "user", "content": "2+2?"}]},
        task={"sample_id": "s", "task_name": "arith"},
        id=f"resp_{_RID}",
        response={"output": [{"type": "message", "content": [{"type": "output_text", "text": "4"}]}]},
        reward=1.0,
        mask_sample=False,
    ).model_dump(mode="json", by_alias=True)
    receipt = CompletionReceipt(
        rollout_id=_RID,
        attempt_index=0,
        execution_generation=1,
        execution_incarnation="b" * 32,
        result_identity=f"resp_{_RID}",
        result_digest=reply_digest(reply),
        manifest_capture_key=_RID,
        terminal_model_call_id="call0",
    ).model_dump(mode="json", by_alias=True)
    tokens = [
        TokenEntry(
            rollout_id=_RID,
            model_call_id="call0",
            model="policy",
            prompt_token_ids=list(range(64)),
            generation_token_ids=list(range(16)),
            generation_log_probs=[-0.5] * 16,
            output_items=[{"type": "message", "content": [{"type": "output_text", "text": "4"}]}],
            token_item_index=0,
            created_at=0.0,
        ).model_dump(mode="json", by_alias=True)
    ]
    return json.dumps(reply), json.dumps(receipt), json.dumps(tokens)


RUN, RECEIPT, TOKENS = _templates()
# A participant's answer: `GymClient` (agent name "bench") then fetches receipts and token records
# over HTTP, as against a real ledger-aware agent, instead of making them itself (reduced mode).
CAPABILITIES = Capabilities(
    agent_name="bench", execution_incarnation="b" * 32, features=list(ALL_FEATURES)
).model_dump_json()


def _answer(body: str) -> bytes:
    data = body.encode()
    head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(data)
    return head + data


class _Agent(asyncio.Protocol):
    def __init__(self, hold_s: float) -> None:
        self.hold_s = hold_s
        self.buffer = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while (end := self.buffer.find(b"\r\n\r\n")) >= 0:
            head = self.buffer[:end]
            length = 0
            at = head.lower().find(b"content-length:")
            if at >= 0:
                length = int(head[at + 15 :].split(b"\r\n", 1)[0])
            if len(self.buffer) < end + 4 + length:
                return
            body = self.buffer[end + 4 : end + 4 + length]
            self.buffer = self.buffer[end + 4 + length :]
            self._route(head.split(b" ", 2)[1].decode(), body)

    def _route(self, path: str, body: bytes) -> None:
        assert self.transport is not None
        if path == "/run":
            rid = json.loads(body)["_ng_rollout_id"]
            # Held for 0.5x..1.5x the mean: tries that started together do not all end together.
            hold = self.hold_s * (0.5 + random.random())
            asyncio.get_running_loop().call_later(hold, self._send, _answer(RUN.replace(_RID, rid)))
        elif path.startswith("/completion_receipt/"):
            self._send(_answer(RECEIPT.replace(_RID, path.split("/")[2])))
        elif path.startswith("/token_capture/"):
            self._send(_answer(TOKENS.replace(_RID, path.split("/")[2])))
        elif path == "/capabilities":
            self._send(_answer(CAPABILITIES))
        else:
            self._send(b"HTTP/1.1 404 Not Found\r\ncontent-length: 2\r\n\r\n{}")

    def _send(self, data: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)


def raise_fd_limit() -> int:
    """Raises this process's open-file limit to its hard limit (16,384 sockets need more than 1,024)."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


async def serve(host: str, port: int, hold_s: float) -> None:
    raise_fd_limit()
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _Agent(hold_s), host, port, backlog=4096)
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    print("ready", flush=True)
    await stop.wait()
    server.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--hold-s", type=float, required=True, help="mean time each /run is held open")
    args = parser.parse_args()
    run_async(serve(args.host, args.port, args.hold_s))
