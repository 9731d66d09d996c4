"""`ledger simulate`: run a faulty rollout workload against reference agents and summarise it.

The options are the function's parameters below, each given to `SimConfig` (simulation/config.py,
the one place a run's settings live) by name in `_config`; the log, the trainer and the agents are
imported when a run starts, so `ledger --help` and an option error cost nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import shutil
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from cli.common import (
    ERROR_LIMIT,
    DbOption,
    bounded,
    clear_errors,
    console,
    db_url,
    err_console,
    error,
    require_extra,
)
from cli.signals import Interrupted, StopRequest, run_until_stopped
from gym_agent.defaults import TOKEN_ENV
from gym_agent.sizes import DEFAULT_GEN_TOKENS, DEFAULT_PROMPT_TOKENS, check_tokens, parse_turns
from simulation.config import (
    DEFAULT_FAULTS,
    RUN_ID,
    SimConfig,
    derived_rollout_timeout_s,
    parse_faults,
    run_state_dir,
)

if TYPE_CHECKING:
    from eventstore import EventStore

# Seconds between progress lines when stderr is not a terminal (a log file, a CI job).
PROGRESS_LINE_EVERY_S = 5.0


def register(app: typer.Typer) -> None:
    """Adds `ledger simulate` to the `ledger` app."""
    app.command("simulate")(_said_if_interrupted(simulate))


def _said_if_interrupted(command: Callable[..., None]) -> Callable[..., None]:
    """Ctrl-C outside the run's own signal handling (while the command imports the trainer, opens the
    log or starts the agents, before `run_until_stopped` takes the signal over) says so in one line,
    where typer would exit 130 in silence.  Nothing of the run was submitted by then."""

    @functools.wraps(command)
    def guarded(*args: Any, **kwargs: Any) -> None:
        try:
            command(*args, **kwargs)
        except KeyboardInterrupt:
            resume = kwargs.get("resume")
            then = f"carry on with: ledger simulate --resume {resume}" if resume else "nothing was submitted"
            err_console.print(f"interrupted before the run started: {then}", soft_wrap=True, highlight=False)
            raise typer.Exit(130) from None

    return guarded


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
    agent_token: Annotated[
        str | None,
        typer.Option(
            "--agent-token",
            envvar=TOKEN_ENV,
            show_envvar=True,
            help="The agents' control token: sent to every agent, and required by the agents this run starts.",
        ),
    ] = None,
    groups: Annotated[int, typer.Option("--groups", min=1)] = 48,
    siblings: Annotated[int, typer.Option("--siblings", min=1)] = 4,
    mode: Annotated[str, typer.Option("--mode", help="sibling | prompt_group")] = "prompt_group",
    faults: Annotated[
        str, typer.Option("--faults", help="drop_reply=P,fail=P,hang=P,crash_after=N")
    ] = DEFAULT_FAULTS,
    checkpoint_every: Annotated[
        float, typer.Option("--checkpoint-every", min=0.0, help="Seconds between checkpoints (0: none).")
    ] = 1.5,
    prepare_timeout: Annotated[float, typer.Option("--prepare-timeout", min=0.01)] = 30.0,
    rollout_timeout: Annotated[
        float | None,
        typer.Option(
            "--rollout-timeout",
            min=0.01,
            help="Seconds a try may run [default: 10, or twice the longest episode at --call-seconds "
            "and --tool-seconds].",
        ),
    ] = None,
    call_seconds: Annotated[
        str | None,
        typer.Option(
            "--call-seconds",
            help="The reference agents' model-call duration, MEAN[:SPREAD] seconds (gamma, drawn per call).",
        ),
    ] = None,
    tool_seconds: Annotated[
        str | None,
        typer.Option("--tool-seconds", help="Their tools' duration between two model calls, MEAN[:SPREAD]."),
    ] = None,
    generation_cuts: Annotated[
        bool,
        typer.Option(
            "--generation-cuts",
            help="The reference agents cut a model call at a token boundary when a checkpoint parks "
            "it, and go on from there after the resume.",
        ),
    ] = False,
    park_grace: Annotated[
        float,
        typer.Option(
            "--park-grace",
            min=0.0,
            help="Seconds a try may block a prepare without progress of its own (and at least 4 of "
            "its agent's heartbeats) before it is retired as stalled.",
        ),
    ] = 1.0,
    turns: Annotated[
        str,
        typer.Option("--turns", help="The reference agents' episode length, A:B turns (drawn per lineage)."),
    ] = "1:3",
    prompt_tokens: Annotated[
        int,
        typer.Option(
            "--prompt-tokens",
            help="The reference agents' mean prompt tokens (drawn per task within a third of it).",
        ),
    ] = DEFAULT_PROMPT_TOKENS,
    gen_tokens: Annotated[
        int,
        typer.Option(
            "--gen-tokens",
            help="Their mean tokens generated per model call (every call after the first is sent the "
            "whole conversation so far).",
        ),
    ] = DEFAULT_GEN_TOKENS,
    zero_work: Annotated[
        bool,
        typer.Option(
            "--zero-work",
            help="The reference agents run no model: each call's tokens are drawn at its size (real "
            "sizes beyond what the tiny policy holds).",
        ),
    ] = False,
    target_level: Annotated[
        str,
        typer.Option(
            "--target-level",
            help="turn | sibling | prompt_group: how much of an interrupted rollout a replacement keeps "
            "(turn: the agents keep continuations and replacements resume them; docs/turns.md).",
        ),
    ] = "sibling",
    kill_trainer_every: Annotated[
        float | None,
        typer.Option(
            "--kill-trainer-every",
            min=0.1,
            help="Stop the trainer every S seconds wherever it is and recover it from the log (the "
            "agents it started restart too, their state kept), until the run ends.",
        ),
    ] = None,
    compare_level: Annotated[
        str | None,
        typer.Option(
            "--compare-level",
            help="Then run the same workload and schedule again at this target level, as a run of its "
            "own on the same log, and report its turns and promise beside the first (section compare).",
        ),
    ] = None,
    resources: Annotated[
        str | None,
        typer.Option(
            "--resources",
            help="Start the reference resources server and have each turn call these of its resources "
            "(bank: export_restore, mailer: restart_only, calculator: stateless; comma-separated): the "
            "summary counts side effects from its journal.",
        ),
    ] = None,
    seed: Annotated[int, typer.Option("--seed")] = 0,
    resume: Annotated[
        str | None,
        typer.Option(
            "--resume",
            metavar="RUN_ID",
            help="Carry on an interrupted run: recover its trainer from the log (each group it left "
            "open is driven to a seal or dead-lettered) and submit what it never submitted.  Give the "
            "run's other options as they were.",
        ),
    ] = None,
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

    The log defaults to ./ledger.db (or $LEDGER_DB).  Each run is its own trainer (its id is the
    run id), so runs on one file never drive or claim each other's groups; `--resume RUN_ID` carries
    on one that was interrupted.  Ctrl-C or SIGTERM stops a run cleanly (exit status 130 / 143):
    its checkpoint in flight is decided, its agents are stopped, and one line says what it left.
    Exit status 1 if any result was stranded, any try ran twice, the auditor found a violation, or
    the run stalled.
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
    for level, option in ((target_level, "--target-level"), (compare_level, "--compare-level")):
        if level is not None and level not in ("turn", "sibling", "prompt_group"):
            raise typer.BadParameter(f"{option} must be turn, sibling or prompt_group")
    if compare_level is not None and (use_ray or resume is not None):
        raise typer.BadParameter("--compare-level runs two fresh runs here: not with --ray or --resume")
    if resources is not None:
        from gym_resources.book import RESOURCES

        unknown = [n for n in resources.split(",") if n not in RESOURCES]
        if unknown or not resources:
            raise typer.BadParameter(
                f"--resources names {bounded(', '.join(unknown)) or 'nothing'}; the reference server has "
                f"{', '.join(sorted(RESOURCES))}"
            )
        if agent_url:
            raise typer.BadParameter("--resources drives the agents it starts: not with --agent-url")
    try:
        turn_bounds = parse_turns(turns)
    except ValueError as exc:
        raise typer.BadParameter(bounded(str(exc), ERROR_LIMIT), param_hint="--turns") from None
    for value, option in ((prompt_tokens, "--prompt-tokens"), (gen_tokens, "--gen-tokens")):
        try:
            check_tokens(value, option)
        except ValueError as exc:
            raise typer.BadParameter(bounded(str(exc), ERROR_LIMIT), param_hint=option) from None
    try:
        parse_faults(faults)
    except ValueError as exc:
        raise typer.BadParameter(bounded(str(exc), ERROR_LIMIT), param_hint="--faults") from None
    from gym_agent.durations import parse_durations

    for text, option in ((call_seconds, "--call-seconds"), (tool_seconds, "--tool-seconds")):
        if text is not None:
            try:
                parse_durations(text, option)
            except ValueError as exc:
                raise typer.BadParameter(bounded(str(exc), ERROR_LIMIT), param_hint=option) from None
    urls = _agent_urls(agent_url or [])
    state_dirs: dict[str, Path] = {}
    for item in agent_state_dir or []:
        name, sep, path = item.partition("=")
        if not sep or name not in urls or not path:
            raise typer.BadParameter(
                f"--agent-state-dir wants NAME=DIR for an --agent-url NAME, got {bounded(item)!r}"
            )
        state_dirs[name] = Path(path)
    if kill_trainer_every is not None and (use_ray or urls):
        raise typer.BadParameter(
            "--kill-trainer-every drives the agents it starts in this process: not with --ray or --agent-url"
        )
    if ray_kill_after is not None and not use_ray:
        raise typer.BadParameter("--ray-kill-after needs --ray")
    if resume is not None and not RUN_ID.fullmatch(resume):
        raise typer.BadParameter(f"{bounded(resume)!r} is not a run id (the one an interrupted run printed)")
    if resume is not None and use_ray:
        raise typer.BadParameter("--resume drives the coordinator in this process: not with --ray")
    if not urls:  # the reference agents are started here
        require_extra("agent", "ledger simulate (it starts reference agents; or give --agent-url)",
                      "uvicorn", "torch")  # fmt: skip
    if not urls and not zero_work:  # the policy must hold what these sizes draw: refused, not cut
        from gym_agent.episode import EpisodeTooLong, check_fits
        from workers.policy import DEFAULT_POLICY_SPEC, parse_policy_spec

        try:
            check_fits(
                parse_policy_spec(DEFAULT_POLICY_SPEC).max_seq_len, prompt_tokens, gen_tokens, turn_bounds
            )
        except EpisodeTooLong as exc:
            raise typer.BadParameter(bounded(str(exc), ERROR_LIMIT)) from None
    if use_ray:
        # Looked up, not imported: the run imports Ray after telling it to stay on loopback.
        require_extra("ray", "ledger simulate --ray", "ray", load=False)
    if metrics_port is not None:
        require_extra("metrics", "--metrics-port", "prometheus_client")
    if otel:
        require_extra("otel", "--otel", "opentelemetry.sdk.trace")
    config = _config(
        agents=agents,
        agent_urls=urls,
        agent_state_dirs=state_dirs,
        agent_token=agent_token or None,
        groups=groups,
        siblings=siblings,
        mode=mode,
        faults=faults,
        checkpoint_every_s=checkpoint_every,
        prepare_timeout_s=prepare_timeout,
        rollout_timeout_s=rollout_timeout,
        call_seconds=call_seconds,
        tool_seconds=tool_seconds,
        generation_cuts=generation_cuts,
        park_grace_s=park_grace,
        turns=turn_bounds,
        prompt_tokens=prompt_tokens,
        gen_tokens=gen_tokens,
        zero_work=zero_work,
        target_level=target_level,
        kill_trainer_every_s=kill_trainer_every,
        resources=resources,
        measure_turns=compare_level is not None,
        seed=seed,
        run_id=resume,
        resume=resume is not None,
    )
    logging.basicConfig(level=logging.ERROR)
    with clear_errors():
        url = db_url(db)
        summary, store_url = _run(url, config, use_ray, ray_kill_after, as_json, metrics_port, otel)
        other = None
        if compare_level is not None:
            other_config = _config(**{**_options(config), "target_level": compare_level}, run_id=None)
            other, _ = _run(url, other_config, use_ray, ray_kill_after, as_json, None, otel)
            if other_config.agent_state_root is not None:
                shutil.rmtree(other_config.agent_state_root, ignore_errors=True)
            summary["compare"] = {k: other.get(k) for k in COMPARED}
    from simulation.ray_run import ray_failed
    from simulation.run import failed

    failing = failed(summary) or (use_ray and ray_failed(summary)) or (other is not None and failed(other))
    summary["verdict"] = _verdict(summary, failing)
    if as_json:
        console.print_json(json.dumps(summary))
    else:
        print_summary(summary, store_url)
    if config.agent_state_root is not None and not config.agent_urls:
        shutil.rmtree(config.agent_state_root, ignore_errors=True)  # the run ended: nothing to resume
    if failing:
        raise typer.Exit(1)


def _agent_urls(items: list[str]) -> dict[str, str]:
    urls: dict[str, str] = {}
    for item in items:
        name, sep, url = item.partition("=")
        if not sep or not name or not url:
            raise typer.BadParameter(f"--agent-url wants NAME=URL, got {bounded(item)!r}")
        if not url.startswith(("http://", "https://")):
            raise typer.BadParameter(
                f"--agent-url {bounded(f'{name}={url}')}: the URL starts with http:// or https://"
            )
        urls[name] = url.rstrip("/")
    return urls


# What the summary's section `compare` shows of the run at the other level (`--compare-level`).
COMPARED: tuple[str, ...] = (
    "run_id",
    "target_level",
    "wall_s",
    "trainer_kills",
    "retired",
    "turns_resumed",
    "turns_redone",
    "model_tokens_saved",
    "continuations_resumed",
    "continuations_declined",
    "side_effects_applied",
    "side_effects_twice",
    "stranded",
    "duplicate_executions",
    "audit_violations",
)


def _options(config: SimConfig) -> dict[str, Any]:
    """The options a config was made from (`_config`'s keywords), to make another run of them."""
    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    for derived in ("run_id", "agent_state_root", "resume"):
        values.pop(derived)
    return values


def _config(*, run_id: str | None, **options: Any) -> SimConfig:
    """The run's settings: the options by name, a new run id unless one is resumed, and where the
    agents started here keep their state (so that `--resume` restarts the same agents)."""
    import uuid

    run_id = run_id or f"s{uuid.uuid4().hex[:6]}"
    rollout_timeout = options.pop("rollout_timeout_s")
    config = SimConfig(run_id=run_id, agent_state_root=run_state_dir(run_id), **options)
    config.rollout_timeout_s = (
        rollout_timeout if rollout_timeout is not None else derived_rollout_timeout_s(config, 10.0)
    )
    return config


def _run(
    url: str,
    config: SimConfig,
    use_ray: bool,
    ray_kill_after: int | None,
    quiet: bool,
    metrics_port: int | None,
    otel: bool,
) -> tuple[dict[str, Any], str]:
    """Runs the workload until it ends or a signal stops it; (summary, the log's URL as shown)."""
    from eventstore import open_store
    from simulation.run import RunInterrupted, RunStalled, SimulationError
    from trainer.errors import AgentShared, CoordinatorStopped, FencedOff
    from trainer.ray_gym.local import RayNotLoopback
    from trainer.stops import said_by_caller

    store = open_store(url, migrate_schema=True)
    exporter = None
    try:
        if metrics_port is not None:
            from cli.metrics import serve_metrics

            exporter = serve_metrics(store, metrics_port, "trainer")
        try:
            with said_by_caller():  # a CoordinatorStopped is the one `error:` line below, not a log line too
                summary = run_until_stopped(
                    lambda stop: _drive(store, url, config, use_ray, ray_kill_after, quiet, stop)
                )
        except RunInterrupted as exc:
            err_console.print(escape(exc.line()), soft_wrap=True, highlight=False)
            raise typer.Exit(130 if exc.signum is None else 128 + exc.signum) from None
        except Interrupted as exc:
            err_console.print(
                f"interrupted again: run {config.run_id} stopped at once (its agents were stopped); "
                f"carry on with: ledger simulate --resume {config.run_id}",
                soft_wrap=True,
                highlight=False,
            )
            raise typer.Exit(exc.exit_code) from None
        except RunStalled as exc:
            error(str(exc))
            raise typer.Exit(1) from None
        except CoordinatorStopped as exc:  # the log or the payload store stayed away past its budget
            error(
                f"run {config.run_id} stopped: {exc}; carry on with: ledger simulate --resume {config.run_id}"
            )
            raise typer.Exit(2) from None
        except FencedOff as exc:  # another coordinator (a `--resume` of this run) took the log over
            error(
                f"run {config.run_id} stopped: {exc}; the coordinator that took over carries the run on "
                f"(if it has stopped too: ledger simulate --resume {config.run_id})"
            )
            raise typer.Exit(2) from None
        except (SimulationError, RayNotLoopback) as exc:
            error(str(exc))
            raise typer.Exit(2) from None
        except AgentShared as exc:  # an agent another trainer drives, at the start or at a later call
            error(f"run {config.run_id}: {exc}")
            raise typer.Exit(2) from None
        if otel:
            traced = emit_run_spans(store, summary["run_id"])
            err_console.print(f"{traced} tries traced")
        return summary, store.url
    finally:
        if exporter is not None:
            exporter.close()
        store.close()


async def _drive(
    store: EventStore,
    url: str,
    config: SimConfig,
    use_ray: bool,
    ray_kill_after: int | None,
    quiet: bool,
    stop: StopRequest,
) -> dict[str, Any]:
    from simulation.run import RunInterrupted, run_simulation, run_with_trainer_kills

    if use_ray:
        from simulation.ray_run import run_ray_simulation

        # Ray prints the task errors it retries (an actor killed) to stdout: keep stdout the summary's.
        with contextlib.redirect_stdout(sys.stderr):
            ray_run = run_ray_simulation(store, url, config, kill_after=ray_kill_after)
            return await _until(ray_run, stop, config.run_id)
    with _progress(config.groups, quiet) as progress:
        try:
            if config.kill_trainer_every_s is not None:
                every = config.kill_trainer_every_s
                return await run_with_trainer_kills(store, config, every, progress=progress, stop=stop)
            return await run_simulation(store, config, progress=progress, stop=stop)
        except RunInterrupted as exc:
            exc.signum = stop.signum
            raise


async def _until(run: Any, stop: StopRequest, run_id: str) -> dict[str, Any]:
    """A run that has no wind-down of its own (the Ray actor's): cancelled at the first signal (its
    `finally` shuts Ray down and stops the agents)."""
    import asyncio

    from simulation.run import RunInterrupted

    task = asyncio.ensure_future(run)
    stopping = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            raise RunInterrupted(run_id, 0, 0, 0, 0, signum=stop.signum)
        return dict(task.result())
    finally:
        stopping.cancel()


@contextlib.contextmanager
def _progress(total: int, quiet: bool) -> Any:
    """`progress(decided, total)` for the run: a bar on a terminal, else a line every few seconds."""
    if quiet:
        yield None
        return
    if err_console.is_terminal:
        columns = (TextColumn("groups"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        with Progress(*columns, console=err_console) as bar:
            task = bar.add_task("groups", total=total)
            yield lambda done, _total: bar.update(task, completed=done)
        return
    started = time.monotonic()
    last = [started - PROGRESS_LINE_EVERY_S, -1]

    def line(done: int, total: int) -> None:
        now = time.monotonic()
        if now - last[0] >= PROGRESS_LINE_EVERY_S or (done == total and last[1] != done):
            last[0], last[1] = now, done
            err_console.print(f"groups {done}/{total} decided ({now - started:.0f} s)", highlight=False)

    yield line


def _verdict(summary: Mapping[str, Any], failing: bool) -> str:
    """One line: whether the run kept the promise (nothing stranded, nothing ran twice, the audit
    clean), with the figures that say so."""
    audit = summary["audit_violations"]
    figures = f"{summary['stranded']} stranded, {summary['duplicate_executions']} duplicate executions, " + (
        "audit not run"
        if audit is None
        else f"{audit} audit violations"
        + (f" ({summary['audit_rules']} rules)" if summary.get("audit_rules") else "")
    )
    if "rows" in summary:  # the Ray run: every row back once
        figures += f", {summary['rows_delivered']}/{summary['rows']} rows delivered"
        figures += f" ({summary['rows_delivered_twice']} twice)"
    return f"{'FAIL' if failing else 'PASS'}: {figures}"


# The summary's sections: (title, keys) in the order they are printed; any key not named here is
# printed under "other", so a figure a driver adds is never hidden.
SECTIONS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "run",
        (
            "run_id",
            "mode",
            "target_level",
            "agents",
            "groups",
            "siblings",
            "wall_s",
            "trainer_kills",
            "ray",
            "actor_kills",
        ),
    ),
    ("groups", ("groups_sealed", "groups_claimed", "groups_abandoned", "groups_dead_lettered")),
    ("tries", ("tries", "replacements", "retired", "adopted")),
    ("ACKs", ("acks_accepted", "acks_rejected", "debts_outstanding")),
    (
        "checkpoints",
        ("checkpoints_committed", "checkpoints_aborted", "prepare_wait_p50_s", "prepare_wait_max_s"),
    ),
    (
        "generation",
        (
            "model_s",
            "generated_tokens",
            "thrown_by_checkpoints_model_s",
            "thrown_by_checkpoints_tokens",
            "thrown_by_checkpoints_tries",
            "thrown_by_checkpoints_share",
        ),
    ),
    (
        "turns",
        (
            "turns_resumed",
            "turns_redone",
            "model_tokens_saved",
            "continuations_resumed",
            "continuations_declined",
        ),
    ),
    ("side effects", ("side_effects_applied", "side_effects_reverted", "side_effects_twice")),
    ("agents", ("agent_restarts", "reduced_mode_agents")),
    ("rows", ("rows", "rows_delivered", "rows_delivered_twice")),
    (
        "the promise",
        ("stranded", "duplicate_executions", "audit_violations", "audit_rules", "audit_rules_broken"),
    ),
    ("the log", ("events", "journal_appends", "journal_batches", "payload_puts", "payload_store_calls")),
)


def print_summary(summary: Mapping[str, Any], store_url: str) -> None:
    """The summary as a table in sections, then the verdict line."""
    table = Table(title=f"ledger simulate ({summary['run_id']}, {escape(store_url)})", show_lines=False)
    table.add_column("section")
    table.add_column("figure")
    table.add_column("value", justify="right")
    named = {k for _, keys in SECTIONS for k in keys} | {
        "verdict",
        "thrown_by_checkpoints_warning",
        "compare",
    }
    sections: list[tuple[str, tuple[str, ...], Mapping[str, Any]]] = [
        (title, keys, summary) for title, keys in SECTIONS
    ]
    sections.append(("other", tuple(k for k in summary if k not in named), summary))
    if isinstance(summary.get("compare"), Mapping):
        compared = summary["compare"]
        sections.append((f"compare ({compared.get('target_level')})", COMPARED, compared))
    for title, keys, values in sections:
        present = [k for k in keys if k in values]
        for i, key in enumerate(present):
            value = values[key]
            shown = (
                "-"
                if value is None
                else ", ".join(value) or "none"
                if isinstance(value, list)
                else str(value)
            )
            table.add_row(title if i == 0 else "", key, shown, end_section=i == len(present) - 1)
    console.print(table)
    if summary.get("thrown_by_checkpoints_warning"):
        console.print(f"[yellow]warning:[/yellow] {escape(str(summary['thrown_by_checkpoints_warning']))}")
    verdict = str(summary["verdict"])
    console.print(f"[{'red' if verdict.startswith('FAIL') else 'green'}]{escape(verdict)}[/]", soft_wrap=True)


def _explore(seeds: int, first_seed: int, as_json: bool) -> None:
    from simulation.explore import explore
    from simulation.explore_progress import explore_progress
    from simulation.explore_turns import explore_turns

    started = time.monotonic()
    result = explore(seeds, first_seed)
    # Progress under frequent checkpoints: a schedule there is some 20 times one of the core's.
    progress = explore_progress(max(1, seeds // 20), first_seed)
    # Turn-level resume under faults: a schedule there is some 10 times one of the core's.
    turns = explore_turns(max(1, seeds // 10), first_seed)
    violations = dict(result.violations)
    for seed, found in progress.violations.items():
        violations[seed] = [*violations.get(seed, []), *(f"progress: {m}" for m in found)]
    for seed, found in turns.violations.items():
        violations[seed] = [*violations.get(seed, []), *(f"turns: {m}" for m in found)]
    summary = {
        "seeds_explored": result.seeds,
        "first_seed": result.first_seed,
        "calls": result.calls,
        "agent_restarts": result.restarts,
        "participants_lost": result.lost,
        "participants_stuck": result.stuck,
        "tries_declared_lost": result.tries_lost,
        "progress_schedules": progress.seeds,
        "progress_groups_sealed": progress.groups_sealed,
        "progress_groups_dead_lettered": progress.groups_dead_lettered,
        "progress_checkpoints": progress.checkpoints,
        "progress_checkpoints_aborted": progress.checkpoints_aborted,
        "progress_thrown_by_checkpoints_share": round(progress.thrown_s / progress.model_s, 4)
        if progress.model_s
        else 0.0,
        "progress_prepare_wait_p50_s": progress.prepare_wait_p50_s,
        "turn_schedules": turns.seeds,
        "turn_rollouts_finished": turns.finished,
        "turn_rollouts_dead_lettered": turns.dead_lettered,
        "turn_resumes": turns.resumes,
        "turn_turns_resumed": turns.turns_resumed,
        "turn_faults": sum(turns.faults.values()),
        "turn_resumes_declined": dict(sorted(turns.declined.items())),
        "turn_side_effects": turns.side_effects,
        "violations": sum(len(v) for v in violations.values()),
        "failing_seeds": sorted(violations)[:50],
        "wall_s": round(time.monotonic() - started, 2),
    }
    _report_exploration(summary, violations, "--explore 1", as_json)


def _explore_real(seeds: int, first_seed: int, db: str | None, as_json: bool) -> None:
    from simulation.explore_store import explore_real
    from trainer.eventloop import run_async

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
    require_extra("otel", "--otel", "opentelemetry.sdk.trace")
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter

    from protocol.streams import group_stream
    from trainer.tracing import emit_try_spans, tracer_resource

    exporter: SpanExporter
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter()
    except ImportError:
        exporter = ConsoleSpanExporter(out=sys.stderr)
    provider = TracerProvider(resource=tracer_resource(run_id))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    prefix = group_stream(run_id)
    events = (e for e in store.read_all(0) if e.stream_id.startswith(prefix))
    traced = emit_try_spans(events, provider.get_tracer("rollout-ledger"))
    provider.shutdown()
    return traced
