"""The trainer's HTTP hand-off, side by side: httpx's own pool against the client's lean transport.

One reference agent (a subprocess, `--zero-work`) serves every variant in turn; each variant plays
the same number of tries, each try being the three calls the trainer makes (`POST /run`,
`GET /completion_receipt`, `GET /token_capture`), with CONCURRENCY tries in flight (the trainer
keeps ~130).  Reported: tries/s and CPU per try, of this process and of the agent.

    python -m benchmarks.gym_client                  # 3,000 tries x 3 variants, 128 in flight
    python -m benchmarks.gym_client --tries 500 --concurrency 8
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

from gym_agent.launcher import AgentProcess
from protocol.wire import RunRequest
from trainer.gym import GymClient
from trainer.gym.transport import LeanTransport

_ids = itertools.count()
PlayAttempt = Callable[[str], Awaitable[None]]


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def request_body(rollout_id: str) -> dict[str, Any]:
    return RunRequest(
        rollout_id=rollout_id,
        attempt_index=0,
        responses_create_params={"input": [{"role": "user", "content": "2+2?"}]},
        task={"sample_id": "s", "task_name": "arith"},
    ).model_dump(mode="json", by_alias=True)


def with_httpx(client: httpx.AsyncClient) -> PlayAttempt:
    """The three calls on an `httpx.AsyncClient` (JSON decoded, no model validation)."""

    async def play(rollout_id: str) -> None:
        (await client.post("/run", json=request_body(rollout_id))).raise_for_status()
        receipt = (await client.get(f"/completion_receipt/{rollout_id}/0")).json()
        (await client.get(f"/token_capture/{receipt['manifest_capture_key']}")).raise_for_status()

    return play


def with_gym_client(client: GymClient) -> PlayAttempt:
    """The trainer's own client: the lean transport called directly, every reply validated."""

    async def play(rollout_id: str) -> None:
        await client.run(RunRequest.model_validate(request_body(rollout_id)))
        receipt = await client.completion_receipt(rollout_id, 0)
        await client.token_capture(receipt.manifest_capture_key)

    return play


async def measure(play: PlayAttempt, agent_pid: int, tries: int, concurrency: int) -> dict[str, float]:
    gate = asyncio.Semaphore(concurrency)

    async def one() -> None:
        async with gate:
            await play(f"bench{next(_ids)}")

    await asyncio.gather(*(one() for _ in range(min(50, tries))))  # warm: connections, caches
    cpu0, agent0, t0 = time.process_time(), cpu_s(agent_pid), time.perf_counter()
    await asyncio.gather(*(one() for _ in range(tries)))
    wall = time.perf_counter() - t0
    return {
        "attempts_per_s": tries / wall,
        "client_ms": 1000 * (time.process_time() - cpu0) / tries,
        "agent_ms": 1000 * (cpu_s(agent_pid) - agent0) / tries,
    }


async def main(args: argparse.Namespace) -> list[tuple[str, dict[str, float]]]:
    agent = AgentProcess("bench", turns=(1, 1), extra_args=["--zero-work", "--log-level", "warning"])
    await asyncio.to_thread(agent.start)
    assert agent.pid is not None
    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=1024)
    variants: list[tuple[str, Callable[[], tuple[PlayAttempt, Callable[[], Awaitable[None]]]]]] = [
        (
            "httpx.AsyncClient, httpx's pool (baseline)",
            lambda: _pair(httpx.AsyncClient(base_url=agent.url, limits=limits)),
        ),
        (
            "httpx.AsyncClient on LeanTransport",
            lambda: _pair(httpx.AsyncClient(base_url=agent.url, transport=LeanTransport())),
        ),
        ("GymClient (LeanTransport.exchange)", lambda: _gym(GymClient(agent.url, "bench"))),
    ]
    rows = []
    try:
        for name, make in variants:
            play, close = make()
            try:
                rows.append((name, await measure(play, agent.pid, args.tries, args.concurrency)))
            finally:
                await close()
    finally:
        await asyncio.to_thread(agent.close)
    return rows


def _pair(client: httpx.AsyncClient) -> tuple[PlayAttempt, Callable[[], Awaitable[None]]]:
    return with_httpx(client), client.aclose


def _gym(client: GymClient) -> tuple[PlayAttempt, Callable[[], Awaitable[None]]]:
    return with_gym_client(client), client.aclose


def render(rows: list[tuple[str, dict[str, float]]], args: argparse.Namespace) -> None:
    table = Table(
        title=f"{args.tries} tries (run + receipt + tokens), {args.concurrency} in flight, one zero-work agent"
    )
    for col in ("client", "tries/s", "client CPU ms/try", "agent CPU ms/try", "client CPU vs baseline"):
        table.add_column(col, justify="left" if col == "client" else "right")
    base = rows[0][1]["client_ms"]
    for name, r in rows:
        table.add_row(
            name,
            f"{r['attempts_per_s']:.0f}",
            f"{r['client_ms']:.2f}",
            f"{r['agent_ms']:.2f}",
            f"{base / r['client_ms']:.1f}x less" if r is not rows[0][1] else "1.0x",
        )
    Console().print(table)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--tries", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=128)
    arguments = parser.parse_args()
    render(asyncio.run(main(arguments)), arguments)
