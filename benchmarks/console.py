"""Benchmark: `ledger console` on a long log, beside `ledger status` on the same log, in one run.

    python -m benchmarks.soak --db URL --groups 17000      # about 1,000,000 events (PostgreSQL)
    python -m benchmarks.console --db URL [--requests 30] [--json FILE]

On one log (give `--db` a log a soak wrote; the benchmark appends a few `TrainerEpochTaken` events of
its own trainer `console-bench` to time the live overview, and stores projection checkpoints):

- `ledger status`, as a user runs it (a process: wall time, peak RSS), from scratch and then from the
  projection checkpoint `ledger projections run --once` stores;
- the console's start, the same two ways: from the process's start to the overview live at the head
  (what it folded, its RSS);
- each page's server time (`Server-Timing`), `--requests` times each: p50, p95, max;
- the live overview: an event appended, then the console's event stream showing the new head
  (latency p50, p95), one append every half second;
- the fold's cost per event over 100,000 events from position 0, and over as many from the
  projection checkpoint nearest below the head less that (a console on this log folding what is
  appended), and the overview's build and render after each: their ratios say whether they depend on
  the log's length (in this process);
- the console's RSS after catching up and after every request (bounded: its growth).

Speed figures depend on the machine and how busy it is: compare the ratios within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

from console import Console as Shell
from console import ConsoleConfig, LiveFold
from eventstore import EventStore, open_store
from eventstore.events import (
    CheckpointPrepareStarted,
    GroupClaimedForTraining,
    LogprobsComputed,
    SiblingSealed,
    TrainerEpochTaken,
)
from eventstore.read_ahead import PAGE_SIZE
from projections.generation import GENERATION_EVENTS, generation_figures
from projections.runner import default_projections, latest_common_checkpoint, load_replay
from protocol.streams import trainer_stream

out = Console(width=140)
LEDGER = [sys.executable, "-m", "cli.main"]
ROOT = Path(__file__).parents[1]
BENCH_TRAINER = "console-bench"
# Appends timed through the live overview.
LIVE_APPENDS = 20
START_BOUND_S = 1800.0


def _rss_kib(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) of a process, KiB."""
    text = Path(f"/proc/{pid}/status").read_text()
    rss = int(re.search(r"VmRSS:\s+(\d+)", text).group(1))  # type: ignore[union-attr]
    peak = int(re.search(r"VmHWM:\s+(\d+)", text).group(1))  # type: ignore[union-attr]
    return rss, peak


def _percentiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    p95 = ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]
    return {"p50": statistics.median(ordered), "p95": p95, "max": ordered[-1], "n": len(ordered)}


@dataclass
class Result:
    log: str
    head: int
    cpus: int | None
    load_before: tuple[float, float, float]
    status: dict[str, Any] = field(default_factory=dict)
    console_start: dict[str, Any] = field(default_factory=dict)
    pages: dict[str, dict[str, float]] = field(default_factory=dict)
    live: dict[str, float] = field(default_factory=dict)
    fold: dict[str, Any] = field(default_factory=dict)
    memory: dict[str, Any] = field(default_factory=dict)
    ratios: dict[str, float] = field(default_factory=dict)
    load_after: tuple[float, float, float] = (0.0, 0.0, 0.0)


# --- ledger status ---------------------------------------------------------------------


def time_status(url: str, runs: int) -> dict[str, Any]:
    walls = []
    for _ in range(runs):
        started = time.perf_counter()
        subprocess.run([*LEDGER, "status", "--db", url], cwd=ROOT, check=True, capture_output=True)
        walls.append(time.perf_counter() - started)
    return {
        "wall_s": _percentiles(walls),
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
    }


# --- the console as a process ----------------------------------------------------------


@contextmanager
def console_process(url: str) -> Iterator[tuple[subprocess.Popen[str], str, float]]:
    """`ledger console --port 0`; yields (process, its URL, seconds until the overview was live at the head)."""
    started = time.perf_counter()
    process = subprocess.Popen(
        [*LEDGER, "console", "--db", url, "--port", "0"], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        where = line.split()[2]
        deadline = time.monotonic() + START_BOUND_S
        with httpx.Client(timeout=120) as http:
            while time.monotonic() < deadline:
                html = http.get(where + "overview").text
                if 'id="updated"' in html and "catching-up" not in html and 'id="loading"' not in html:
                    break
                time.sleep(0.2)
        yield process, where, time.perf_counter() - started
    finally:
        process.terminate()
        process.wait(60)


def pages_of(store: EventStore, head: int) -> dict[str, str]:
    """The pages timed: each view on ids found near the start and near the head of the log."""

    def first(types: list[str], after: int) -> Any:
        for event in store.read_all(after, types=types, batch_size=100):
            return event.decode()
        return None

    early_seal = first([SiblingSealed.event_type()], 0)
    late_seal = first([SiblingSealed.event_type()], max(0, head - 20_000))
    checkpoint = first([CheckpointPrepareStarted.event_type()], max(0, head - 50_000))
    claim = first([GroupClaimedForTraining.event_type()], max(0, head - 20_000))
    scored = first([LogprobsComputed.event_type()], 0)
    late = late_seal.rollout_id
    pages = {
        "overview": "/",
        "overview fragment": "/overview",
        "groups": "/groups",
        "groups, sealed": "/groups?status=sealed",
        "groups, claimed, page 100": "/groups?status=claimed&page=100",
        "groups, agent, last 10 min": "/groups?agent=agent-0&since=10m",
        "groups, id contains": "/groups?q=p12",
        "group, early": f"/groups/{early_seal.rollout_id.rpartition('_g')[0]}",
        "group, late": f"/groups/{late.rpartition('_g')[0]}",
        "rollout, early": f"/rollouts/{early_seal.rollout_id}",
        "rollout, late": f"/rollouts/{late}",
        "rollout, late, 100 px/s": f"/rollouts/{late}?zoom=100",
        "payloads decoded": f"/rollouts/{late}/tries/{late_seal.attempt_index}/payloads",
        "checkpoints": "/checkpoints",
        "checkpoints, page 5": "/checkpoints?page=5",
        "event": f"/events/{head // 2}",
        "steps": "/steps",
        "audit": "/audit",
    }
    if checkpoint is not None:
        pages["checkpoint"] = f"/checkpoints/{checkpoint.checkpoint_id}"
    if claim is not None and claim.train_step is not None:
        pages["train step"] = f"/steps/{claim.train_step}"
    if scored is not None:
        pages["payloads with worker logprobs"] = (
            f"/rollouts/{scored.rollout_id}/tries/{scored.attempt_index}/payloads"
        )
    return pages


def time_pages(
    where: str, pages: dict[str, str], requests: int, pid: int
) -> tuple[dict[str, dict[str, float]], list[int]]:
    timings: dict[str, list[float]] = {name: [] for name in pages}
    rss: list[int] = []
    with httpx.Client(base_url=where.rstrip("/"), timeout=120) as http:
        for _ in range(requests):
            for name, path in pages.items():
                answer = http.get(path)
                answer.raise_for_status()
                timing = answer.headers["server-timing"]
                timings[name].append(float(timing.partition("dur=")[2]))
            rss.append(_rss_kib(pid)[0])
    return {name: _percentiles(values) for name, values in timings.items()}, rss


def time_live(where: str, writer: EventStore) -> dict[str, float]:
    """Appends one event every half second; the latency until the event stream shows its position."""
    seen: list[tuple[float, int]] = []
    stop = threading.Event()

    def listen() -> None:
        try:
            with httpx.Client(timeout=None) as http, http.stream("GET", where + "live") as stream:
                for line in stream.iter_lines():
                    found = re.search(r'id="log-head" data-position="(\d+)"', line)
                    if found:
                        seen.append((time.perf_counter(), int(found.group(1))))
                    if stop.is_set():
                        return
        except httpx.HTTPError:  # the console stopped under it: the appends timed so far stand
            return

    listener = threading.Thread(target=listen, daemon=True)
    listener.start()
    time.sleep(2.0)
    latencies = []
    for i in range(LIVE_APPENDS):
        event = TrainerEpochTaken(trainer_id=BENCH_TRAINER, reason="start", writer=f"benchmarks.console {i}")
        position = writer.append(trainer_stream(BENCH_TRAINER), [event]).positions[0]
        appended = time.perf_counter()
        deadline = appended + 30
        while time.perf_counter() < deadline:
            shown = [at for at, head in list(seen) if head >= position]
            if shown:
                latencies.append(max(0.0, shown[0] - appended))
                break
            time.sleep(0.005)
        time.sleep(0.5)
    stop.set()
    return {f"{k}_s": v for k, v in _percentiles(latencies).items() if k != "n"} | {"appends": len(latencies)}


# --- the fold and the overview, in this process ----------------------------------------


def fold_costs(store: EventStore, url: str, head: int, span: int) -> dict[str, Any]:
    """The fold's cost per event over `span` events from position 0, and over `span` events that
    follow the projection checkpoint nearest below `head - span` (what a console started on this log
    folds as it is appended to); the overview's build and render after each."""
    projections = default_projections()
    out: dict[str, Any] = {"span": span}
    for label in ("early", "late"):
        start = 0
        ledger, checkpoints = projections[0].initial(), projections[1].initial()
        if label == "late":
            start = latest_common_checkpoint(store, projections, head - span) or 0
            if start:
                replay = load_replay(store, projections, start)
                ledger, checkpoints = replay.state("ledger"), replay.state("checkpoints")
        generation = generation_figures(store.read_all(0, start, types=GENERATION_EVENTS))
        fold = LiveFold(ledger, checkpoints, generation, start)
        if label == "late" and not start:  # no projection checkpoint: fold up to the span, untimed
            for page in store.read_pages(0, head - span, batch_size=PAGE_SIZE):
                fold.apply(page)
        begin = fold.position
        seconds = 0.0
        for page in store.read_pages(begin, begin + span, batch_size=PAGE_SIZE):
            t0 = time.perf_counter()
            fold.apply(page)
            seconds += time.perf_counter() - t0
        shell = Shell(store, ConsoleConfig(url=url))
        shell.live.fold = fold
        shell.live.target = fold.position
        out[label] = {
            "from": begin,
            "to": fold.position,
            "us_per_event": 1e6 * seconds / max(1, fold.position - begin),
            "overview_ms": 1000 * statistics.median(_time_overview(shell)),
        }
    return out


def _time_overview(shell: Shell) -> list[float]:
    times = []
    for _ in range(30):
        shell._rendered = None  # render afresh each time
        t0 = time.perf_counter()
        shell.overview_html()
        times.append(time.perf_counter() - t0)
    return times


# --- the run ---------------------------------------------------------------------------


def run(url: str, requests: int, status_runs: int, runner: bool) -> Result:
    store = open_store(url)
    try:
        head = store.head()
        result = Result(log=store.url, head=head, cpus=os.cpu_count(), load_before=os.getloadavg())
        out.print(f"log {store.url}: {head:,} events; load {result.load_before}")
        if latest_common_checkpoint(store, default_projections()) is not None:
            out.print(
                "[yellow]the log holds projection checkpoints: 'from scratch' starts from them[/yellow]"
            )
        result.status["from scratch"] = time_status(url, status_runs)
        out.print(f"ledger status from scratch: {result.status['from scratch']}")
        with console_process(url) as (process, where, seconds):
            rss, peak = _rss_kib(process.pid)
            result.console_start["from scratch"] = {
                "live_s": seconds,
                "rss_mib": rss / 1024,
                "peak_rss_mib": peak / 1024,
            }
            out.print(f"console start from scratch: {result.console_start['from scratch']}")
        if runner:
            subprocess.run(
                [*LEDGER, "projections", "run", "--db", url, "--once"],
                cwd=ROOT,
                check=True,
                capture_output=True,
            )
            result.status["from a projection checkpoint"] = time_status(url, status_runs)
            out.print(f"ledger status from a checkpoint: {result.status['from a projection checkpoint']}")
        with console_process(url) as (process, where, seconds):
            rss, peak = _rss_kib(process.pid)
            key = "from a projection checkpoint" if runner else "again"
            result.console_start[key] = {
                "live_s": seconds,
                "rss_mib": rss / 1024,
                "peak_rss_mib": peak / 1024,
            }
            out.print(f"console start {key}: {result.console_start[key]}")
            result.pages, rss_series = time_pages(where, pages_of(store, head), requests, process.pid)
            result.live = time_live(where, store)
            after, peak = _rss_kib(process.pid)
            result.memory = {
                "rss_after_start_mib": rss / 1024,
                "rss_after_first_round_mib": rss_series[0] / 1024,
                "rss_after_requests_mib": rss_series[-1] / 1024,
                "rss_after_live_mib": after / 1024,
                "peak_rss_mib": peak / 1024,
                "growth_over_requests_pct": 100 * (rss_series[-1] - rss_series[0]) / rss_series[0],
            }
        result.fold = fold_costs(store, url, head, min(100_000, head // 4))
        worst = max(p["p95"] for p in result.pages.values())
        status_ms = 1000 * result.status["from scratch"]["wall_s"]["p50"]
        early, late = result.fold["early"], result.fold["late"]
        result.ratios = {
            "worst_page_p95_ms_over_status_ms": worst / status_ms,
            "fold_cost_late_over_early": late["us_per_event"] / early["us_per_event"],
            "overview_late_over_early": late["overview_ms"] / early["overview_ms"],
            "console_peak_rss_over_status_peak_rss": result.console_start["from scratch"]["peak_rss_mib"]
            / result.status["from scratch"]["peak_rss_mib"],
        }
        result.load_after = os.getloadavg()
        return result
    finally:
        store.close()


def report(r: Result) -> None:
    table = Table(
        title=f"ledger console on {r.head:,} events ({r.log}; {r.cpus} CPUs, load {r.load_before[0]:.1f})"
    )
    table.add_column("page")
    for col in ("p50 ms", "p95 ms", "max ms"):
        table.add_column(col, justify="right")
    for name, p in r.pages.items():
        table.add_row(name, f"{p['p50']:.1f}", f"{p['p95']:.1f}", f"{p['max']:.1f}")
    out.print(table)
    for title, data in (
        ("ledger status", r.status),
        ("console start", r.console_start),
        ("live overview (append -> pushed)", r.live),
        ("fold and overview", r.fold),
        ("memory", r.memory),
        ("ratios", r.ratios),
    ):
        out.print(f"[bold]{title}[/bold]: {json.dumps(data, default=float)}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--db", required=True, help="The log (a soak's: python -m benchmarks.soak --db URL).")
    parser.add_argument("--requests", type=int, default=30, help="Requests of each page.")
    parser.add_argument("--status-runs", type=int, default=3)
    parser.add_argument(
        "--no-runner",
        dest="runner",
        action="store_false",
        help="Do not store projection checkpoints in the log.",
    )
    parser.add_argument("--json", dest="as_json", default=None)
    args = parser.parse_args()
    result = run(args.db, args.requests, args.status_runs, args.runner)
    report(result)
    if args.as_json:
        Path(args.as_json).write_text(json.dumps(asdict(result), indent=2, default=float))


if __name__ == "__main__":
    main()
