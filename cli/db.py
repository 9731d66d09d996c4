"""`ledger db ...`: migrations and roles."""

from __future__ import annotations

from typing import Annotated

import typer

from cli.common import DbOption, clear_errors, console, db_url, mask_url

app = typer.Typer(no_args_is_help=True, help="Schema migrations and database roles.")


@app.command()
def upgrade(db: DbOption = None) -> None:
    """Bring the database to the migration head (creates the schema on a new database)."""
    from eventstore import upgrade_database

    with clear_errors():
        url = db_url(db)
        revision = upgrade_database(url)
    console.print(f"{mask_url(url)} is at migration [bold]{revision}[/bold]")


@app.command()
def current(db: DbOption = None) -> None:
    """Print the database's migration revision and the head this code expects."""
    from eventstore import check_reachable, migrate
    from eventstore.backends import create_engines

    with clear_errors():
        url = db_url(db)
        engine = create_engines(url, pool_size=1, read_only=True)[1]  # never creates a missing file
        try:
            revision = check_reachable(url, engine)
        finally:
            engine.dispose()
    console.print(f"database: {revision or '(no schema)'}   head: {migrate.head_revision()}")


@app.command()
def roles(
    db: DbOption = None,
    writer: Annotated[
        str, typer.Option(help="Role that appends: INSERT and SELECT on the log")
    ] = "ledger_writer",
    writer_password: Annotated[
        str, typer.Option(envvar="LEDGER_WRITER_PASSWORD", prompt=True, hide_input=True)
    ] = "",
    auditor: Annotated[str, typer.Option(help="Read-only role for auditors")] = "ledger_auditor",
    auditor_password: Annotated[
        str, typer.Option(envvar="LEDGER_AUDITOR_PASSWORD", prompt=True, hide_input=True)
    ] = "",
) -> None:
    """Create (or update) the writer and auditor roles on PostgreSQL."""
    from eventstore.backends import create_engines
    from eventstore.roles import create_roles

    with clear_errors():
        url = db_url(db)
        engine = create_engines(url, pool_size=1)[0]
        try:
            create_roles(url, engine, writer, writer_password, auditor, auditor_password)
        finally:
            engine.dispose()
    console.print(f"roles {writer} (SELECT, INSERT) and {auditor} (SELECT) ready on {mask_url(url)}")
