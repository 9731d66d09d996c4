"""`ledger projections run`: the projection runner, which keeps projection checkpoints current so that
`ledger replay`, `ledger status` and a recovering trainer read only the tail of the log."""

from __future__ import annotations

import signal
from typing import Annotated

import typer

from cli.common import DbOption, clear_errors, console, db_url

app = typer.Typer(no_args_is_help=True, help="The projections folded from the log.")


@app.command("run")
def run(
    db: DbOption = None,
    checkpoint_every: Annotated[
        int, typer.Option("--checkpoint-every", min=1, help="Store a checkpoint every N events.")
    ] = 10_000,
    keep: Annotated[
        int, typer.Option("--keep", min=0, help="Checkpoints kept per projection (0: every one).")
    ] = 20,
    once: Annotated[
        bool, typer.Option("--once", help="Catch up, store a checkpoint at the head, and exit.")
    ] = False,
    idle_exit: Annotated[
        float | None, typer.Option("--idle-exit", min=0.0, help="Exit after this many idle seconds.")
    ] = None,
    poll_interval: Annotated[float, typer.Option("--poll-interval", min=0.01)] = 0.05,
) -> None:
    """Follow the log and fold every projection, storing a checkpoint every `--checkpoint-every` events.

    It resumes from the newest checkpoint its projections share, so a runner killed at any point comes
    back to the states a rebuild from scratch gives.  SIGTERM or Ctrl-C stops it at its next poll, with
    a checkpoint at the position it reached.  A lost database ends it with exit status 2 (its
    supervisor starts it again; it resumes from its last checkpoint).
    """
    from eventstore import open_store
    from projections.runner import ProjectionRunner

    with clear_errors():
        store = open_store(db_url(db))
        try:
            runner = ProjectionRunner(
                store, checkpoint_every=checkpoint_every, keep=keep if keep > 0 else None
            )
            started_at = runner.position
            if once:
                runner.catch_up()
                if runner.position > runner.last_checkpoint:
                    runner.checkpoint()
            else:
                stops = {
                    sig: signal.signal(sig, lambda *_: runner.stop())
                    for sig in (signal.SIGTERM, signal.SIGINT)
                }
                try:
                    runner.run(idle_exit_s=idle_exit, poll_interval_s=poll_interval)
                finally:
                    for sig, previous in stops.items():
                        signal.signal(sig, previous)
        finally:
            store.close()
    console.print(
        f"projection runner: from position {started_at} to {runner.position}; "
        f"last checkpoint at {runner.last_checkpoint}"
    )
