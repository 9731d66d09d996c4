"""Soak: `ledger simulate` on PostgreSQL, many groups, a fault mix, checkpoints every few seconds.

The agents' own work is set to zero (`--zero-work`: no model runs; each model call's tokens are drawn
at its size), so what is measured is the hand-off through the log: coordinator, HTTP protocol,
appends, payloads.  `--prompt-tokens`, `--gen-tokens` (means the agents draw around) and `--turns`
(model calls per rollout, each sent the whole conversation so far) set the rollouts' size: the
default is the tiny case (8 + 2 tokens, one call); `--prompt-tokens 1000 --gen-tokens 8000` is a
reasoning rollout of 9k tokens.  `--call-seconds MEAN[:SPREAD]` gives each model call a real duration (drawn per
call; the agents heartbeat through it), to measure what checkpoints cost at real durations: the
prepare wait, and the model time they threw away.  Reports throughput (sealed rollouts/s, events/s), prepare wait p50/p99, the
resident memory of the trainer process and of every agent process over time (peak, and the mean of
the first against the last quarter of the workload: flat or growing), each process's CPU (trainer,
each agent, the database), tokens per sealed rollout, the bytes written per sealed rollout to the
events table and to payload storage, and the auditor's verdict.  `--json FILE` writes it all, with
the headline figures (HEADLINE) at the top level.

    python -m benchmarks.soak                       # 2,000 groups x 8 siblings on a throwaway PostgreSQL
    python -m benchmarks.soak --groups 200          # a quick run
    python -m benchmarks.soak --db postgresql+psycopg://...   # an existing (migrated or empty) database
    python -m benchmarks.soak --profile prof.out    # cProfile of the trainer process (pstats file)

Memory is read from /proc/<pid>/status (VmRSS), sampled every `--sample-every` seconds by a thread of
the trainer process; the trainer's samples after the workload (the auditor's full replay) are
reported apart.  Ctrl-C or SIGTERM winds the run down, says so in one line (exit status 130 / 143) and
stops a throwaway cluster.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import json
import os
import pstats
import statistics
import sys
import threading
import time
import tracemalloc
import uuid
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from sqlalchemy import text

from benchmarks.rollout_sizes import add_size_options, positive
from cli.signals import Interrupted, StopRequest, run_until_stopped
from eventstore import EventStore, open_store
from eventstore.backends import mask_url
from eventstore.events import RolloutReceipt
from eventstore.payload_stores import payload_plane
from eventstore.testing import PgCluster
from gym_agent.durations import parse_durations
from gym_agent.launcher import AgentProcess
from payloads import PayloadStoreError, default_payload_url, open_payload_store
from payloads.token_arrays import decode_payload
from protocol.streams import checkpoint_stream, group_stream
from simulation.config import derived_rollout_timeout_s
from simulation.run import RunInterrupted, SimConfig, run_simulation
from trainer.errors import CoordinatorStopped
from trainer.eventloop import heap_trims

DEFAULT_FAULTS = "drop_reply=0.02,fail=0.02,hang=0.005"
TRAINER = "trainer"
# The figures `--json` holds at its top level (the goals are stated in them).
HEADLINE = (
    "sealed_per_s_sustained",
    "trainer_cpu_ms_per_rollout",
    "tokens_per_rollout",
    "events_bytes_per_rollout",
    "payload_bytes_per_rollout",
    "payload_bytes_per_token",
    "trainer_rss_growth_pct",
)
# Token records read back (a seeded sample of sealed rollouts) to count tokens per rollout.
TOKEN_SAMPLE = 200


def rss_kib(pid: int) -> int | None:
    """Resident set size of `pid` in KiB (VmRSS), or None once the process is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


def cpu_s(pid: int, children: bool = False) -> float | None:
    """CPU seconds (user + system) `pid` has used; with `children`, also its reaped children's."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    ticks = int(fields[11]) + int(fields[12])
    if children:
        ticks += int(fields[13]) + int(fields[14])
    return ticks / os.sysconf("SC_CLK_TCK")


def postgres_cpu_s(data_dir: Path) -> float | None:
    """CPU seconds of a PostgreSQL cluster: the postmaster, its reaped children and its live ones."""
    try:
        postmaster = int((data_dir / "postmaster.pid").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    total = cpu_s(postmaster, children=True)
    if total is None:
        return None
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            if ppid == postmaster:
                total += cpu_s(int(entry.name)) or 0.0
    return total


@dataclass
class CpuMeter:
    """CPU seconds each process spent between `start()` and `stop()` (trainer, agents, PostgreSQL)."""

    pids: dict[str, int]
    pg_data: Path | None = None
    used: dict[str, float] = field(default_factory=dict)
    _start: dict[str, float] = field(default_factory=dict)

    def _read(self) -> dict[str, float]:
        now = {name: cpu_s(pid) for name, pid in self.pids.items()}
        if self.pg_data is not None:
            now["postgresql"] = postgres_cpu_s(self.pg_data)
        return {k: v for k, v in now.items() if v is not None}

    def start(self) -> CpuMeter:
        self._start = self._read()
        return self

    def stop(self) -> None:
        end = self._read()
        self.used = {k: round(end[k] - self._start[k], 2) for k in end if k in self._start}


@dataclass
class MemorySampler:
    """A thread that samples the RSS of named processes; `phase` tags each sample (workload/after)."""

    pids: dict[str, int]
    every_s: float = 0.5
    samples: dict[str, list[tuple[float, str, int]]] = field(default_factory=dict)
    phase: str = "workload"
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> MemorySampler:
        self._thread = threading.Thread(target=self._loop, name="rss-sampler", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        started = time.monotonic()
        while not self._stop.is_set():
            now = time.monotonic() - started
            for name, pid in self.pids.items():
                kib = rss_kib(pid)
                if kib is not None:
                    self.samples.setdefault(name, []).append((now, self.phase, kib))
            self._stop.wait(self.every_s)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def report(self, name: str) -> dict[str, Any]:
        rows = self.samples.get(name, [])
        work = [kib for _, phase, kib in rows if phase == "workload"]
        after = [kib for _, phase, kib in rows if phase != "workload"]
        if not work:
            return {"process": name, "samples": 0}
        q = max(1, len(work) // 4)
        first, last = statistics.fmean(work[:q]), statistics.fmean(work[-q:])
        growth = (last - first) / first if first else 0.0
        return {
            "process": name,
            "samples": len(work),
            "start_mib": round(work[0] / 1024, 1),
            "peak_mib": round(max(work) / 1024, 1),
            "first_quarter_mib": round(first / 1024, 1),
            "last_quarter_mib": round(last / 1024, 1),
            "growth_pct": round(100 * growth, 1),
            # Flat: the last quarter within 10 % (or 16 MiB) of the first.
            "flat": last - first <= max(0.10 * first, 16 * 1024),
            "peak_after_mib": round(max(after) / 1024, 1) if after else None,
        }


def checkpoint_waits(store: EventStore, run_id: str) -> tuple[list[float], list[str]]:
    """Every participant's prepare wait of every finished checkpoint of this run, and why any aborted."""
    waits: list[float] = []
    aborts: list[str] = []
    for event in store.read_all(0, types=["CheckpointCommitted", "CheckpointAborted"]):
        if event.stream_id.startswith(checkpoint_stream(run_id)):
            waits.extend(float(v) for v in (event.data.get("prepare_wait_s") or {}).values())
            if event.type == "CheckpointAborted":
                aborts.append(f"{event.data['checkpoint_id']}: {event.data['reason']}")
    return waits, aborts


def percentile(values: list[float], p: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(p / 100 * (len(ordered) - 1))))
    return round(ordered[k], 3)


def count_run_events(store: EventStore, run_id: str) -> tuple[dict[str, int], list[float]]:
    """This run's events by type, and when each of its rollouts was sealed (the writer's clock)."""
    counts: dict[str, int] = {}
    sealed_at: list[float] = []
    for event in store.read_all(0):
        if event.stream_id.startswith((group_stream(run_id), checkpoint_stream(run_id))):
            counts[event.type] = counts.get(event.type, 0) + 1
            if event.type == "SiblingSealed":
                sealed_at.append(event.recorded_at)
    return counts, sealed_at


def sustained_rate(times: list[float], low: float = 0.1, high: float = 0.9) -> float:
    """Events per second between the `low` and `high` quantiles of their times: the steady state,
    without the ramp-up and without the drain (the last groups waiting out a hung try's timeout)."""
    if len(times) < 10:
        return 0.0
    ordered = sorted(times)
    first, last = int(len(ordered) * low), int(len(ordered) * high)
    span = ordered[last] - ordered[first]
    return (last - first) / span if span > 0 else 0.0


@dataclass
class StorageBytes:
    """What the database and the payload store hold: the events table (its rows, and the relation
    with its indexes and TOAST), and the payloads (the log's blob table and the payload store)."""

    events_rows: int
    events_relation: int
    payloads: int
    payload_count: int

    def minus(self, before: StorageBytes) -> StorageBytes:
        return StorageBytes(
            self.events_rows - before.events_rows,
            self.events_relation - before.events_relation,
            self.payloads - before.payloads,
            self.payload_count - before.payload_count,
        )


def storage_bytes(store: EventStore, payload_url: str | None) -> StorageBytes:
    """Bytes on PostgreSQL: each events row as stored (`pg_column_size`, compression included), the
    events relation in all (`pg_total_relation_size`), each payload's length in the blob table and in
    the payload store (its own listing; none yet if it was never written)."""
    with store.read_connection() as conn:
        rows, relation = conn.execute(
            text(
                "SELECT coalesce(sum(pg_column_size(e.*)), 0), pg_total_relation_size('events') FROM events e"
            )
        ).one()
        blobs, blob_count = conn.execute(
            text("SELECT coalesce(sum(octet_length(content)), 0), count(*) FROM blobs")
        ).one()
    stored, count = 0, 0
    if payload_url is not None:
        try:
            payloads = open_payload_store(payload_url)
            try:
                for item in payloads.scan():
                    stored, count = stored + item.size, count + 1
            finally:
                payloads.close()
        except PayloadStoreError:
            pass  # no payload table yet: nothing stored there
    return StorageBytes(int(rows), int(relation), int(blobs) + stored, int(blob_count) + count)


@dataclass(frozen=True)
class TokenSample:
    mean: float  # tokens per sealed rollout over the sample (0.0 when it is empty)
    size: int  # rollouts read back
    pruned: int  # sealed rollouts of the run left out: retention removed their token records


def sealed_tokens(store: EventStore, run_id: str, sample: int = TOKEN_SAMPLE) -> TokenSample:
    """Mean tokens (every model call's prompt, counted whole, and its generation) per sealed rollout
    of this run, over a seeded sample of at most `sample` of them, read back through the payload
    plane by their receipts' claims.  A rollout whose token records `ledger payloads prune` removed
    while the soak ran (recorded in the log, `PayloadsPruned`) is left out and counted: it is gone by
    design, not lost (a payload lost is the audit's `payload-stored`)."""
    import random

    from projections.retention import fold_refs

    refs = fold_refs(store.read_all(0, types=["SiblingSealed", "PayloadsPruned"]))
    claims = [
        RolloutReceipt.model_validate(event.data["receipt"]).tokens_claim()
        for event in store.read_all(0, types=["SiblingSealed"])
        if event.stream_id.startswith(group_stream(run_id))
    ]
    kept = [c for c in claims if not refs.is_pruned(c.digest)]
    chosen = random.Random(0).sample(kept, min(sample, len(kept)))
    found = payload_plane(store).get_many(chosen)
    counts = [
        decode_payload(bytearray(found[c.digest]), c.media_type, check_canonical=False).total_tokens
        for c in chosen
    ]
    return TokenSample(statistics.fmean(counts) if counts else 0.0, len(counts), len(claims) - len(kept))


def allocation_growth(snapshots: list[tracemalloc.Snapshot], top: int = 12) -> list[str]:
    """Where the trainer's live Python allocations grew from the first quarter's end to nine tenths
    of the workload (`--tracemalloc`): the largest growths, by the stack that allocated them."""
    if len(snapshots) < 2:
        return []
    keep = [tracemalloc.Filter(False, tracemalloc.__file__), tracemalloc.Filter(False, "<frozen *>")]
    first, last = (s.filter_traces(keep) for s in snapshots[:2])
    lines = []
    for stat in last.compare_to(first, "traceback")[:top]:
        frames = " <- ".join(f"{Path(f.filename).name}:{f.lineno}" for f in stat.traceback)
        lines.append(f"{stat.size_diff / 1024:+.0f} KiB in {stat.count_diff:+d} blocks: {frames}")
    return lines


def headline(result: dict[str, Any]) -> dict[str, Any]:
    """The figures HEADLINE names, from a soak's result."""
    t, sizes = result["throughput"], result["sizes"]
    sealed = t["sealed_rollouts"] or 1
    trainer: dict[str, Any] = next((m for m in result["memory"] if m["process"] == TRAINER), {})
    tokens = sizes["tokens_per_rollout"]
    payload = sizes["payload_bytes"] / sealed
    return {
        "sealed_per_s_sustained": t["sustained_sealed_rollouts_per_s"],
        "trainer_cpu_ms_per_rollout": round(1000 * result["cpu_s"].get(TRAINER, 0.0) / sealed, 3),
        "tokens_per_rollout": round(tokens, 1),
        "events_bytes_per_rollout": round(sizes["events_bytes"] / sealed, 1),
        "payload_bytes_per_rollout": round(payload, 1),
        "payload_bytes_per_token": round(payload / tokens, 3) if tokens else None,
        "trainer_rss_growth_pct": trainer.get("growth_pct"),
    }


async def soak(
    store: EventStore,
    args: argparse.Namespace,
    pg_data: Path | None = None,
    payload_url: str | None = None,
    stop: asyncio.Event | None = None,
) -> dict[str, Any]:
    run_id = f"soak{uuid.uuid4().hex[:8]}"
    # What the agents the soak starts are given (their sizes, durations and reply shape), and the
    # rollout timeout derived from those durations.
    agents_config = SimConfig(
        call_seconds=args.call_seconds,
        tool_seconds=args.tool_seconds,
        generation_cuts=args.generation_cuts,
        turns=args.turns,
        prompt_tokens=args.prompt_tokens,
        gen_tokens=args.gen_tokens,
        zero_work=True,
        inline_tokens=args.inline_tokens,
    )
    rollout_timeout = (
        args.rollout_timeout
        if args.rollout_timeout is not None
        else derived_rollout_timeout_s(agents_config, 5.0)
    )
    agents = [
        AgentProcess(
            f"agent-{i}",
            seed=args.seed + i,
            turns=args.turns,
            delay_s=0.0,
            extra_args=["--log-level", "warning", *agents_config.agent_args()],
        )
        for i in range(args.agents)
    ]
    await asyncio.gather(*(asyncio.to_thread(a.start) for a in agents))
    pids = {TRAINER: os.getpid(), **{a.name: a.pid for a in agents if a.pid is not None}}
    stored_before = await asyncio.to_thread(storage_bytes, store, payload_url)
    sampler = MemorySampler(pids, every_s=args.sample_every).start()
    cpu = CpuMeter(pids, pg_data).start()
    trims = heap_trims()
    done = {"groups": 0, "last_print": 0.0}
    started = time.monotonic()

    snapshots: list[tracemalloc.Snapshot] = []

    def progress(finished: int, total: int) -> None:
        done["groups"] = finished
        now = time.monotonic()
        # After the first quarter, and at nine tenths (not at the end: the drain must not wait on it).
        due = (total // 4, 9 * total // 10)
        if tracemalloc.is_tracing() and len(snapshots) < 2 and finished >= due[len(snapshots)]:
            snapshots.append(tracemalloc.take_snapshot())
        if finished >= total:
            if sampler.phase == "workload":
                cpu.stop()
            sampler.phase = "after"  # the workload is over; next come the final status calls and the audit
        if now - done["last_print"] >= 5 or finished >= total:
            done["last_print"] = now
            rss = rss_kib(os.getpid()) or 0
            print(
                f"  {now - started:7.1f} s  groups {finished}/{total}  trainer RSS {rss / 1024:.0f} MiB",
                file=sys.stderr,
                flush=True,
            )

    config = SimConfig(
        agents=args.agents,
        agent_urls={a.name: a.url for a in agents},
        groups=args.groups,
        siblings=args.siblings,
        mode=args.mode,
        faults=args.faults,
        checkpoint_every_s=args.checkpoint_every,
        prepare_timeout_s=args.prepare_timeout,
        rollout_timeout_s=rollout_timeout,
        call_seconds=args.call_seconds,
        tool_seconds=args.tool_seconds,
        generation_cuts=args.generation_cuts,
        park_grace_s=args.park_grace,
        seed=args.seed,
        window_per_agent=args.window,
        turns=args.turns,
        prompt_tokens=args.prompt_tokens,
        gen_tokens=args.gen_tokens,
        zero_work=True,
        inline_tokens=args.inline_tokens,
        agent_delay_s=0.0,
        run_id=run_id,
    )
    profiler = cProfile.Profile() if args.profile else None
    if args.tracemalloc:
        tracemalloc.start(args.tracemalloc)
    try:
        if profiler is not None:
            profiler.enable()
        summary = await run_simulation(store, config, progress=progress, stop=stop)
    finally:
        if profiler is not None:
            profiler.disable()
        tracemalloc.stop()
        sampler.stop()
        await asyncio.gather(*(asyncio.to_thread(a.close) for a in agents))
    if profiler is not None:
        profiler.dump_stats(args.profile)
    counts, sealed_at = await asyncio.to_thread(count_run_events, store, run_id)
    waits, aborts = await asyncio.to_thread(checkpoint_waits, store, run_id)
    stored = (await asyncio.to_thread(storage_bytes, store, payload_url)).minus(stored_before)
    tokens = await asyncio.to_thread(sealed_tokens, store, run_id)
    audit = await asyncio.to_thread(run_audit, store)
    wall = summary["wall_s"] or 1e-9
    sealed = counts.get("SiblingSealed", 0)
    events = sum(counts.values())
    result = {
        "summary": summary,
        "throughput": {
            "wall_s": wall,
            "sealed_rollouts": sealed,
            "sealed_rollouts_per_s": round(sealed / wall, 1),
            "sustained_sealed_rollouts_per_s": round(sustained_rate(sealed_at), 1),
            "events": events,
            "events_per_s": round(events / wall, 1),
            "prepare_waits": len(waits),
            "prepare_wait_p50_s": percentile(waits, 50),
            "prepare_wait_p99_s": percentile(waits, 99),
            "prepare_wait_max_s": percentile(waits, 100),
        },
        "checkpoint_aborts": aborts,
        "allocation_growth": allocation_growth(snapshots),
        "audit": audit,
        "memory": [sampler.report(name) for name in pids],
        "cpu_s": cpu.used,
        # The trainer's heap given back to the system while the soak ran (trainer.eventloop.trim_heap).
        "heap_trims": heap_trims() - trims,
        "sizes": {
            "prompt_tokens": args.prompt_tokens,
            "gen_tokens": args.gen_tokens,
            "turns": list(args.turns),
            "inline_tokens": args.inline_tokens,
            "tokens_per_rollout": tokens.mean,
            "token_sample": tokens.size,
            # Sealed rollouts whose token records a prune removed during the run: left out of the
            # sample, and their bytes out of `payload_bytes` (the store's growth).
            "pruned_rollouts": tokens.pruned,
            "events_bytes": stored.events_rows,
            "events_relation_bytes": stored.events_relation,
            "payload_bytes": stored.payloads,
            "payloads": stored.payload_count,
        },
    }
    return {**headline(result), **result}


def run_audit(store: EventStore) -> dict[str, Any]:
    """The auditor over the whole log, timed, with its peak memory (VmHWM rises only if it grows):
    `ledger audit`'s whole audit, the payload rules included (every claimed payload read back from the
    store the run wrote to, the database's own integrity check)."""
    from projections.audit import audit_log

    started = time.monotonic()
    report = audit_log(store, payloads=payload_plane(store))
    by_rule: dict[str, int] = {}
    for v in report.violations:
        by_rule[v.rule] = by_rule.get(v.rule, 0) + 1
    return {
        "events": report.events,
        "rules_checked": len(report.rules_checked),
        "violations": len(report.violations),
        "by_rule": by_rule,
        "first": [f"{v.rule} at {v.positions[:4]}: {v.message}" for v in report.violations[:5]],
        "seconds": round(time.monotonic() - started, 2),
    }


def render(result: dict[str, Any], url: str, console: Console) -> None:
    s, t = result["summary"], result["throughput"]
    pruned = result["sizes"]["pruned_rollouts"]
    sample = f"a sample of {result['sizes']['token_sample']}" + (
        f"; {pruned} pruned during the run, left out, their bytes not counted" if pruned else ""
    )
    table = Table(title=f"soak {s['run_id']} on {mask_url(url)}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    rows: list[tuple[str, Any]] = [
        ("groups x siblings", f"{s['groups']} x {s['siblings']} ({s['mode']}, {s['agents']} agents)"),
        ("sizes: prompt / generated per call (means), calls per rollout",
         f"{result['sizes']['prompt_tokens']} / {result['sizes']['gen_tokens']}, "
         f"{result['sizes']['turns'][0]}:{result['sizes']['turns'][1]}"),
        ("tokens per sealed rollout (prompt + generated, every call)",
         f"{result['tokens_per_rollout']} ({sample})"),
        ("events-table bytes per sealed rollout (rows; relation growth)",
         f"{result['events_bytes_per_rollout']}; "
         f"{round(result['sizes']['events_relation_bytes'] / max(1, t['sealed_rollouts']))}"),
        ("payload bytes per sealed rollout (per token)",
         f"{result['payload_bytes_per_rollout']} ({result['payload_bytes_per_token']})"),
        ("trainer CPU ms per sealed rollout", result["trainer_cpu_ms_per_rollout"]),
        ("trainer heap trims", result["heap_trims"]),
        ("wall time (s)", t["wall_s"]),
        ("sealed rollouts", t["sealed_rollouts"]),
        ("sealed rollouts / s (whole run)", t["sealed_rollouts_per_s"]),
        ("sealed rollouts / s (sustained: 10th-90th percentile of seals)", t["sustained_sealed_rollouts_per_s"]),
        ("events (this run)", t["events"]),
        ("events / s", t["events_per_s"]),
        ("tries / replacements", f"{s['tries']} / {s['replacements']}"),
        ("retired / adopted", f"{s['retired']} / {s['adopted']}"),
        ("groups sealed / abandoned / dead-lettered",
         f"{s['groups_sealed']} / {s['groups_abandoned']} / {s['groups_dead_lettered']}"),
        ("checkpoints committed / aborted", f"{s['checkpoints_committed']} / {s['checkpoints_aborted']}"),
        ("journal appends / transactions (per s)",
         f"{s['journal_appends']} / {s['journal_batches']} ({s['journal_batches'] / t['wall_s']:.0f}/s)"),
        ("payload puts / store calls", f"{s['payload_puts']} / {s['payload_store_calls']}"),
        ("prepare wait p50 / p99 / max (s)",
         f"{t['prepare_wait_p50_s']} / {t['prepare_wait_p99_s']} / {t['prepare_wait_max_s']}"),
        ("model time / thrown away by checkpoints (s)",
         f"{s['model_s']} / {s['thrown_by_checkpoints_model_s']} ({100 * s['thrown_by_checkpoints_share']:.2f} %, "
         f"{s['thrown_by_checkpoints_tries']} tries)"),
        ("stranded / duplicate executions", f"{s['stranded']} / {s['duplicate_executions']}"),
        ("debts outstanding", s["debts_outstanding"]),
        ("audit (whole log)",
         f"{result['audit']['violations']} violations, {result['audit']['rules_checked']} rules, "
         f"{result['audit']['events']} events, {result['audit']['seconds']} s"),
    ]  # fmt: skip
    for key, value in rows:
        table.add_row(key, "-" if value is None else str(value))
    console.print(table)
    mem = Table(title="resident memory (MiB) over the workload")
    for col in (
        "process",
        "start",
        "peak",
        "first quarter",
        "last quarter",
        "growth %",
        "flat",
        "peak after",
    ):
        mem.add_column(col, justify="left" if col == "process" else "right")
    for m in result["memory"]:
        if not m.get("samples"):
            mem.add_row(m["process"], *["-"] * 7)
            continue
        mem.add_row(
            m["process"],
            str(m["start_mib"]),
            str(m["peak_mib"]),
            str(m["first_quarter_mib"]),
            str(m["last_quarter_mib"]),
            str(m["growth_pct"]),
            "yes" if m["flat"] else "NO",
            "-" if m["peak_after_mib"] is None else str(m["peak_after_mib"]),
        )
    console.print(mem)
    cpu = Table(title=f"CPU over the workload ({os.cpu_count()} cores, {t['wall_s']} s wall)")
    for col in ("process", "CPU s", "cores busy", "ms per sealed rollout"):
        cpu.add_column(col, justify="left" if col == "process" else "right")
    for name, seconds in result["cpu_s"].items():
        per = 1000 * seconds / t["sealed_rollouts"] if t["sealed_rollouts"] else 0.0
        cpu.add_row(name, f"{seconds:.1f}", f"{seconds / t['wall_s']:.2f}", f"{per:.2f}")
    console.print(cpu)
    for line in result["allocation_growth"]:
        console.print(f"allocations grew: {line}")
    for line in result["checkpoint_aborts"]:
        console.print(f"[yellow]checkpoint aborted:[/yellow] {line}")
    if s.get("thrown_by_checkpoints_warning"):
        console.print(f"[yellow]warning:[/yellow] {s['thrown_by_checkpoints_warning']}")
    for line in result["audit"]["first"]:
        console.print(f"[red]audit:[/red] {line}")


def _durations(option: str) -> Callable[[str], str]:
    """An argparse type: the text of a valid MEAN[:SPREAD] (gym_agent.durations), else its error."""

    def check(text: str) -> str:
        try:
            parse_durations(text, option)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return text

    return check


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--groups", type=positive, default=2000)
    parser.add_argument("--siblings", type=positive, default=8)
    parser.add_argument("--agents", type=positive, default=2)
    parser.add_argument("--mode", choices=("sibling", "prompt_group"), default="prompt_group")
    parser.add_argument("--faults", default=DEFAULT_FAULTS)
    parser.add_argument("--checkpoint-every", type=float, default=3.0)
    parser.add_argument("--prepare-timeout", type=float, default=30.0)
    parser.add_argument(
        "--rollout-timeout",
        type=float,
        default=None,
        help="Seconds a try may run (default: 5, or twice the longest call at --call-seconds).",
    )
    parser.add_argument(
        "--call-seconds",
        default=None,
        type=_durations("--call-seconds"),
        help="The agents' model-call duration, MEAN[:SPREAD] seconds (default: none, zero work).",
    )
    parser.add_argument(
        "--tool-seconds",
        default=None,
        type=_durations("--tool-seconds"),
        help="Their tools' duration, MEAN[:SPREAD].",
    )
    parser.add_argument(
        "--generation-cuts",
        action="store_true",
        help="The agents cut a model call at a token boundary when a checkpoint parks it, and go on "
        "from there after the resume (instead of the checkpoint waiting for the whole call).",
    )
    parser.add_argument(
        "--inline-tokens",
        action="store_true",
        help="The agents also answer each call's token arrays inside the reply, on its output message, "
        "as a real Gym agent does (the reply carries every token as JSON).",
    )
    parser.add_argument(
        "--park-grace",
        type=float,
        default=0.25,
        help="Seconds a try may block a prepare without progress before it is retired (the zero-work "
        "agents' model calls take microseconds; the hang fault's tries never park).",
    )
    add_size_options(parser, prompt_tokens=8, gen_tokens=2, turns="1")
    parser.add_argument("--window", type=positive, default=8, help="Groups open at once per agent.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sample-every", type=float, default=0.5, help="Seconds between RSS samples.")
    parser.add_argument("--db", default=None, help="PostgreSQL URL (default: a throwaway cluster).")
    parser.add_argument("--pool-size", type=positive, default=5)
    parser.add_argument(
        "--pg-setting",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="postgresql.conf setting of the throwaway cluster (repeatable), e.g. synchronous_commit=off.",
    )
    parser.add_argument("--profile", default=None, help="Write a cProfile of the trainer process here.")
    parser.add_argument(
        "--tracemalloc",
        type=int,
        default=0,
        metavar="FRAMES",
        help="Trace the trainer's allocations (FRAMES deep) and report where they grew from the first "
        "quarter's end to nine tenths of the workload (slows the trainer down).",
    )
    parser.add_argument("--json", dest="as_json", default=None, help="Also write the result as JSON here.")
    args = parser.parse_args(argv)

    console = Console()
    with contextlib.ExitStack() as stack:
        url = args.db
        pg_data: Path | None = None
        if url is None:
            settings = dict(item.split("=", 1) for item in args.pg_setting)
            cluster = stack.enter_context(PgCluster(settings))
            pg_data = cluster.data
            url = cluster.url(cluster.create_database("soak"))
        store = open_store(url, migrate_schema=True, pool_size=args.pool_size)
        stack.callback(store.close)
        payload_url = default_payload_url(url)
        # Ctrl-C or SIGTERM (`timeout`, a scheduler) winds the run down like `ledger simulate`'s; the
        # `with` then stops the throwaway cluster (a SIGTERM used to kill the process and leave it).
        asked: list[StopRequest] = []

        def run(stop: StopRequest) -> Coroutine[Any, Any, dict[str, Any]]:
            asked.append(stop)
            return soak(store, args, pg_data, payload_url, stop)

        try:
            result = run_until_stopped(run)
        except (
            PayloadStoreError,
            CoordinatorStopped,
        ) as exc:  # a bad $LEDGER_PAYLOADS, a store gone: one line
            print(f"error: {exc}", file=sys.stderr)
            return 2
        except (RunInterrupted, Interrupted) as exc:
            kept = "its database is kept" if args.db else "its throwaway database is removed"
            print(f"interrupted: the soak stopped before its figures; {kept}", file=sys.stderr)
            return exc.exit_code if isinstance(exc, Interrupted) else asked[0].exit_code
    render(result, url, console)
    if args.profile:
        stats = pstats.Stats(args.profile)
        stats.sort_stats("cumulative").print_stats(30)
    if args.as_json:
        Path(args.as_json).write_text(json.dumps(result, indent=2))
    s = result["summary"]
    bad = s["stranded"] or s["duplicate_executions"] or result["audit"]["violations"]
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
