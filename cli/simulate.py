"""Top-level `ledger` commands of this module (placeholder until its issue lands)."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    """Adds this module's commands to the `ledger` app."""
