"""`ledger simulate`: run a faulty rollout workload against reference agents and summarise it."""

from __future__ import annotations

import contextlib
import json
import logging
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from cli.common import DbOption, clear_errors, console, db_url, err_console
from cli.metrics import serve_metrics
from eventstore import EventStore, open_store
from protocol.streams import group_stream
from simulation.explore import explore
from simulation.ray_run import ray_failed
from simulation.run import DEFAULT_FAULTS, SimConfig, failed, parse_faults, run_simulation
from trainer.eventloop import run_async


def register(app: typer.Typer) -> None:
    """Adds `ledger simulate` to the `ledger` app."""
    app.command("simulate")(simulate)


def simulate(
    db: DbOption = None,
    agents: Annotated[
        int, typer.Option("--agents", min=1, help="Reference agents to start on loopback.")
    ] = 2,
    agent_url: Annotated[
        list[str] | None,
        typer.Option("--agent-url", help="NAME=URL of a running agent (repeatable); no agents are started."),
    ] = None,
    agent_state_dir: Annotated[
        list[str] | None,
        typer.Option(
            "--agent-state-dir",
            help="NAME=DIR: the state directory of an --agent-url agent with the participant mounted; "
            "its durable execution evidence counts duplicates and stranded results (repeatable).",
        ),
    ] = None,
    groups: Annotated[int, typer.Option("--groups", min=1)] = 48,
    siblings: Annotated[int, typer.Option("--siblings", min=1)] = 4,
    mode: Annotated[str, typer.Option("--mode", help="sibling | prompt_group")] = "prompt_group",
    faults: Annotated[
        str, typer.Option("--faults", help="drop_reply=P,fail=P,hang=P,crash_after=N")
    ] = DEFAULT_FAULTS,
    checkpoint_every: Annotated[
        float, typer.Option("--checkpoint-every", help="Seconds between checkpoints (0: none).")
    ] = 1.5,
    prepare_timeout: Annotated[float, typer.Option("--prepare-timeout")] = 30.0,
    rollout_timeout: Annotated[float, typer.Option("--rollout-timeout")] = 10.0,
    park_grace: Annotated[
        float,
        typer.Option(
            "--park-grace",
            help="Seconds a try may block a prepare without progress before it is retired as stuck "
            "(above the agents' longest model call).",
        ),
    ] = 1.0,
    seed: Annotated[int, typer.Option("--seed")] = 0,
    as_json: Annotated[bool, typer.Option("--json", help="Print the summary as JSON.")] = False,
    explore_seeds: Annotated[
        int,
        typer.Option(
            "--explore",
            min=0,
            help="Instead of the main job: explore this many seeded fault schedules of the protocol "
            "core (from --seed) and check each history; exit status 1 on any violation.",
        ),
    ] = 0,
    real: Annotated[
        bool,
        typer.Option(
            "--real",
            help="With --explore: drive the real coordinator (crashes, recovery, stale owners, several "
            "trainers, a database outage) against in-process reference agents, on a fresh SQLite file "
            "per seed, or on --db when given.",
        ),
    ] = False,
    use_ray: Annotated[
        bool,
        typer.Option(
            "--ray",
            help="Run the coordinator inside a Ray actor (NeMo RL's NemoGym drop-in), driven through its "
            "streaming run_rollouts (needs the `ray` extra).",
        ),
    ] = False,
    ray_kill_after: Annotated[
        int | None,
        typer.Option(
            "--ray-kill-after", min=1, help="With --ray: kill the actor once after this many rows came back."
        ),
    ] = None,
    metrics_port: Annotated[
        int | None,
        typer.Option(
            "--metrics-port",
            min=0,
            max=65535,
            help="Serve Prometheus metrics on /metrics at this port while the run lasts (`metrics` extra).",
        ),
    ] = None,
    otel: Annotated[
        bool,
        typer.Option(
            "--otel",
            help="After the run, emit an OpenTelemetry trace per rollout (a span per try: /run, receipt, "
            "seal, ACK) from the log: to OTLP when opentelemetry-exporter-otlp is installed, else to "
            "stderr (`otel` extra).",
        ),
    ] = False,
) -> None:
    """Runs GROUPS prompt groups through the coordinator with faults and checkpoints, then reports.

    The log defaults to ./ledger.db (or $LEDGER_DB); each run uses its own id prefix, so running
    twice on the same file is fine.  Exit status 1 if any result was stranded, any try ran twice,
    or the auditor found a violation.
    """
    if real and not explore_seeds:
        raise typer.BadParameter("--real needs --explore N")
    if explore_seeds:
        if real:
            _explore_real(explore_seeds, seed, db, as_json)
        else:
            _explore(explore_seeds, seed, as_json)
        return
    if mode not in ("sibling", "prompt_group"):
        raise typer.BadParameter("--mode must be sibling or prompt_group")
    try:
        parse_faults(faults)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    urls: dict[str, str] = {}
    for item in agent_url or []:
        name, sep, url = item.partition("=")
        if not sep or not name or not url:
            raise typer.BadParameter(f"--agent-url wants NAME=URL, got {item!r}")
        urls[name] = url
    state_dirs: dict[str, Path] = {}
    for item in agent_state_dir or []:
        name, sep, path = item.partition("=")
        if not sep or name not in urls or not path:
            raise typer.BadParameter(
                f"--agent-state-dir wants NAME=DIR for an --agent-url NAME, got {item!r}"
            )
        state_dirs[name] = Path(path)
    logging.basicConfig(level=logging.ERROR)
    config = SimConfig(
        agents=agents,
        agent_urls=urls,
        agent_state_dirs=state_dirs,
        groups=groups,
        siblings=siblings,
        mode=mode,
        faults=faults,
        checkpoint_every_s=checkpoint_every,
        prepare_timeout_s=prepare_timeout,
        rollout_timeout_s=rollout_timeout,
        park_grace_s=park_grace,
        seed=seed,
    )
    if ray_kill_after is not None and not use_ray:
        raise typer.BadParameter("--ray-kill-after needs --ray")
    with clear_errors():
        url = db_url(db)
        store = open_store(url, migrate_schema=True)
        exporter = serve_metrics(store, metrics_port, "trainer") if metrics_port is not None else None
        try:
            if use_ray:
                from simulation.ray_run import run_ray_simulation

                # Ray prints the task errors it retries (an actor killed) to stdout: keep stdout the
                # summary's alone.
                with contextlib.redirect_stdout(sys.stderr):
                    summary = run_async(run_ray_simulation(store, url, config, kill_after=ray_kill_after))
            elif as_json:
                summary = run_async(run_simulation(store, config))
            else:
                with Progress(
                    TextColumn("groups"),
                    BarColumn(),
                    MofNCompleteColumn(),
                    TimeElapsedColumn(),
                    console=err_console,
                ) as bar:
                    task = bar.add_task("groups", total=groups)
                    summary = run_async(
                        run_simulation(
                            store, config, progress=lambda done, total: bar.update(task, completed=done)
                        )
                    )
            if otel:
                traced = emit_run_spans(store, summary["run_id"])
                err_console.print(f"{traced} tries traced")
        finally:
            if exporter is not None:
                exporter.close()
            store.close()
    if as_json:
        console.print_json(json.dumps(summary))
    else:
        table = Table(title=f"ledger simulate ({summary['run_id']}, {store.url})")
        table.add_column("metric")
        table.add_column("value", justify="right")
        for key, value in summary.items():
            table.add_row(key, "-" if value is None else str(value))
        console.print(table)
    if failed(summary) or (use_ray and ray_failed(summary)):
        raise typer.Exit(1)


def _explore(seeds: int, first_seed: int, as_json: bool) -> None:

    started = time.monotonic()
    result = explore(seeds, first_seed)
    summary = {
        "seeds_explored": result.seeds,
        "first_seed": result.first_seed,
        "calls": result.calls,
        "agent_restarts": result.restarts,
        "participants_lost": result.lost,
        "participants_stuck": result.stuck,
        "tries_declared_lost": result.tries_lost,
        "violations": sum(len(v) for v in result.violations.values()),
        "failing_seeds": sorted(result.violations)[:50],
        "wall_s": round(time.monotonic() - started, 2),
    }
    _report_exploration(summary, result.violations, "--explore 1", as_json)


def _explore_real(seeds: int, first_seed: int, db: str | None, as_json: bool) -> None:
    from simulation.explore_store import explore_real

    with clear_errors():
        url = db_url(db) if db is not None else None
        result = run_async(explore_real(seeds, first_seed, url))
    summary: dict[str, object] = {
        "seeds_explored": result.seeds,
        "first_seed": result.first_seed,
        "log": "a fresh SQLite file per seed" if url is None else url,
        **{k: result.counts[k] for k in sorted(result.counts)},
        "violations": sum(len(v) for v in result.violations.values()),
        "failing_seeds": sorted(result.violations)[:50],
        "wall_s": round(result.wall_s, 2),
        "seeds_per_s": round(result.seeds / result.wall_s, 2) if result.wall_s else None,
    }
    _report_exploration(summary, result.violations, "--explore 1 --real", as_json)


def _report_exploration(
    summary: dict[str, object], violations: Mapping[int, object], replay: str, as_json: bool
) -> None:
    """An exploration's summary, its first failing seeds with the command that replays each, and exit
    status 1 if any seed found a violation."""
    if as_json:
        print(json.dumps(summary, indent=2))
    else:
        for key, value in summary.items():
            console.print(f"{key}: {value}")
        for seed_, found in list(violations.items())[:10]:
            console.print(
                f"[red]seed {seed_}[/red] (replay: ledger simulate {replay} --seed {seed_}): {found}"
            )
    if violations:
        raise typer.Exit(1)


def emit_run_spans(store: EventStore, run_id: str) -> int:
    """The run's tries as spans, through an SDK tracer provider flushed before returning."""
    try:
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
    except ImportError:
        raise typer.BadParameter("--otel needs opentelemetry-sdk (the `otel` extra)") from None
    from trainer.tracing import emit_try_spans

    exporter: SpanExporter
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter()
    except ImportError:
        exporter = ConsoleSpanExporter(out=sys.stderr)
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(exporter))
    prefix = group_stream(run_id)
    events = (e for e in store.read_all(0) if e.stream_id.startswith(prefix))
    traced = emit_try_spans(events, provider.get_tracer("rollout-ledger"))
    provider.shutdown()
    return traced
