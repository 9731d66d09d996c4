"""`ledger console`: the live, read-only web console over the log (docs/console.md)."""

from __future__ import annotations

import ipaddress
from typing import Annotated

import typer

from cli.common import DbOption, clear_errors, db_url, err_console, error, require_extra

# Shown by `--help` before anything heavy is imported (console._serve holds the same values).
_DEFAULT_HOST = "127.0.0.1"
_DEFAULT_PORT = 8080
_TOKEN_ENV = "LEDGER_CONSOLE_TOKEN"


def register(app: typer.Typer) -> None:
    app.command("console")(console_command)


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def console_command(
    db: DbOption = None,
    host: Annotated[
        str, typer.Option("--host", help="Address to listen on (loopback unless told otherwise).")
    ] = _DEFAULT_HOST,
    port: Annotated[
        int, typer.Option("--port", min=0, max=65535, help="Port (0: a free one).")
    ] = _DEFAULT_PORT,
    token: Annotated[
        str | None,
        typer.Option(
            "--token",
            envvar=_TOKEN_ENV,
            show_envvar=True,
            help="Token every page but /health then needs (Bearer, or HTTP Basic with the token as password).",
        ),
    ] = None,
    payloads: Annotated[
        str | None,
        typer.Option(
            "--payloads",
            help="The payload store the log's writers used (default: $LEDGER_PAYLOADS, else beside the log).",
        ),
    ] = None,
    poll_interval: Annotated[
        float, typer.Option("--poll-interval", min=0.01, max=10.0, help="Seconds between polls of the log.")
    ] = 0.1,
) -> None:
    """Serve a live, read-only web console over the log: the run's overview (pushed as it changes),
    groups, one rollout's tries and payloads, checkpoints, the samples of a train step, the audit.

    It opens the log read-only, as the auditor role when $LEDGER_AUDITOR_DB is set, and answers GET
    only.  Ctrl-C or SIGTERM stops it (exit status 0)."""
    require_extra("console", "ledger console", "uvicorn", "jinja2")
    from console import ConsoleConfig, serve
    from eventstore import open_store

    secret = token or None
    if not _loopback(host) and secret is None:
        err_console.print(
            f"[yellow]warning:[/yellow] listening on {host} without a token: anyone who reaches the port "
            f"reads the log (--token or ${_TOKEN_ENV})",
            soft_wrap=True,
        )
    with clear_errors():
        url = db_url(db, "auditor")
        store = open_store(url, read_only=True)
        try:
            config = ConsoleConfig(url=url, payloads=payloads, token=secret, poll_interval_s=poll_interval)
            try:
                status = serve(
                    store,
                    config,
                    host,
                    port,
                    lambda where: typer.echo(f"ledger console: {where} (read-only; Ctrl-C stops it)"),
                )
            except OSError as exc:
                error(f"cannot listen on {host}:{port}: {exc.strerror or exc}")
                raise typer.Exit(2) from None
        finally:
            store.close()
    raise typer.Exit(status)
