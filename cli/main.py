"""The `ledger` command: one typer app, one module per command group."""

from __future__ import annotations

import typer

from cli import console, db, debt, inspect, payloads, projections, simulate, worker
from gym_agent.cli import app as gym_app

app = typer.Typer(
    name="ledger",
    help="Event-sourced hand-off of RL rollouts between trainers and Gym agents.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
)
app.add_typer(db.app, name="db")
app.add_typer(debt.app, name="debt")
app.add_typer(gym_app, name="gym")
app.add_typer(worker.app, name="worker")
app.add_typer(payloads.app, name="payloads")
app.add_typer(projections.app, name="projections")
simulate.register(app)
inspect.register(app)
console.register(app)

if __name__ == "__main__":
    app()
