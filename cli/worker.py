"""`ledger worker ...`: background workers that read the log and append their results to it."""

from __future__ import annotations

import json
import logging
import signal
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, cast

import typer
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
    require_extra,
)

if TYPE_CHECKING:  # torch and the workers come with the `workers` extra, imported by the command
    from workers.logprobs import LogprobWorker, QueueCounts, WorkerStats

app = typer.Typer(no_args_is_help=True, help="Workers that score what the log holds.")


@app.command()
def logprobs(
    db: DbOption = None,
    device: Annotated[str, typer.Option("--device", help="cpu | cuda")] = "cpu",
    policy: Annotated[
        str | None,
        typer.Option(
            "--policy",
            help="Policy spec, e.g. tiny or tiny:seed=1 (default: the reference policy).",
            show_default=False,
        ),
    ] = None,
    once: Annotated[
        bool, typer.Option("--once", help="Drain the work there is, then exit (else keep following the log).")
    ] = False,
    batch_tokens: Annotated[
        int, typer.Option("--batch-tokens", min=1, help="Most token rows in one kernel launch.")
    ] = 4096,
    claim_size: Annotated[int, typer.Option("--claim-size", min=1, help="Attempts claimed at a time.")] = 32,
    lease_seconds: Annotated[
        float, typer.Option("--lease-seconds", min=0.1, help="A claim returns to the queue after this long.")
    ] = 60.0,
    temperature: Annotated[
        float,
        typer.Option("--temperature", min=1e-6, help="The agents' sampling temperature."),
    ] = 1.0,
    backend: Annotated[
        str, typer.Option("--backend", help="Kernel: auto (Triton on CUDA), triton, torch.")
    ] = "auto",
    poll_interval: Annotated[float, typer.Option("--poll-interval", min=0.01)] = 1.0,
    as_json: Annotated[bool, typer.Option("--json", help="Print the summary as JSON.")] = False,
    metrics_port: Annotated[
        int | None,
        typer.Option(
            "--metrics-port",
            min=0,
            max=65535,
            help="Serve Prometheus metrics on /metrics at this port while the worker runs (`metrics` extra).",
        ),
    ] = None,
) -> None:
    """Score sealed tries under the current policy and append LogprobsComputed (or LogprobsRefused).

    Many workers can share one PostgreSQL log (claims are leased with FOR UPDATE SKIP LOCKED); use one
    worker per SQLite file.  Token records are read from the log's blob table, never from an agent.
    """
    require_extra("workers", "ledger worker logprobs", "numpy", "torch", "triton", "workers.logprobs")
    # A stop asked while the policy loads or the database connects is kept, and honoured at once.
    stop_asked = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda *_: stop_asked.set())
    try:
        _logprobs(db, device, policy, once, batch_tokens, claim_size, lease_seconds, temperature,
                  backend, poll_interval, as_json, stop_asked, metrics_port)  # fmt: skip
    finally:
        signal.signal(signal.SIGTERM, previous)


def _logprobs(
    db: str | None,
    device: str,
    policy: str | None,
    once: bool,
    batch_tokens: int,
    claim_size: int,
    lease_seconds: float,
    temperature: float,
    backend: str,
    poll_interval: float,
    as_json: bool,
    stop_asked: threading.Event,
    metrics_port: int | None = None,
) -> None:
    import torch

    from cli.metrics import serve_metrics
    from eventstore import open_store
    from workers.kernels import Backend
    from workers.logprobs import LogprobWorker, WorkerConfig, WorkerStopped
    from workers.policy import DEFAULT_POLICY_SPEC, load_policy

    if device not in ("cpu", "cuda"):
        raise typer.BadParameter("--device must be cpu or cuda")
    if device == "cuda" and not torch.cuda.is_available():
        raise typer.BadParameter("--device cuda, but torch sees no CUDA device")
    if backend not in ("auto", "triton", "torch"):
        raise typer.BadParameter("--backend must be auto, triton or torch")
    try:
        loaded = load_policy(policy or DEFAULT_POLICY_SPEC)
    except ValueError as exc:
        raise typer.BadParameter(bounded(str(exc), ERROR_LIMIT)) from None
    logging.basicConfig(level=logging.WARNING)
    config = WorkerConfig(
        batch_tokens=batch_tokens,
        claim_size=claim_size,
        lease_s=lease_seconds,
        poll_interval_s=poll_interval,
        temperature=temperature,
        backend=cast(Backend, backend),
        device=device,
    )
    with clear_errors():
        store = open_store(db_url(db), migrate_schema=True)
        try:
            worker = LogprobWorker(store, loaded, config)
            exporter = (
                serve_metrics(store, metrics_port, "worker", worker) if metrics_port is not None else None
            )
            err_console.print(
                f"worker {worker.worker_id} scoring for policy {worker.policy_version} on {store.url} ({device})"
            )
            try:
                stats = _run(worker, once, quiet=as_json, stop_asked=stop_asked)
                counts = worker.counts()
            except WorkerStopped as exc:
                err_console.print(f"[red]error:[/red] {exc}")
                raise typer.Exit(2) from None
            finally:
                if exporter is not None:
                    exporter.close()
        finally:
            store.close()
    _summary(worker, stats, counts, as_json)


def _run(worker: LogprobWorker, once: bool, quiet: bool, stop_asked: threading.Event) -> WorkerStats:
    if quiet:
        return _interruptible(worker, once, None, stop_asked)
    with Progress(
        TextColumn("tries scored"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[detail]}"),
        TimeElapsedColumn(),
        console=err_console,
    ) as bar:
        task = bar.add_task("tries", total=None, detail="")

        def show(counts: QueueCounts, stats: WorkerStats) -> None:
            detail = (
                f"mine: {stats.scored} scored, {stats.refused} refused, max |diff| {stats.max_abs_diff:.2e}"
            )
            bar.update(task, total=counts.total, completed=counts.done, detail=detail)

        return _interruptible(worker, once, show, stop_asked)


def _interruptible(
    worker: LogprobWorker,
    once: bool,
    show: Callable[[QueueCounts, WorkerStats], None] | None,
    stop_asked: threading.Event,
) -> WorkerStats:
    # SIGTERM (a supervisor stopping the worker) finishes the batch in hand, then exits cleanly.
    previous = signal.signal(signal.SIGTERM, lambda *_: worker.stop())
    if stop_asked.is_set():
        worker.stop()
    try:
        return worker.run(once=once, on_progress=show)
    except KeyboardInterrupt:
        # Unfinished claims were given back by the worker; what finished is in the log.
        err_console.print("interrupted")
        return worker.stats
    finally:
        signal.signal(signal.SIGTERM, previous)


def _summary(worker: LogprobWorker, stats: WorkerStats, counts: QueueCounts, as_json: bool) -> None:
    summary: dict[str, object] = {
        "worker": worker.worker_id,
        "policy_version": worker.policy_version,
        "scored": stats.scored,
        "refused": stats.refused,
        "duplicates": stats.duplicates,
        "tokens": stats.tokens,
        "max_abs_diff": stats.max_abs_diff,
        "queue_done": counts.done,
        "queue_open": counts.open,
    }
    if as_json:
        console.print_json(json.dumps({**summary, "refusals": stats.refusals}))
        return
    table = Table(title="ledger worker logprobs")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in summary.items():
        table.add_row(key, f"{value:.3e}" if key == "max_abs_diff" else str(value))
    console.print(table)
    for line in stats.refusals:
        err_console.print(f"[yellow]refused[/yellow] {line}")
