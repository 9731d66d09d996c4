"""The trainer's HTTP hand-off at 128, 1,024 and 16,384 tries in flight: aiohttp, httpx and ours.

Each try is the three calls the trainer makes (`POST /run`, `GET /completion_receipt`,
`GET /token_capture`) against a slow agent (`benchmarks/slow_agent.py`, its own process) that holds
each `/run` open for 0.5x..1.5x a mean hold, as real environments do.  The mean hold grows with the
concurrency (`concurrency / --rate`, at least `--min-hold-s`) so every run offers about the same
tries per second and the box is not the bottleneck.  Tries start staggered over one hold, and every
finished try starts the next one, so the number in flight stays at the concurrency.

Every client variant runs in a fresh process of its own (against a fresh agent), so its CPU, its
memory and its event loop's lag are its own:

- client CPU per try: the client process's user+system CPU over the run, divided by tries done;
- event-loop lag: how late a 10 ms ticker on the client's loop wakes up, p50 and p99;
- memory: the client process's peak RSS (interpreter and imports included).

The rows doing the same work are aiohttp's `ClientSession`, httpx's `AsyncClient` (its own pool) and
`LeanTransport.exchange` (ours): the same request bytes, each reply's JSON decoded.  `GymClient` is
the trainer's real call path on `LeanTransport`: it also builds the request model and validates every
reply against its wire model.  A variant that has not finished within its budget is stopped and
reported with the tries it did.

    python -m benchmarks.gym_client                                  # 128, 1,024, 16,384 in flight
    python -m benchmarks.gym_client --concurrency 128 --min-tries 500  # a quick look
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import resource
import select
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

from rich.console import Console
from rich.table import Table

from benchmarks.slow_agent import raise_fd_limit
from gym_agent.launcher import free_port
from protocol.wire import RunRequest
from trainer.eventloop import run_async
from trainer.gym import GymClient
from trainer.gym.transport import LeanTransport, Timeouts

HOST = "127.0.0.1"
VARIANTS = {
    "aiohttp": "aiohttp.ClientSession (baseline)",
    "httpx": "httpx.AsyncClient, httpx's pool",
    "lean": "LeanTransport.exchange (ours)",
    "gym": "GymClient on LeanTransport (+ wire models)",
}
LAG_TICK_S = 0.01
PARAMS = {"input": [{"role": "user", "content": "2+2?"}]}
TASK = {"sample_id": "s", "task_name": "arith"}

Play = Callable[[str], Awaitable[None]]
Close = Callable[[], Awaitable[None]]


def run_body(rollout_id: str) -> bytes:
    request = {
        "_ng_rollout_id": rollout_id,
        "_ng_attempt_index": 0,
        "responses_create_params": PARAMS,
        **TASK,
    }
    return json.dumps(request).encode()


def _expect(status: int, body: bytes | bytearray) -> Any:
    if status != 200:
        raise RuntimeError(f"HTTP {status}: {bytes(body[:200])!r}")
    return json.loads(body)


# -- the variants (each: play one try, close) -------------------------------------------------------


def with_aiohttp(url: str, concurrency: int) -> tuple[Play, Close]:
    import aiohttp

    session = aiohttp.ClientSession(
        base_url=url,
        connector=aiohttp.TCPConnector(limit=concurrency, limit_per_host=concurrency),
        timeout=aiohttp.ClientTimeout(total=None),
    )
    json_header = {"Content-Type": "application/json"}

    async def play(rid: str) -> None:
        async with session.post("/run", data=run_body(rid), headers=json_header) as r:
            _expect(r.status, await r.read())
        async with session.get(f"/completion_receipt/{rid}/0") as r:
            key = _expect(r.status, await r.read())["manifest_capture_key"]
        async with session.get(f"/token_capture/{key}") as r:
            _expect(r.status, await r.read())

    return play, session.close


def with_httpx(url: str, concurrency: int) -> tuple[Play, Close]:
    import httpx

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    client = httpx.AsyncClient(base_url=url, limits=limits, timeout=None)
    json_header = {"Content-Type": "application/json"}

    async def play(rid: str) -> None:
        r = await client.post("/run", content=run_body(rid), headers=json_header)
        _expect(r.status_code, r.content)
        r = await client.get(f"/completion_receipt/{rid}/0")
        key = _expect(r.status_code, r.content)["manifest_capture_key"]
        r = await client.get(f"/token_capture/{key}")
        _expect(r.status_code, r.content)

    return play, client.aclose


def with_lean(url: str, concurrency: int) -> tuple[Play, Close]:
    transport = LeanTransport(max_connections=concurrency)
    port = int(url.rsplit(":", 1)[1])
    origin = ("http", HOST, port)
    host = [(b"Host", f"{HOST}:{port}".encode()), (b"Accept", b"application/json")]
    no_body = [*host, (b"Content-Length", b"0")]
    timeouts = Timeouts()

    async def play(rid: str) -> None:
        body = run_body(rid)
        post = [*host, (b"Content-Type", b"application/json"), (b"Content-Length", str(len(body)).encode())]
        r = await transport.exchange("POST", origin, b"/run", post, body, timeouts)
        _expect(r.status, r.body)
        target = f"/completion_receipt/{rid}/0".encode()
        r = await transport.exchange("GET", origin, target, no_body, b"", timeouts)
        key = _expect(r.status, r.body)["manifest_capture_key"]
        r = await transport.exchange("GET", origin, f"/token_capture/{key}".encode(), no_body, b"", timeouts)
        _expect(r.status, r.body)

    return play, transport.aclose


def with_gym_client(url: str, concurrency: int) -> tuple[Play, Close]:
    client = GymClient(url, "bench", max_run_connections=concurrency)

    async def play(rid: str) -> None:
        request = RunRequest(rollout_id=rid, attempt_index=0, responses_create_params=PARAMS, **TASK)
        await client.run(request)
        receipt = await client.completion_receipt(rid, 0)
        await client.token_capture(receipt.manifest_capture_key)

    return play, client.aclose


MAKERS: dict[str, Callable[[str, int], tuple[Play, Close]]] = {
    "aiohttp": with_aiohttp,
    "httpx": with_httpx,
    "lean": with_lean,
    "gym": with_gym_client,
}


# -- one variant, in its own process ------------------------------------------------------------------


async def _sample_lag(samples: list[float], stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    while not stop.is_set():
        start = loop.time()
        await asyncio.sleep(LAG_TICK_S)
        samples.append(loop.time() - start - LAG_TICK_S)


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def run_client(
    variant: str, url: str, concurrency: int, tries: int, hold_s: float, budget_s: float
) -> dict[str, Any]:
    raise_fd_limit()
    play, close = MAKERS[variant](url, concurrency)
    ids = itertools.count()
    done = errors = 0
    first_error = ""

    async def worker() -> None:
        nonlocal done, errors, first_error
        await asyncio.sleep(random.random() * hold_s)  # staggered start: a steady stream, not a wave
        while (n := next(ids)) < tries:
            try:
                await play(f"bench{n}")
                done += 1
            except Exception as exc:  # counted and reported: a failed try is a result here
                errors += 1
                first_error = first_error or f"{type(exc).__name__}: {exc}"[:200]

    lags: list[float] = []
    stop = asyncio.Event()
    sampler = asyncio.create_task(_sample_lag(lags, stop))
    cpu0, t0 = _cpu_s(), time.perf_counter()
    workers = [asyncio.create_task(worker()) for _ in range(concurrency)]
    _, pending = await asyncio.wait(workers, timeout=budget_s)
    finished = not pending
    wall = time.perf_counter() - t0
    cpu = _cpu_s() - cpu0
    stop.set()
    await sampler
    if finished:
        await close()
    # else: the process ends right after reporting; closing thousands of stuck calls measures nothing.
    quantiles = statistics.quantiles(lags, n=100) if len(lags) >= 2 else [0.0] * 99
    return {
        "variant": variant,
        "concurrency": concurrency,
        "hold_s": hold_s,
        "tries": tries,
        "done": done,
        "errors": errors,
        "first_error": first_error,
        "finished": finished,
        "wall_s": wall,
        "tries_per_s": done / wall,
        "cpu_ms_per_try": 1000 * cpu / max(done, 1),
        "lag_p50_ms": 1000 * quantiles[49],
        "lag_p99_ms": 1000 * quantiles[98],
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


# -- the orchestrator -----------------------------------------------------------------------------


def _wait_ready(agent: subprocess.Popen[str], timeout_s: float) -> None:
    assert agent.stdout is not None
    ready, _, _ = select.select([agent.stdout], [], [], timeout_s)
    if not ready or agent.stdout.readline().strip() != "ready":
        agent.kill()
        raise RuntimeError("the slow agent did not start")


def measure(variant: str, concurrency: int, args: argparse.Namespace) -> dict[str, Any]:
    hold_s = max(args.min_hold_s, concurrency / args.rate)
    tries = max(args.min_tries, args.rounds * concurrency)
    expected_s = hold_s + tries / (concurrency / hold_s)
    budget_s = args.budget_factor * expected_s + 30
    port = free_port(HOST)
    agent = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.slow_agent", "--port", str(port), "--hold-s", str(hold_s)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        _wait_ready(agent, 30)
        command = [
            sys.executable, "-m", "benchmarks.gym_client", "--client", variant,
            "--url", f"http://{HOST}:{port}", "--concurrency", str(concurrency), "--tries", str(tries),
            "--hold-s", str(hold_s), "--budget-s", str(budget_s),
        ]  # fmt: skip
        try:
            out = subprocess.run(command, capture_output=True, text=True, timeout=budget_s + 60, check=True)
        except subprocess.TimeoutExpired:
            # The client's loop did not even get to stop itself: a row that says so, nothing measured.
            return {"variant": variant, "concurrency": concurrency, "hold_s": hold_s, "tries": tries,
                    "stuck": True}  # fmt: skip
        result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
        return result
    finally:
        agent.terminate()
        try:
            agent.wait(10)
        except subprocess.TimeoutExpired:
            agent.kill()


def render(rows: list[dict[str, Any]]) -> None:
    console = Console(width=180)
    for concurrency in sorted({r["concurrency"] for r in rows}):
        group = [r for r in rows if r["concurrency"] == concurrency]
        first = group[0]
        table = Table(
            title=f"{concurrency:,} tries in flight, /run held {first['hold_s']:.2f} s on average, "
            f"{first['tries']:,} tries per client"
        )
        columns = ("client", "tries done", "tries/s", "client CPU ms/try", "vs aiohttp",
                   "loop lag p50 ms", "loop lag p99 ms", "peak RSS MiB", "errors")  # fmt: skip
        for col in columns:
            table.add_column(col, justify="left" if col == "client" else "right")
        base = next((r["cpu_ms_per_try"] for r in group if r["variant"] == "aiohttp"), None)
        for r in group:
            if r.get("stuck"):
                table.add_row(VARIANTS[r["variant"]], "not stopped", *["-"] * (len(columns) - 2))
                continue
            done = f"{r['done']:,}" + ("" if r["finished"] else " (budget out)")
            ratio = f"{r['cpu_ms_per_try'] / base:.2f}x" if base else "-"
            table.add_row(
                VARIANTS[r["variant"]],
                done,
                f"{r['tries_per_s']:.0f}",
                f"{r['cpu_ms_per_try']:.3f}",
                ratio,
                f"{r['lag_p50_ms']:.1f}",
                f"{r['lag_p99_ms']:.1f}",
                f"{r['peak_rss_mib']:.0f}",
                f"{r['errors']}" + (f" ({r['first_error']})" if r["errors"] else ""),
            )
        console.print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[128, 1024, 16384])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--rate", type=float, default=500.0, help="offered tries/s (sets the hold)")
    parser.add_argument("--min-hold-s", type=float, default=0.5)
    parser.add_argument("--rounds", type=int, default=2, help="tries per client = rounds x concurrency")
    parser.add_argument("--min-tries", type=int, default=2000)
    parser.add_argument("--budget-factor", type=float, default=2.0)
    parser.add_argument("--json", help="also write the rows to this file")
    # The child-process mode: one variant, one concurrency; prints one JSON line.
    parser.add_argument("--client", choices=list(VARIANTS), help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--tries", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--hold-s", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--budget-s", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client:
        result = run_async(
            run_client(args.client, args.url, args.concurrency[0], args.tries, args.hold_s, args.budget_s)
        )
        print(json.dumps(result), flush=True)
        os._exit(0)  # no teardown of whatever a stuck variant left behind
    rows = []
    for concurrency in args.concurrency:
        for variant in args.variants:
            rows.append(measure(variant, concurrency, args))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    render(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
