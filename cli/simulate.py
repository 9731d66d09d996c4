"""`ledger simulate`: run a faulty rollout workload against reference agents and summarise it."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Annotated

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from cli.common import DbOption, clear_errors, console, db_url, err_console
from eventstore import open_store
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
) -> None:
    """Runs GROUPS prompt groups through the coordinator with faults and checkpoints, then reports.

    The log defaults to ./ledger.db (or $LEDGER_DB); each run uses its own id prefix, so running
    twice on the same file is fine.  Exit status 1 if any result was stranded, any try ran twice,
    or the auditor found a violation.
    """
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
    with clear_errors():
        store = open_store(db_url(db), migrate_schema=True)
        try:
            if as_json:
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
        finally:
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
    if failed(summary):
        raise typer.Exit(1)
